"""Distillation losses. Each is a small function of padded tensors and a token mask.

Conventions: B = batch, T = tokens (padded), H = hidden size, V = vocabulary. `mask` is [B, T],
bool or 0/1, True on real tokens; padded positions never contribute, and an all-padding batch gives
a loss of exactly 0 (with zero gradients) rather than NaN, so a rank without data can take part in
a collective step. Every function returns a scalar: the mean over real tokens. Each one is tested
against a naive per-token reference in tests/test_losses.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _up(x: torch.Tensor) -> torch.Tensor:
    """fp16/bf16 -> fp32 for softmax-type math; fp32/fp64 stay as they are."""
    return x.float() if x.element_size() < 4 else x


def _tokens(mask: torch.Tensor) -> torch.Tensor:
    return mask.sum().clamp(min=1)


def mse(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean squared error per feature, averaged over real tokens.

    Args:
        student: [B, T, H] student states (projected to the teacher's width).
        teacher: [B, T, H] teacher states (no gradient needed).
        mask: [B, T] True on real tokens.

    Returns:
        Scalar: sum over real tokens of mean_h (s - t)^2, divided by the number of real tokens.
    """
    m = mask.to(student.dtype)
    per_token = (student - teacher).pow(2).mean(dim=-1)  # [B, T]
    return (per_token * m).sum() / _tokens(m)


def cosine(
    student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8
) -> torch.Tensor:
    """1 - cosine similarity per token, averaged over real tokens.

    Args:
        student: [B, T, H] student states.
        teacher: [B, T, H] teacher states.
        mask: [B, T] True on real tokens.
        eps: floor of each vector norm.

    Returns:
        Scalar in [0, 2].
    """
    m = mask.to(student.dtype)
    cos = F.cosine_similarity(student, teacher, dim=-1, eps=eps)  # [B, T]
    return ((1.0 - cos) * m).sum() / _tokens(m)


def nmse(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """MSE after standardising every feature with the teacher's statistics over the batch's real tokens.

    Both sides are mapped x -> (x - mean_t) / sqrt(var_t + eps), with mean_t, var_t [H] the
    per-feature mean and (biased) variance of the teacher states over real tokens, treated as
    constants (no gradient). This makes the loss independent of the scale of each teacher feature
    (a few outlier features with large magnitude do not dominate). A standardised teacher has unit
    variance per feature, so predicting the teacher's mean scores about 1.0.

    Args:
        student: [B, T, H] student states (projected to the teacher's width).
        teacher: [B, T, H] teacher states.
        mask: [B, T] True on real tokens.
        eps: added to the variance.

    Returns:
        Scalar: mean over real tokens of mean_h ((s - t) / sqrt(var_t + eps))^2.
    """
    m = mask.to(teacher.dtype).unsqueeze(-1)  # [B, T, 1]
    n = _tokens(m)
    with torch.no_grad():
        t = teacher.detach()
        mean = (t * m).sum(dim=(0, 1)) / n  # [H]
        var = ((t - mean).pow(2) * m).sum(dim=(0, 1)) / n  # [H]
        inv_std = torch.rsqrt(var + eps)
    # (s - mean) * inv - (t - mean) * inv == (s - t) * inv
    return mse(student * inv_std, teacher * inv_std, mask)


def kl(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """KL(teacher || student) of the softened next-token distributions, averaged over real tokens.

    Args:
        student_logits: [B, T, V].
        teacher_logits: [B, T, V] (recomputed on the student side from the teacher's last layer).
        mask: [B, T] True on real tokens.
        temperature: both sides' logits are divided by it; the result is multiplied by
            temperature**2 so gradient magnitudes do not shrink as it grows (Hinton et al., 2015).

    Returns:
        Scalar: mean over real tokens of sum_v p_t(v) (log p_t(v) - log p_s(v)), times temperature**2.
    """
    t_logp = F.log_softmax(_up(teacher_logits) / temperature, dim=-1)
    s_logp = F.log_softmax(_up(student_logits) / temperature, dim=-1)
    per_token = (t_logp.exp() * (t_logp - s_logp)).sum(dim=-1)  # [B, T]
    m = mask.to(per_token.dtype)
    return (per_token * m).sum() / _tokens(m) * temperature**2


def ce(logits: torch.Tensor, token_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: position i predicts token i + 1, where both are real tokens.

    Args:
        logits: [B, T, V].
        token_ids: [B, T] int.
        mask: [B, T] True on real tokens.

    Returns:
        Scalar: mean over positions i with mask[i] and mask[i + 1] of -log p(token[i + 1]).
    """
    logp = F.log_softmax(_up(logits[:, :-1]), dim=-1)  # [B, T-1, V]
    nll = -logp.gather(-1, token_ids[:, 1:].long().unsqueeze(-1)).squeeze(-1)  # [B, T-1]
    m = (mask[:, :-1].bool() & mask[:, 1:].bool()).to(nll.dtype)
    return (nll * m).sum() / _tokens(m)

"""Distillation losses. Each is a small function of padded tensors and a token mask.

Conventions: B = batch, T = tokens (padded), H = hidden size, V = vocabulary. `mask` is [B, T],
bool or 0/1, True on real tokens; padded positions never contribute, and an all-padding batch gives
a loss of exactly 0 (with zero gradients) rather than NaN, so a rank without data can take part in
a collective step. Every function returns a scalar: the mean over real tokens. Each one is tested
against a naive per-token reference in tests/student/test_losses.py.

`loss_mask` (optional, [B, T] bool or 0/1, the teacher's per-token mask: `student.loss_on: masked`)
narrows the tokens a term is averaged over:
  * hidden-state terms (mse, cosine, nmse): token i counts when loss_mask[i] (nmse's statistics
    are taken over those tokens too);
  * ce: the prediction of token i + 1 counts when loss_mask[i + 1] (its target is a trained token);
  * kl: the distribution at position i (the prediction of token i + 1) counts when
    loss_mask[i + 1]; at a row's last real position, whose next token is not in the sample (a
    generated response's last state), when loss_mask[i]. See `target_mask`.
None: every real token counts (`loss_on: all`).

`ends` (optional, [B, T] bool: True on each sample's last token): packed rows (student/packing.py)
hold several samples one after another; the terms that look at the next token (ce, kl with a loss
mask) treat a sample's last token as a row's last real one, so no sample predicts the next
sample's first token. None: right-padded rows, one sample each.

Samples that hold some positions' teacher states only (`teacher.capture: loss_mask`, `Batch.held`):
the hidden-state terms and kl count held positions only (the caller narrows the mask; kl's `held`);
ce reads no teacher state and is unaffected.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _up(x: torch.Tensor) -> torch.Tensor:
    """fp16/bf16 -> fp32 for softmax-type math; fp32/fp64 stay as they are."""
    return x.float() if x.element_size() < 4 else x


def _tokens(mask: torch.Tensor) -> torch.Tensor:
    return mask.sum().clamp(min=1)


def token_mask(mask: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor:
    """[B, T] bool: real tokens that are trained (`mask` and `loss_mask`); `mask` when None."""
    m = mask.bool()
    return m if loss_mask is None else m & loss_mask.bool()


def next_in_sample(mask: torch.Tensor, ends: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] bool: token i + 1 is real and belongs to token i's sample."""
    m = mask.bool()
    nxt = torch.zeros_like(m)
    nxt[:, :-1] = m[:, 1:]
    return nxt if ends is None else nxt & ~ends.bool()


def target_mask(
    mask: torch.Tensor, loss_mask: torch.Tensor | None, ends: torch.Tensor | None = None
) -> torch.Tensor:
    """[B, T] bool: positions whose next-token prediction is trained. Position i counts when tokens
    i and i + 1 are real and of one sample and loss_mask[i + 1]; a sample's last position when
    loss_mask[i] (its next token is not in the sample). `mask` when `loss_mask` is None."""
    m = mask.bool()
    if loss_mask is None:
        return m
    lm = loss_mask.bool() & m
    nxt_real = next_in_sample(m, ends)
    nxt = torch.zeros_like(m)
    nxt[:, :-1] = lm[:, 1:]
    return (m & nxt_real & nxt) | (m & ~nxt_real & lm)


def mse(
    student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, loss_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean squared error per feature, averaged over real tokens.

    Args:
        student: [B, T, H] student states (projected to the teacher's width).
        teacher: [B, T, H] teacher states (no gradient needed).
        mask: [B, T] True on real tokens.

    Returns:
        Scalar: sum over real tokens of mean_h (s - t)^2, divided by the number of real tokens.
    """
    m = token_mask(mask, loss_mask).to(student.dtype)
    per_token = (student - teacher).pow(2).mean(dim=-1)  # [B, T]
    return (per_token * m).sum() / _tokens(m)


def cosine(
    student: torch.Tensor,
    teacher: torch.Tensor,
    mask: torch.Tensor,
    eps: float = 1e-8,
    loss_mask: torch.Tensor | None = None,
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
    m = token_mask(mask, loss_mask).to(student.dtype)
    cos = F.cosine_similarity(student, teacher, dim=-1, eps=eps)  # [B, T]
    return ((1.0 - cos) * m).sum() / _tokens(m)


def nmse(
    student: torch.Tensor,
    teacher: torch.Tensor,
    mask: torch.Tensor,
    eps: float = 1e-5,
    loss_mask: torch.Tensor | None = None,
) -> torch.Tensor:
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
    mask = token_mask(mask, loss_mask)
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
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    temperature: float = 1.0,
    loss_mask: torch.Tensor | None = None,
    held: torch.Tensor | None = None,
    ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """KL(teacher || student) of the softened next-token distributions, averaged over real tokens.
    `held` ([B, T] bool, optional): the positions whose teacher states (hence logits) exist
    (teacher.capture: loss_mask); a position counts only when held.

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
    m = target_mask(mask, loss_mask, ends)
    m = (m if held is None else m & held.bool()).to(per_token.dtype)
    return (per_token * m).sum() / _tokens(m) * temperature**2


def ce(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    mask: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next-token cross-entropy: position i predicts token i + 1, where both are real tokens of one
    sample.

    Args:
        logits: [B, T, V].
        token_ids: [B, T] int.
        mask: [B, T] True on real tokens.

    Returns:
        Scalar: mean over positions i with mask[i] and mask[i + 1] of -log p(token[i + 1]).
    """
    logp = F.log_softmax(_up(logits[:, :-1]), dim=-1)  # [B, T-1, V]
    nll = -logp.gather(-1, token_ids[:, 1:].long().unsqueeze(-1)).squeeze(-1)  # [B, T-1]
    tm = token_mask(mask, loss_mask)  # the target (token i + 1) must be real and trained
    m = (next_in_sample(mask, ends)[:, :-1] & mask[:, :-1].bool() & tm[:, 1:]).to(nll.dtype)
    return (nll * m).sum() / _tokens(m)

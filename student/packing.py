"""Packed batches: a micro-batch's samples one after another in a single row, no padding.

`student.batch_layout: packed` (the default of the distill recipe). The row is
[1, N] tokens with N = the samples' tokens; each sample keeps its own positions (0, 1, ... per
sample, so rotary embeddings see what they would see alone) and attends to its own tokens only.
The attention is this module's `packed_attention`, registered with transformers' AttentionInterface
as `ATTENTION`; the student model runs with it (`use_packed_attention`):

* a packed batch (the forward got `distill_packed=Segments`): variable-length attention, one kernel
  for every sample of the row: `torch.nn.attention.varlen.varlen_attn` (FlashAttention) on a CUDA
  device with half-precision activations (bf16 autocast); otherwise scaled_dot_product_attention
  per sample (CPU, float32): the same result, one call per sample;
* anything else (a padded batch, a rank's one-token empty batch): transformers' SDPA attention,
  causal, exactly as with `attn_implementation: sdpa`.

transformers builds no attention mask for an implementation it does not know, so a packed forward
costs no [N, N] mask and no host synchronisation. The loss terms that look at the next token (kl
with a loss mask, ce) read `Segments.ends` so that no sample predicts the next one's first token.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from student.errors import StudentError

ATTENTION = "distill_packed"  # the name registered with transformers' AttentionInterface


@dataclass
class Segments:
    """The samples of one packed row, on the device the model runs on.

    Attributes:
        lengths: tokens per sample, in row order (host ints: the per-sample fallback slices by them).
        position_ids: [1, N] long, each sample's positions from 0.
        cu_seqlens: [S + 1] int32, the row offset of each sample and N (varlen attention's input).
        ends: [1, N] bool, True on each sample's last token (its next token is not in the sample).
    """

    lengths: list[int]
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    ends: torch.Tensor

    @property
    def max_len(self) -> int:
        return max(self.lengths)

    @classmethod
    def build(cls, lengths: list[int], device, pin: bool = False) -> Segments:
        """From the samples' lengths (host), uploaded to `device` (asynchronously from pinned memory)."""
        lens = torch.tensor(lengths, dtype=torch.long)
        n = int(lens.sum())
        starts = torch.cumsum(lens, 0) - lens
        pos = torch.arange(n, dtype=torch.long) - torch.repeat_interleave(starts, lens)
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lens, 0)
        ends = torch.zeros(n, dtype=torch.bool)
        ends[cu[1:].long() - 1] = True
        tensors = [pos.view(1, n), cu, ends.view(1, n)]
        device = torch.device(device)
        if device.type != "cpu":
            if pin:
                tensors = [t.pin_memory() for t in tensors]
            tensors = [t.to(device, non_blocking=pin) for t in tensors]
        return cls(list(lengths), *tensors)


def _varlen():
    """torch's variable-length attention and how to ask it for causal masking, or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:  # torch > 2.10
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:  # torch 2.10
        causal = {"is_causal": True}
    else:
        return None
    return varlen_attn, causal, "enable_gqa" in params


_VARLEN = _varlen()


def packed_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers attention function: query [B, Hq, T, D], key / value [B, Hkv, T, D] ->
    ([B, T, Hq, D], None). Packed rows (kwargs `distill_packed`) attend within each sample."""
    seg: Segments | None = kwargs.pop("distill_packed", None)
    if seg is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if kwargs.get("sliding_window"):
        raise StudentError(
            "student.batch_layout packed does not support sliding-window attention: set "
            "student.batch_layout: padded"
        )
    groups = query.shape[1] // key.shape[1]
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else value.dtype
    if _VARLEN is not None and query.is_cuda and dtype in (torch.bfloat16, torch.float16) and dropout == 0:
        fn, causal, gqa = _VARLEN
        q, k, v = (x[0].transpose(0, 1).to(dtype).contiguous() for x in (query, key, value))  # [N, H, D]
        extra = dict(causal)
        if groups > 1:
            if gqa:
                extra["enable_gqa"] = True
            else:
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = fn(q, k, v, seg.cu_seqlens, seg.cu_seqlens, seg.max_len, seg.max_len, scale=scaling, **extra)
        return out.unsqueeze(0), None
    outs, off = [], 0
    for n in seg.lengths:  # one causal SDPA per sample
        sl = slice(off, off + n)
        outs.append(
            F.scaled_dot_product_attention(
                query[:, :, sl],
                key[:, :, sl],
                value[:, :, sl],
                dropout_p=dropout,
                is_causal=True,
                scale=scaling,
                enable_gqa=groups > 1,
            )
        )
        off += n
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def register() -> None:
    """Make `ATTENTION` known to transformers (once per process; later calls do nothing)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, packed_attention)


def use_packed_attention(model) -> None:
    """Run a transformers model's attention through `packed_attention` (StudentError when the
    architecture does not take an attention function)."""
    register()
    try:
        model.set_attn_implementation(ATTENTION)
    except (ValueError, AttributeError) as e:
        raise StudentError(
            f"student.batch_layout packed needs a model that takes transformers' attention functions "
            f"({type(model).__name__}: {e}): set student.batch_layout: padded"
        ) from None
    if getattr(model.config, "_attn_implementation", None) != ATTENTION:
        raise StudentError(
            f"{type(model).__name__} cannot switch its attention function, which "
            "student.batch_layout packed needs: set student.batch_layout: padded"
        )

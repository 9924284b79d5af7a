"""`distill.fp8.quantize` as one Triton kernel, a program per row: the row is read once, its
largest |value|, scale, quotients and float8 values stay in registers, the values and the scale are
written. The same arithmetic as `distill.fp8.reference_quantize` (IEEE float32 division, round to
nearest even, clamping that keeps NaN); `distill.fp8.verify` checks the bits on each device before
the kernel is used. Imported only where a CUDA tensor is quantized (Triton ships with CUDA torch)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from distill.fp8 import FP8


@triton.jit
def _rows(x_ptr, q_ptr, s_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=inside, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    nans = tl.sum((x != x).to(tl.int32), axis=0)  # the hardware maximum drops NaN; the reference keeps it
    s = tl.fdiv(amax, 448.0, ieee_rounding=True)
    s = tl.where((s > 0) & (nans == 0), s, 1.0)  # as the reference: a zero or NaN maximum -> scale 1
    v = tl.fdiv(x, s, ieee_rounding=True)
    c = tl.minimum(tl.maximum(v, -448.0), 448.0)
    v = tl.where(v != v, v, c)  # clamping keeps NaN
    tl.store(q_ptr + row * n_cols + cols, v.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=inside)
    tl.store(s_ptr + row, s)


def quantize(hs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 values, float32 scales) of CUDA `hs` [..., H], on the current stream."""
    x = hs.contiguous()
    n_cols = x.shape[-1]
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    s = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    rows = x.numel() // max(n_cols, 1)
    if rows:
        block = triton.next_power_of_2(n_cols)
        with torch.cuda.device(x.device):
            _rows[(rows,)](x, q, s, n_cols, BLOCK=block, num_warps=min(16, max(4, block // 1024)))
    return q, s

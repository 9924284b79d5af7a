"""`teacher.hidden_dtype: fp8`: hidden states as float8 e4m3 with one scale per token and layer.

On the wire and in spool files a quantized sample holds `hidden_states` [T, L, H] float8_e4m3fn
and `hidden_scale` [T, L] float32 (each row's max |value| / 448, e4m3's largest finite value), with
`meta["hidden_dtype"]` naming the model dtype. Receivers get the model dtype back:
`Subscriber.get` and `distill.spool.read_spool_file` call `dequantize_sample`, so students, the
EAGLE-3 recipe and `distill-export` never see fp8 (the Publisher's spool replay forwards the fp8
bytes as they are).

Error bound (round to nearest in e4m3, 3 mantissa bits): every value x of a row with scale s comes
back as x' with |x - x'| <= |x| / 16 + s * 2**-10 (the second term covers e4m3's subnormals), so
a row's largest error is at most 1/16 of its largest |value| plus that term: `ERROR_BOUND`.
The digest of a quantized sample covers the bytes that travel (fp8 and scales).
"""

from __future__ import annotations

import torch

from distill.protocol import Sample

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
ERROR_BOUND = 1 / 16  # relative to |x|, plus scale * 2**-10 (docstring)
SCALE_KEY = "hidden_scale"
DTYPE_NAMES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def quantize(hs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 values, float32 scales) of `hs` [..., H]: one scale per row of the last dimension.
    Runs where `hs` is (the teacher's GPU on CUDA). One full-size float32 temporary (the quotient):
    the row maxima are reduced from `hs` itself (exact in any float dtype) and the division
    promotes `hs` to float32 as it reads; the same bits as converting `hs` to float32 first."""
    scale = torch.linalg.vector_norm(hs, ord=float("inf"), dim=-1).float().div_(FP8_MAX)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: scale 1
    q = torch.div(hs, scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values `quantize` stood for, in `dtype`."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def is_quantized(sample: Sample) -> bool:
    hs = sample.tensors.get("hidden_states")
    return hs is not None and hs.dtype == FP8 and SCALE_KEY in sample.tensors


def dequantize_sample(sample: Sample) -> Sample:
    """`sample` with `hidden_states` back in the model dtype and no `hidden_scale` (in place; a
    sample that is not quantized is returned unchanged). Digests stay as recorded: they describe
    the bytes that travelled."""
    if not is_quantized(sample):
        return sample
    dtype = DTYPE_NAMES.get(str(sample.meta.get("hidden_dtype", "bfloat16")), torch.bfloat16)
    tensors = dict(sample.tensors)
    scale = tensors.pop(SCALE_KEY)
    tensors["hidden_states"] = dequantize(tensors["hidden_states"], scale, dtype)
    sample.tensors = tensors
    return sample


def dtype_name(dtype: torch.dtype) -> str:
    for k, v in DTYPE_NAMES.items():
        if v == dtype:
            return k
    raise ValueError(f"fp8 hidden states need a float16, bfloat16 or float32 model, not {dtype}")

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

import logging
from collections.abc import Callable

import torch

from distill.protocol import Sample

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
ERROR_BOUND = 1 / 16  # relative to |x|, plus scale * 2**-10 (docstring)
SCALE_KEY = "hidden_scale"
logger = logging.getLogger(__name__)
DTYPE_NAMES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def quantize(hs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 values, float32 scales) of `hs` [..., H]: one scale per row of the last dimension.
    Runs where `hs` is (the teacher's GPU on CUDA). On a CUDA device and dtype for which the
    one-kernel version (`fused_quantizer`) reproduced `reference_quantize` bit for bit, that
    kernel; else the reference."""
    if hs.is_cuda:
        fused = fused_quantizer(hs.device, hs.dtype)
        if fused is not None:
            return fused(hs)
    return reference_quantize(hs)


def reference_quantize(hs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, in torch operations. One full-size float32 temporary (the quotient): the
    row maxima are reduced from `hs` itself (exact in any float dtype) and the division promotes
    `hs` to float32 as it reads; the same bits as converting `hs` to float32 first."""
    scale = torch.linalg.vector_norm(hs, ord=float("inf"), dim=-1).float().div_(FP8_MAX)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: scale 1
    q = torch.div(hs, scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


_UNSET = object()
# (CUDA device index, dtype) -> the verified kernel, or None
_FUSED: dict[tuple[int, torch.dtype], Callable | None] = {}


def fused_quantizer(device: torch.device, dtype: torch.dtype, hidden: int | None = None) -> Callable | None:
    """The one-kernel quantize of `dtype` values on CUDA `device` (a Triton kernel: each row read
    once, its maximum, scale, quotient and fp8 values in registers; no float32 temporary, one
    launch instead of eight), or None where Triton is missing or the kernel does not give
    `reference_quantize`'s bits on `verify`'s probe in that dtype (on an H100, float16 rows differed
    in the last fp8 bit at a few values; bfloat16 and float32 matched). Decided once per device and
    dtype (the first call compiles, ~1 s: the connector calls it while the engine starts, with the
    model's `hidden` size, so the kernel for that row length is compiled and checked then too)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    found = _FUSED.get((index, dtype), _UNSET)
    if found is _UNSET:
        try:
            kernel = _triton_quantize()
            found = verify(kernel, torch.device("cuda", index), dtype, hidden)
            why = "" if found is not None else "its values differ from the reference on the probe"
        except Exception as e:  # noqa: BLE001 (no Triton, a compile error: the reference stays)
            found, why = None, f"{type(e).__name__}: {e}"
        name = str(dtype).replace("torch.", "")
        if why:
            logger.info(
                "fp8: quantizing %s with torch operations on cuda:%d (the fused kernel: %s)", name, index, why
            )
        else:
            logger.info(
                "fp8: quantizing %s with one fused kernel on cuda:%d (the reference's bits on the probe)",
                name,
                index,
            )
        _FUSED[(index, dtype)] = found
    return found  # type: ignore[return-value]


def verify(
    kernel: Callable, device: torch.device, dtype: torch.dtype, hidden: int | None = None
) -> Callable | None:
    """`kernel` if it gives `reference_quantize`'s values (bit for bit; NaN where the reference has
    NaN) and scales on a probe of `dtype` values: random rows over 75 decades of magnitude (10 in
    16-bit dtypes), an all-zero row, e4m3's subnormal range, infinities and NaN, rows of 4096 values,
    of 1000 (no power of 2) and of `hidden` when given."""
    g = torch.Generator().manual_seed(0)
    for n in dict.fromkeys((4096, 1000, hidden or 4096)):
        x = torch.randn(64, 2, n, generator=g)
        mags = torch.logspace(-38, 37, 64) if dtype == torch.float32 else torch.logspace(-6, 4, 64)
        x = x * mags.view(-1, 1, 1)
        x[0] = 0.0
        x[1, 0, 7] = float("inf")
        x[2, 1, 3] = float("nan")
        x[3, 0, 5] = -float("inf")
        x = x.to(dtype).to(device)
        q, s = kernel(x)
        rq, rs = reference_quantize(x)
        if q.shape != rq.shape or s.shape != rs.shape or q.dtype != FP8 or s.dtype != torch.float32:
            return None
        nan, rnan = q.float().isnan(), rq.float().isnan()
        same = torch.equal(nan, rnan) and torch.equal(q.view(torch.uint8)[~rnan], rq.view(torch.uint8)[~rnan])
        if not same or not torch.equal(s.view(torch.int32), rs.view(torch.int32)):
            return None
    return kernel


def _triton_quantize() -> Callable:
    """`quantize` as one Triton kernel (distill.fp8_triton, imported on first use)."""
    from distill import fp8_triton

    return fp8_triton.quantize


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

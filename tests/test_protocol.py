"""Wire protocol: exact round trips, zero-copy decode, and rejection of every malformed message."""

from __future__ import annotations

import msgpack
import pytest
import torch

from distill import protocol as P
from distill.protocol import ProtocolError, Sample


def roundtrip(sample: Sample, **kw) -> Sample:
    frames = P.encode_sample(sample, **kw)
    # Simulate the wire: each frame becomes its own bytes object.
    wire = [bytes(f) for f in frames]
    header = P.decode_header(wire[0])
    return P.decode_sample(header, wire[1:])


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.int32, torch.uint8, torch.bool]
)
def test_roundtrip_exact(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 3, 5, generator=g) * 100).to(dtype)
    s = Sample(
        key="row-1",
        tensors={"hidden_states": x, "token_ids": torch.arange(7)},
        layers=[0, 2, 4],
        meta={"a": 1, "b": "x"},
    )
    s.teacher, s.seq = "t0", 42
    out = roundtrip(s, with_crc=True)
    assert out.key == "row-1" and out.teacher == "t0" and out.seq == 42
    assert out.layers == [0, 2, 4] and out.meta == {"a": 1, "b": "x"}
    assert out.tensors["hidden_states"].dtype == dtype
    assert torch.equal(out.tensors["hidden_states"].view(torch.uint8), x.view(torch.uint8))
    assert torch.equal(out.tensors["token_ids"], torch.arange(7))


def test_decode_is_zero_copy():
    x = torch.randn(16, 2, 8).bfloat16()
    frames = P.encode_sample(Sample(key="k", tensors={"hidden_states": x}))
    buf = bytearray(bytes(frames[1]))
    out = P.decode_sample(P.decode_header(frames[0]), [buf])
    # The tensor is a view of the received buffer: changing the buffer changes the tensor.
    before = out.tensors["hidden_states"].clone()
    buf[0] ^= 0xFF
    assert not torch.equal(out.tensors["hidden_states"].view(torch.uint8), before.view(torch.uint8))


def test_empty_and_scalar_tensors():
    s = Sample(
        key="e",
        tensors={"hidden_states": torch.zeros(0, 4, 8), "token_ids": torch.zeros(0, dtype=torch.int64)},
    )
    out = roundtrip(s)
    assert out.tensors["hidden_states"].shape == (0, 4, 8)


def _good():
    s = Sample(key="k", tensors={"hidden_states": torch.ones(4, 2, 3), "token_ids": torch.arange(4)})
    header, bufs = P.sample_header(s, with_crc=True)
    return header, [bytes(b) for b in bufs]


def _reason(header_bytes, frames):
    with pytest.raises(ProtocolError) as ei:
        h = P.decode_header(header_bytes)
        P.decode_sample(h, frames)
    return ei.value.reason


def test_malformed_messages_rejected_with_reason():
    h, f = _good()
    assert _reason(b"\xc1garbage", f) == "garbage"
    assert _reason(msgpack.packb([1, 2, 3]), f) == "garbage"
    assert _reason(b"\x00" * (P.MAX_HEADER_BYTES + 1), f) == "header_too_large"
    assert _reason(P.pack({**h, "v": 99}), f) == "version"
    assert _reason(P.pack({**h, "k": 77}), f) == "kind"
    assert _reason(P.pack({k: v for k, v in h.items() if k != "key"}), f) == "field"
    bad = [list(x) for x in h["t"]]
    bad[0][1] = "complex128"
    assert _reason(P.pack({**h, "t": bad}), f) == "dtype"
    bad = [list(x) for x in h["t"]]
    bad[0][2] = [4, -2, 3]
    assert _reason(P.pack({**h, "t": bad}), f) == "shape"
    bad = [list(x) for x in h["t"]]
    bad[0][2] = [1 << 30, 1 << 30, 1 << 30]
    assert _reason(P.pack({**h, "t": bad}), f) == "shape"
    assert _reason(P.pack(h), f[:1]) == "frames"  # missing frame
    assert _reason(P.pack(h), f + [b"x"]) == "frames"  # extra frame
    assert _reason(P.pack(h), [f[0][:-3], f[1]]) == "length"  # truncated tensor
    corrupted = bytearray(f[0])
    corrupted[0] ^= 1
    assert _reason(P.pack(h), [bytes(corrupted), f[1]]) == "checksum"


def test_no_pickle_on_the_wire():
    # An object msgpack cannot encode is refused rather than pickled.
    with pytest.raises(TypeError):
        P.pack({"v": 1, "k": P.HELLO, "x": object()})

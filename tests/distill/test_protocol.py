"""Wire protocol: exact round trips, zero-copy decode, and rejection of every malformed message."""

from __future__ import annotations

import msgpack
import pytest
import torch

from distill import digest as D
from distill import protocol as P
from distill.errors import ProtocolError
from distill.protocol import Sample


def roundtrip(sample: Sample, **kw) -> Sample:
    frames = P.encode_sample(sample, **kw)
    # Simulate the wire: each frame becomes its own bytes object.
    wire = [bytes(f) for f in frames]
    header = P.decode_header(wire[0])
    return P.decode_sample(header, wire[1:])


@pytest.mark.parametrize("checksum", ["crc32", "xxh3", "xxh3-tree"])
@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.int32, torch.uint8, torch.bool]
)
def test_roundtrip_exact(dtype, checksum):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 3, 5, generator=g) * 100).to(dtype)
    s = Sample(
        key="row-1",
        tensors={"hidden_states": x, "token_ids": torch.arange(7)},
        layers=[0, 2, 4],
        meta={"a": 1, "b": "x"},
    )
    s.teacher, s.seq = "t0", 42
    out = roundtrip(s, checksum=checksum)
    assert out.key == "row-1" and out.teacher == "t0" and out.seq == 42
    if checksum == "xxh3":
        assert out.x3 == P.sample_x3(s) and out.crc is None
    elif checksum == "xxh3-tree":
        assert out.x3t == P.sample_x3t(s) and out.crc is None and out.x3 is None
    else:
        assert out.crc == P.sample_crc(s) and out.x3 is None
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


CH = 64 * 1024  # the smallest chunk transport.chunk_bytes accepts


@pytest.mark.parametrize("checksum", ["none", "xxh3", "xxh3-tree"])
def test_tensors_larger_than_the_chunk_travel_in_chunks_and_come_back_exact(checksum):
    g = torch.Generator().manual_seed(1)
    sizes = {"a": 3 * CH + 17, "b": CH, "c": 0, "d": 2 * CH, "e": 5}  # bytes of each uint8 tensor
    t = {k: torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8) for k, n in sizes.items()}
    t["f"] = torch.randn(CH // 4 + 3, generator=g)  # float32, 4 bytes over one chunk
    s = Sample(key="big", tensors=t)
    frames = P.encode_sample(s, checksum=checksum, chunk=CH)
    header = P.decode_header(bytes(frames[0]))
    assert header["ch"] == CH
    # a: 4 frames (3 full, 17 bytes), b: 1, c: 1 (empty), d: 2, e: 1, f: 2 (full, 12 bytes)
    assert [spec[3] for spec in header["t"]] == [1, 5, 6, 7, 9, 10]
    assert [len(bytes(f)) for f in frames[1:]] == [CH, CH, CH, 17, CH, 0, CH, CH, 5, CH, 12]
    out = P.decode_sample(header, [bytes(f) for f in frames[1:]])
    for k, x in t.items():
        assert torch.equal(out.tensors[k].view(torch.uint8), x.view(torch.uint8)), k
    # Nothing larger than the chunk, or a shared-memory reference: the header is the unchunked one.
    small = Sample(key="small", tensors={"x": torch.zeros(CH, dtype=torch.uint8)})
    assert "ch" not in P.sample_header(small, chunk=CH)[0]
    assert len(P.encode_sample(small, chunk=CH)) == 2
    assert "ch" not in P.sample_header(s, chunk=CH, shm=("r", [0] * 6, 0, 1))[0]


def test_chunked_sample_with_a_missing_short_or_flipped_chunk_is_rejected_with_reason():
    x = torch.randint(0, 256, (3 * CH + 100,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    s = Sample(key="k", tensors={"hidden_states": x, "token_ids": torch.arange(4)})
    frames = [bytes(f) for f in P.encode_sample(s, checksum="xxh3-tree", chunk=CH)]
    h, f = frames[0], frames[1:]
    assert len(f) == 5
    assert _reason(h, f[:3] + f[4:]) == "frames"  # a chunk missing
    assert _reason(h, f + [b""]) == "frames"  # one frame too many
    assert _reason(h, [f[0] + f[1], b""] + f[2:]) == "length"  # right count and total, wrong cut
    assert _reason(h, f[:3] + [f[3][:-1]] + f[4:]) == "length"  # the last chunk short
    flipped = bytearray(f[2])
    flipped[7] ^= 1
    assert _reason(h, f[:2] + [bytes(flipped)] + f[3:]) == "checksum"  # caught after the join
    header = P.decode_header(h)
    assert _reason(P.pack({**header, "ch": -1}), f) == "field"
    assert _reason(P.pack({**header, "ch": "1"}), f) == "field"
    assert _reason(P.pack({**header, "ch": CH, "shm": ["r", [0, 0], 0, 1]}), []) == "field"
    # A claimed chunk of one byte for a tensor of 3 MiB: rejected on the frame count, no allocation.
    assert _reason(P.pack({**header, "ch": 1}), f) == "frames"


def _good(checksum="crc32"):
    s = Sample(key="k", tensors={"hidden_states": torch.ones(4, 2, 3), "token_ids": torch.arange(4)})
    header, bufs = P.sample_header(s, checksum=checksum)
    return header, [bytes(b) for b in bufs]


def test_xxh3_header_key_is_the_xxh3_64_of_the_tensor_bytes_in_order():
    import xxhash

    s = Sample(key="k", tensors={"hidden_states": torch.randn(4, 2, 3), "token_ids": torch.arange(4)})
    h, bufs = P.sample_header(s, checksum="xxh3")
    assert "crc" not in h and h["x3"] == xxhash.xxh3_64(b"".join(bytes(b) for b in bufs)).intdigest()
    assert h["x3"] == P.sample_x3(s)
    h, _ = P.sample_header(s, checksum="crc32")
    assert "x3" not in h and h["crc"] == P.sample_crc(s)
    h, _ = P.sample_header(s, with_crc=True)  # the older spelling
    assert h["crc"] == P.sample_crc(s)
    assert not {"crc", "x3"} & set(P.sample_header(s)[0])
    # A digest the sample carries goes into the header as it is (computed once, by the producer).
    s.x3, s.crc = 12345, 678
    h, _ = P.sample_header(s, checksum="xxh3")
    assert h["x3"] == 12345 and h["crc"] == 678
    with pytest.raises(ValueError):
        P.sample_header(s, checksum="md5")


@pytest.mark.parametrize("checksum", ["crc32", "xxh3", "xxh3-tree"])
def test_flipped_payload_byte_is_a_checksum_error_naming_the_algorithm(checksum):
    h, f = _good(checksum)
    corrupted = bytearray(f[1])
    corrupted[-1] ^= 0x01
    with pytest.raises(ProtocolError) as ei:
        P.decode_sample(P.decode_header(P.pack(h)), [f[0], bytes(corrupted)])
    assert ei.value.reason == "checksum"
    assert {"xxh3": "xxh3-64", "xxh3-tree": "xxh3 tree", "crc32": "CRC32"}[checksum] in str(ei.value)
    # All digests present: each one is checked.
    both = {**h, "crc": D.crc32_of(f), "x3": D.xxh3_of(f), "x3t": D.x3t_of(f)}
    out = P.decode_sample(P.decode_header(P.pack(both)), f)
    assert (out.crc, out.x3, out.x3t) == (both["crc"], both["x3"], both["x3t"])
    for k in ("crc", "x3", "x3t"):
        assert _reason(P.pack({**both, k: both[k] ^ 1}), f) == "checksum"


def test_x3t_is_the_xxh3_of_the_4_mib_chunk_digests_of_each_tensor_in_order():
    """The tree digest written out from its definition (protocol docstring), independently of
    x3t_of: leaves per tensor (an empty tensor has none), little-endian u64, one xxh3-64 over them."""
    import xxhash

    g = torch.Generator().manual_seed(1)
    C = 4 << 20
    assert D.DIGEST_CHUNK == C
    hs = torch.randint(0, 255, (5 * C // 2 + 7,), dtype=torch.uint8, generator=g)  # 2.5 chunks + 7
    s = Sample(
        key="k",
        tensors={"hidden_states": hs, "empty": torch.zeros(0), "token_ids": torch.arange(9)},
    )
    raws = [t.numpy().tobytes() for t in s.tensors.values()]
    leaves = b""
    for raw in raws:
        for i in range(0, len(raw), C):
            leaves += xxhash.xxh3_64(raw[i : i + C]).intdigest().to_bytes(8, "little")
    assert len(leaves) == 8 * (3 + 0 + 1)
    want = xxhash.xxh3_64(leaves).intdigest()
    assert P.sample_x3t(s) == want  # 4 leaves: hashed by D.LEAF_THREADS threads
    saved, D.LEAF_THREADS = D.LEAF_THREADS, 1
    try:
        assert P.sample_x3t(s) == want  # one thread, in order: the same root
    finally:
        D.LEAF_THREADS = saved
    h, _ = P.sample_header(s, checksum="xxh3-tree")
    assert h["x3t"] == want and "x3" not in h and "crc" not in h
    # Collected piecewise, out of order, as the connector's copy threads do: the same root.
    d = D.ChunkDigests([len(r) for r in raws])
    d.add(2, 0, D.chunk_digests(raws[2]))
    d.add(0, 2, D.chunk_digests(raws[0][2 * C :]))
    with pytest.raises(ValueError, match="not digested"):
        d.root()  # chunks 0-1 of tensor 0 missing
    d.add(0, 0, D.chunk_digests(raws[0][: 2 * C]))
    assert d.root() == want
    # Cutting the bytes into tensors elsewhere than at a chunk boundary changes the root (the
    # shapes themselves are the header's, checked against the frames, as for x3).
    moved = Sample(key="k", tensors={"a": hs[:1000], "b": hs[1000:], "token_ids": torch.arange(9)})
    assert P.sample_x3t(moved) != P.sample_x3t(
        Sample(key="k", tensors={"a": hs, "token_ids": torch.arange(9)})
    )
    # A sample carrying an older digest (a replayed spool file) gets no second one.
    s.x3 = 5
    h, _ = P.sample_header(s, checksum="xxh3-tree")
    assert h["x3"] == 5 and "x3t" not in h


@pytest.mark.parametrize("value", ["123", 1.5, True, -1, [1], {"a": 1}])
def test_bad_typed_digest_is_a_field_error(value):
    h, f = _good("xxh3")
    assert _reason(P.pack({**h, "x3": value}), f) == "field"
    h, f = _good("crc32")
    assert _reason(P.pack({**h, "crc": value}), f) == "field"


def test_crc_wider_than_32_bits_is_a_field_error():
    # (An x3 cannot be too wide: msgpack carries no int of 2**64 or more.)
    h, f = _good("crc32")
    assert _reason(P.pack({**h, "crc": 1 << 32}), f) == "field"


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
    h3, f3 = _good("xxh3")
    assert _reason(P.pack(h3), [bytes(corrupted), f3[1]]) == "checksum"
    assert _reason(P.pack({**h3, "x3": "0"}), f3) == "field"


def test_no_pickle_on_the_wire():
    # An object msgpack cannot encode is refused rather than pickled.
    with pytest.raises(TypeError):
        P.pack({"v": 1, "k": P.HELLO, "x": object()})


# What a peer must understand to read this side's messages. A change here is a change of the
# wire format: bump PROTOCOL_VERSION (and say what it adds beside it) and pin the new value.
WIRE_FORMAT = {5: "24016b1826cb1be7"}


def _wire_format_fingerprint() -> str:
    import hashlib
    import json

    from distill import fp8
    from distill.capture import POSITIONS_KEY

    t = {"hidden_states": torch.zeros(2, 1, 4), "token_ids": torch.arange(2)}
    s = Sample(key="k", tensors=t, layers=[1], meta={"a": 1}, teacher="t", seq=1)
    headers = {
        f"{c}/{shm}": sorted(P.sample_header(s, checksum=c, shm=("r", [0, 64], 0, 7) if shm else None)[0])
        for c in P.CHECKSUMS
        for shm in (False, True)
    }
    big = Sample(key="k", tensors={"x": torch.zeros(3, 1 << 15)}, teacher="t", seq=1)  # 384 KiB
    chunked = P.encode_sample(big, checksum="xxh3-tree", chunk=1 << 16)
    headers["chunked"] = sorted(P.decode_header(chunked[0]).items())
    headers["chunked_frames"] = [len(bytes(f)) for f in chunked[1:]]
    parts = {
        "kinds": sorted(P.KIND_NAMES.items()),
        "controls": {P.KIND_NAMES[k]: sorted(v.items()) for k, v in P.CONTROL_FIELDS.items()},
        "dtypes": sorted((k, str(v)) for k, v in P.DTYPES.items()),
        "checksums": list(P.CHECKSUMS),
        "digest_chunk": D.DIGEST_CHUNK,
        "sample_headers": headers,
        "tensor_names": [POSITIONS_KEY, fp8.SCALE_KEY],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def test_a_change_of_the_wire_format_bumps_the_protocol_version():
    got = _wire_format_fingerprint()
    assert WIRE_FORMAT.get(P.PROTOCOL_VERSION) == got, (
        f"the wire format's fingerprint is {got}, pinned for version {P.PROTOCOL_VERSION}: "
        f"{WIRE_FORMAT.get(P.PROTOCOL_VERSION)}. A changed format needs a new PROTOCOL_VERSION "
        "(peers of the old one must refuse it, not misread it): bump it and pin the new fingerprint"
    )


def test_x3t_in_a_child_forked_after_the_parent_hashed_with_its_threads():
    """vLLM may fork its engine core from a teacher that already checked spool files: the child
    inherits no pool threads, so the leaf pool must be its own (an inherited one never runs work).
    In a fresh interpreter without torch (whose import happens to hide the hang in this one)."""
    from forked import in_a_forked_child

    setup = """
    import threading
    from distill import digest as D
    buf = os.urandom(9 << 20)  # 3 leaves: hashed by the pool
    met = threading.Barrier(D.LEAF_THREADS + 1)  # the parent's pool gets all its threads (at once)
    for _ in range(D.LEAF_THREADS):
        D._pool().submit(met.wait, 30)
    met.wait(30)
    """
    out = in_a_forked_child(setup, "D.x3t_of([buf])")  # the parent's pool exists before the fork
    assert "torch" not in out["modules"], "the check must run without torch imported"
    assert out["got"] == out["want"], f"the forked child's x3t_of: {out['got']}"

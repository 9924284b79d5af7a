"""Wire protocol: one versioned multipart message per sample or control record.

Layout (frames of one ZeroMQ multipart message, after any ROUTER identity frame)::

    frame 0   msgpack header (a map, at most MAX_HEADER_BYTES)
    frame 1.. one raw frame per tensor, in header order (absent for control records and for
              samples whose bytes travel through the shared-memory ring); with `ch`, each
              tensor's bytes in consecutive frames of `ch` bytes, the last one shorter

Sample header keys::

    v       protocol version (PROTOCOL_VERSION)
    k       message kind (SAMPLE, HELLO, ...)
    key     sample key from the dataset (str)
    tid     teacher id (str)
    seq     per-teacher sequence number (int)
    layers  teacher layer ids carried in `hidden_states` (list[int])
    t       tensors: list of [name, dtype, shape, frame_index]
    meta    small metadata map (str -> msgpack scalar / list / map)
    crc     optional CRC32 of the tensor bytes, in tensor order (zlib.crc32, unsigned 32-bit)
    x3      optional xxh3-64 of the tensor bytes, in tensor order (seed 0, unsigned 64-bit int;
            `transport.checksum: xxh3`)
    x3t     optional xxh3 tree digest (`transport.checksum: xxh3-tree`, the default; version 3):
            each tensor's bytes, in tensor order, are cut into 4 MiB chunks (the last one
            shorter; an empty tensor has none), each chunk gets its xxh3-64 (seed 0), and
            `x3t` is the xxh3-64 of those chunk digests written as unsigned 64-bit little-endian
            integers, in order. The chunks can be hashed in parallel, by the threads that copy
            them, while their bytes are still in cache (distill/digest.py: `ChunkDigests`).
            A header may carry `crc`, `x3`, `x3t`, any or none; every one present is verified
            (mismatch: ProtocolError("checksum"))
    ch      optional chunk size in bytes (version 5):
            each tensor's bytes travel in ceil(nbytes / ch) frames (an empty tensor in one empty
            frame), its spec's frame_index naming the first. The receiver joins them into one
            buffer before it checks the digests. Smaller frames keep CURVE's encryption and the
            kernel copies in cache (`transport.chunk_bytes`)
    shm     optional shared-memory reference: [segment_name, [offset, ...], stamp_offset, stamp]
            (one offset per tensor; the slot's stamp word holds `stamp` while the slot is this
            sample's: the receiver checks it after copying, see `Sample.stamp`)

Control records (HELLO, CREDIT, ACK, COMMIT, ...) carry metadata only: one frame, no tensors. Each
kind's fields are a typed record (`CONTROL_FIELDS`): `decode_control` rejects a record with a
missing field or a field of the wrong type, and drops fields it does not know.

Decoding is zero-copy: `torch.frombuffer` over the received frame's buffer. Nothing is ever
unpickled; msgpack is decoded with strict limits. Every way a message can be malformed raises
`ProtocolError` with a reason that the caller counts (see `REJECT_REASONS`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from distill.capture import POSITIONS_KEY, positions_problem
from distill.digest import crc32_of, digest_mismatch, x3t_of, xxh3_of
from distill.errors import ProtocolError

# 2: COMMIT / ACKED / REFUSE, tid in ACK, slot stamps in shm references; 3: the `x3t` digest;
# 4: a sample may hold the states of some token positions only (`positions`, teacher.capture), and
# float8 e4m3 tensors (`f8e4m3`) with a per-token `hidden_scale` (teacher.hidden_dtype: fp8);
# 5: a tensor's bytes in several frames (`ch`, transport.chunk_bytes).
# The format of each version is pinned by a fingerprint:
# tests/distill/test_protocol.py::test_a_change_of_the_wire_format_bumps_the_protocol_version
PROTOCOL_VERSION = 5
MAX_HEADER_BYTES = 1 << 20  # 1 MiB: a header is metadata, never data
MAX_NDIM = 8
MAX_TENSORS = 64
MAX_TENSOR_BYTES = 1 << 40  # 1 TiB: anything declared larger is absurd
# Payload checksums a producer can attach (`transport.checksum`): crc32 -> header key `crc`, xxh3 -> `x3`,
# xxh3-tree -> `x3t`.
CHECKSUMS = ("none", "crc32", "xxh3", "xxh3-tree")

# Message kinds. Teacher -> student: SAMPLE, WELCOME, HEARTBEAT, DRAIN, END, RESET, REFUSE.
# Student -> teacher: HELLO, CREDIT, ACK, COMMIT, ACKED, HEARTBEAT, BYE.
SAMPLE = 1
HELLO = 2
WELCOME = 3
CREDIT = 4
ACK = 5
HEARTBEAT = 6
DRAIN = 7  # the teacher's input is closed and nothing waits: flush partial batches
END = 8  # every sample of this teacher is acknowledged: the stream is over
BYE = 9  # a student leaves cleanly; its unacked samples are redelivered at once
RESET = 10  # the teacher does not know this peer: send HELLO again
COMMIT = 11  # these keys are covered by a saved checkpoint: the teacher journals them
ACKED = 12  # after a new WELCOME: keys this student acked earlier and has not committed yet
REFUSE = 13  # the teacher will not talk to this peer (reason); the student stops with that reason
KINDS = {SAMPLE, HELLO, WELCOME, CREDIT, ACK, HEARTBEAT, DRAIN, END, BYE, RESET, COMMIT, ACKED, REFUSE}
KIND_NAMES = {
    SAMPLE: "SAMPLE", HELLO: "HELLO", WELCOME: "WELCOME", CREDIT: "CREDIT", ACK: "ACK",
    HEARTBEAT: "HEARTBEAT", DRAIN: "DRAIN", END: "END", BYE: "BYE", RESET: "RESET",
    COMMIT: "COMMIT", ACKED: "ACKED", REFUSE: "REFUSE",
}  # fmt: skip
MAX_KEYS_PER_MESSAGE = 4096  # COMMIT / ACKED carry keys in chunks (a header stays far below 1 MiB)

# The typed record of every control kind: field -> (type, required). Types are checked exactly
# (bool is not an int); `list[int]` / `list[str]` check every item. Unknown fields are dropped.
_OPT = False
CONTROL_FIELDS: dict[int, dict[str, tuple[str, bool]]] = {
    HELLO: {
        "name": ("str", True),
        "credit_samples": ("int", True),
        "credit_bytes": ("int", True),
        "run": ("str", _OPT),
    },
    WELCOME: {"tid": ("str", True), "shm": ("shm_ref", _OPT), "run": ("str", _OPT)},
    CREDIT: {"shm_ok": ("bool", True)},
    ACK: {"tid": ("str", True), "seqs": ("list[int]", True), "commit": ("bool", _OPT)},
    COMMIT: {"keys": ("list[str]", True)},
    ACKED: {"keys": ("list[str]", True)},
    HEARTBEAT: {"tid": ("str", _OPT), "name": ("str", _OPT)},
    DRAIN: {"tid": ("str", True)},
    END: {"tid": ("str", True)},
    BYE: {"name": ("str", _OPT)},
    RESET: {"tid": ("str", True)},
    REFUSE: {"tid": ("str", _OPT), "reason": ("str", True), "version": ("int", True)},
}

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "f16": torch.float16,
    "f32": torch.float32,
    "f64": torch.float64,
    "i8": torch.int8,
    "u8": torch.uint8,
    "i16": torch.int16,
    "i32": torch.int32,
    "i64": torch.int64,
    "bool": torch.bool,
    "f8e4m3": torch.float8_e4m3fn,  # teacher.hidden_dtype: fp8 (distill/fp8.py)
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

REJECT_REASONS = (
    "garbage",  # not msgpack / not a map
    "header_too_large",
    "version",
    "kind",
    "field",  # a required field is missing or has the wrong type
    "dtype",
    "shape",
    "frames",  # missing or extra frames
    "length",  # shape x itemsize != frame length
    "checksum",
    "positions",  # `positions` disagrees with what the sample holds (distill/capture.py)
    "foreign",  # a well-formed message from a peer or session it does not belong to
)


def lane_name(name: str, lane: int) -> str:
    """The name a student's connection `lane` says in HELLO: its own for the first, `<name>#<lane>`
    after (the teacher's sizing counts a student once over its connections: `student_of`)."""
    return name if lane == 0 else f"{name}#{lane}"


def student_of(session_name: str) -> str:
    """The student a session's name belongs to (`lane_name` undone)."""
    base, sep, lane = session_name.rpartition("#")
    return base if sep and lane.isdigit() else session_name


@dataclass
class Sample:
    """One teacher sample: the tensors of one request plus where it came from.

    Attributes:
        key: sample key from the dataset (unique across the run).
        tensors: name -> tensor. vLLM's layout: `hidden_states` [num_tokens, num_layers, hidden],
            `token_ids` [num_tokens]; with `positions` only those rows (distill/capture.py).
        layers: teacher layer ids, in the order of `hidden_states`' second dimension.
        meta: small metadata map (prompt length, dataset row, ...).
        teacher: id of the teacher that produced it.
        seq: the teacher's sequence number (unique per teacher incarnation).
    """

    key: str
    tensors: dict[str, torch.Tensor]
    layers: list[int] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    teacher: str = ""
    seq: int = 0
    # Shared-memory samples: (segment, stamp offset, stamp). The bytes are this sample's only while
    # the segment's stamp word still holds `stamp` (Subscriber.valid checks it after a copy).
    stamp: tuple[str, int, int] | None = None
    # Digests of the tensor bytes in order, computed once by the producer's side and carried in the
    # header and the spool file; receivers check each one present. `crc`: CRC32 (`sample_crc`),
    # `x3`: xxh3-64 (`sample_x3`, the default: ~25 GB/s on one core against CRC32's ~1.5).
    crc: int | None = None
    x3: int | None = None
    x3t: int | None = None  # xxh3 tree digest (`x3t_of`)
    # Student side: the connection it came on (transport.connections > 1), where its ack goes.
    # Empty: the teacher's first connection. Never on the wire.
    via: str = ""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def positions(self) -> torch.Tensor | None:
        """The token positions whose states it holds (distill/capture.py); None: every one."""
        return self.tensors.get(POSITIONS_KEY)

    @property
    def num_tokens(self) -> int:
        ids = self.tensors.get("token_ids")
        if ids is not None:
            return int(ids.shape[0])
        hs = self.tensors.get("hidden_states")
        return int(hs.shape[0]) if hs is not None else 0


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ProtocolError("dtype", f"dtype {dtype} is not supported on the wire") from None


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A flat byte view of a contiguous CPU tensor (no copy)."""
    if t.device.type != "cpu":
        raise ValueError(f"tensor must be on the CPU to be sent, not {t.device}")
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    # uint8 view keeps bf16 (which numpy lacks) exact.
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def sample_crc(sample: Sample) -> int:
    """CRC32 of the sample's tensor bytes, in tensor order (what `crc` in a header means)."""
    return crc32_of([tensor_bytes(t) for t in sample.tensors.values()])


def sample_x3(sample: Sample) -> int:
    """xxh3-64 of the sample's tensor bytes, in tensor order (what `x3` in a header means)."""
    return xxh3_of([tensor_bytes(t) for t in sample.tensors.values()])


def sample_x3t(sample: Sample) -> int:
    """xxh3 tree digest of the sample's tensor bytes, in tensor order (`x3t` in a header)."""
    return x3t_of([tensor_bytes(t) for t in sample.tensors.values()])


def sample_header(
    sample: Sample,
    *,
    checksum: str = "none",
    with_crc: bool = False,
    shm: tuple[str, list[int], int, int] | None = None,
    chunk: int = 0,
):
    """Build the header map and the list of tensor byte views for `sample`.

    Args:
        checksum: "none", "crc32", "xxh3" or "xxh3-tree": the digest to add when the sample does
            not carry it already (`sample.crc` / `sample.x3` / `sample.x3t` go into the header as
            they are, never recomputed). "xxh3-tree" adds nothing to a sample that carries
            another digest already (a replayed spool file of an earlier version).
        with_crc: the older spelling of checksum="crc32".
        chunk: > 0: a tensor larger than this travels in frames of `chunk` bytes (`ch` in the
            header; `encode_sample` cuts them). Ignored with `shm` and when no tensor is larger.
    """
    if checksum not in CHECKSUMS:
        raise ValueError(f"checksum must be one of {CHECKSUMS}, not {checksum!r}")
    bufs = [tensor_bytes(t) for t in sample.tensors.values()]
    if shm is not None or chunk <= 0 or all(b.nbytes <= chunk for b in bufs):
        chunk = 0
    specs = []
    frame = 1
    for (name, t), b in zip(sample.tensors.items(), bufs, strict=True):
        specs.append([name, dtype_name(t.dtype), list(t.shape), frame])
        frame += _nchunks(b.nbytes, chunk)
    header: dict[str, Any] = {
        "v": PROTOCOL_VERSION,
        "k": SAMPLE,
        "key": sample.key,
        "tid": sample.teacher,
        "seq": sample.seq,
        "layers": list(sample.layers),
        "t": specs,
        "meta": sample.meta,
    }
    if sample.crc is not None:
        header["crc"] = sample.crc
    elif with_crc or checksum == "crc32":
        header["crc"] = crc32_of(bufs)
    if sample.x3 is not None:
        header["x3"] = sample.x3
    elif checksum == "xxh3":
        header["x3"] = xxh3_of(bufs)
    if sample.x3t is not None:
        header["x3t"] = sample.x3t
    elif checksum == "xxh3-tree" and "x3" not in header and "crc" not in header:
        header["x3t"] = x3t_of(bufs)
    if shm is not None:
        header["shm"] = [shm[0], list(shm[1]), int(shm[2]), int(shm[3])]
    if chunk:
        header["ch"] = chunk
    return header, bufs


def _nchunks(nbytes: int, chunk: int) -> int:
    """Frames that carry a tensor of `nbytes` (one when not chunked, and for an empty tensor)."""
    return max(1, -(-nbytes // chunk)) if chunk else 1


def encode_sample(sample: Sample, *, checksum: str = "none", with_crc: bool = False, chunk: int = 0) -> list:
    """Frames for `sample`: [header bytes, tensor buffer (or its chunks), ...] (no copies).

    `checksum` / `with_crc` / `chunk`: as for `sample_header`.
    """
    header, bufs = sample_header(sample, checksum=checksum, with_crc=with_crc, chunk=chunk)
    ch = header.get("ch", 0)
    if not ch:
        return [pack(header), *bufs]
    frames = [pack(header)]
    for b in bufs:
        frames.extend([b[o : o + ch] for o in range(0, b.nbytes, ch)] or [b])  # empty: one frame
    return frames


def pack(header: dict) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def _type_ok(value, typ: str) -> bool:
    if typ == "str":
        return isinstance(value, str)
    if typ == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if typ == "bool":
        return isinstance(value, bool)
    if typ == "list[int]":
        return isinstance(value, list) and all(_type_ok(x, "int") for x in value)
    if typ == "list[str]":
        return isinstance(value, list) and all(isinstance(x, str) for x in value)
    if typ == "shm_ref":  # [segment path, nonce] or None
        return value is None or (
            isinstance(value, list) and len(value) == 2 and all(isinstance(x, str) for x in value)
        )
    raise AssertionError(typ)


def encode_control(kind: int, **fields) -> bytes:
    """One control record; `fields` must match CONTROL_FIELDS[kind] (ValueError otherwise)."""
    spec = CONTROL_FIELDS.get(kind)
    if spec is None:
        raise ValueError(f"not a control kind: {kind}")
    for name, value in fields.items():
        if name not in spec:
            raise ValueError(f"{KIND_NAMES[kind]} has no field {name!r}")
        if not (value is None and not spec[name][1]) and not _type_ok(value, spec[name][0]):
            raise ValueError(f"{KIND_NAMES[kind]}.{name} must be {spec[name][0]}, not {value!r}")
    missing = [n for n, (_, req) in spec.items() if req and n not in fields]
    if missing:
        raise ValueError(f"{KIND_NAMES[kind]} needs {missing}")
    return pack({"v": PROTOCOL_VERSION, "k": kind, **fields})


def decode_control(header: dict) -> dict:
    """The typed record of a checked control header: only known fields, each of its type.

    Raises:
        ProtocolError("field"): a required field is missing or a field has the wrong type.
    """
    kind = header["k"]
    spec = CONTROL_FIELDS.get(kind)
    if spec is None:
        raise ProtocolError("kind", f"kind {kind} is not a control record")
    out = {"k": kind}
    for name, (typ, required) in spec.items():
        if name not in header or (header[name] is None and not required):
            if required:
                raise ProtocolError("field", f"{KIND_NAMES[kind]} without {name!r}")
            out[name] = None
            continue
        if not _type_ok(header[name], typ):
            raise ProtocolError("field", f"{KIND_NAMES[kind]}.{name} is not {typ}")
        out[name] = header[name]
    return out


def decode_header(frame, max_bytes: int = MAX_HEADER_BYTES) -> dict:
    """Parse and check the envelope of frame 0 (version, kind). Raises ProtocolError."""
    buf = memoryview(frame.buffer if hasattr(frame, "buffer") else frame)
    if buf.nbytes > max_bytes:
        raise ProtocolError("header_too_large", f"{buf.nbytes} bytes > {max_bytes}")
    try:
        header = msgpack.unpackb(
            buf,
            raw=False,
            strict_map_key=True,
            max_array_len=1 << 16,
            max_map_len=1 << 12,
        )
    except Exception as e:  # msgpack raises many types on garbage
        raise ProtocolError("garbage", f"header is not msgpack ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise ProtocolError("garbage", "header is not a map")
    v = header.get("v")
    if v != PROTOCOL_VERSION:
        raise ProtocolError(
            "version",
            f"protocol version {v!r}, this side speaks {PROTOCOL_VERSION}: upgrade the older side",
        )
    k = header.get("k")
    if not isinstance(k, int) or isinstance(k, bool) or k not in KINDS:
        raise ProtocolError("kind", f"unknown message kind {k!r}")
    return header


def _check_spec(spec, nframes: int | None):
    if not (isinstance(spec, list) and len(spec) == 4):
        raise ProtocolError("field", "tensor spec must be [name, dtype, shape, frame]")
    name, dt, shape, idx = spec
    if not isinstance(name, str):
        raise ProtocolError("field", "tensor name must be a string")
    if not isinstance(dt, str) or dt not in DTYPES:
        raise ProtocolError("dtype", f"unknown dtype {dt!r} for tensor {name!r}")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise ProtocolError("shape", f"shape of {name!r} must be a list of at most {MAX_NDIM} dims")
    numel = 1
    for d in shape:
        if not isinstance(d, int) or isinstance(d, bool) or d < 0:
            raise ProtocolError("shape", f"bad dimension {d!r} in shape of {name!r}")
        numel *= d
        if numel * DTYPES[dt].itemsize > MAX_TENSOR_BYTES:
            raise ProtocolError("shape", f"declared size of {name!r} is absurd: {shape}")
    if nframes is not None and (not isinstance(idx, int) or isinstance(idx, bool)):
        raise ProtocolError("field", f"frame index of {name!r} must be an int")
    return name, DTYPES[dt], shape, idx, numel * DTYPES[dt].itemsize


def tensor_view(buf, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    if len(buf) == 0:
        return torch.empty(shape, dtype=dtype)
    import warnings

    with warnings.catch_warnings():
        # frombuffer warns on read-only buffers (received frames are); we never write to them.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


def _required(header: dict, name: str, typ):
    v = header.get(name)
    if not isinstance(v, typ) or isinstance(v, bool):
        raise ProtocolError("field", f"field {name!r} missing or not {typ}")
    return v


def decode_sample(header: dict, frames: list, shm_resolver=None) -> Sample:
    """Build a Sample from a checked header and its tensor frames, without copying.

    Args:
        header: the map from `decode_header` (kind SAMPLE).
        frames: the frames after the header (zmq.Frame, bytes or memoryview).
        shm_resolver: callable(segment_name, offset, nbytes) -> memoryview, for headers with `shm`.

    Raises:
        ProtocolError: on any mismatch between header and frames.
    """
    key = _required(header, "key", str)
    tid = header.get("tid", "")
    seq = _required(header, "seq", int)
    layers = header.get("layers", [])
    if not isinstance(layers, list) or not all(isinstance(x, int) for x in layers):
        raise ProtocolError("field", "layers must be a list of ints")
    meta = header.get("meta", {})
    if not isinstance(meta, dict):
        raise ProtocolError("field", "meta must be a map")
    specs = _required(header, "t", list)
    if len(specs) > MAX_TENSORS:
        raise ProtocolError("field", f"{len(specs)} tensors > {MAX_TENSORS}")
    crc, x3, x3t = _digest_fields(header)
    shm = header.get("shm")
    chunk = header.get("ch", 0)
    if not _type_ok(chunk, "int") or chunk < 0 or (chunk and shm is not None):
        raise ProtocolError("field", "ch must be a positive int, and only on a framed sample")
    if shm is not None:
        tensors, bufs = _shm_views(shm, specs, frames, shm_resolver)
    else:
        tensors, bufs = _frame_views(specs, frames, chunk)
    bad = digest_mismatch(bufs, crc, x3, x3t)
    if bad is not None:
        raise ProtocolError("checksum", f"payload {bad[0]} mismatch for sample {key!r}")
    if (why := positions_problem(tensors)) is not None:
        raise ProtocolError("positions", f"sample {key!r}: {why}")
    out = Sample(
        key=key, tensors=tensors, layers=layers, meta=meta, teacher=str(tid), seq=seq, crc=crc, x3=x3, x3t=x3t
    )
    if shm is not None:
        out.stamp = (shm[0], shm[2], shm[3])
    return out


def _digest_fields(header: dict) -> tuple[int | None, int | None, int | None]:
    """The header's digests (`crc`, `x3`, `x3t`), each None or an unsigned int of its width."""
    out = []
    for name, bits in (("crc", 32), ("x3", 64), ("x3t", 64)):
        v = header.get(name)
        if v is not None and not (_type_ok(v, "int") and 0 <= v < 1 << bits):
            raise ProtocolError("field", f"{name} must be an unsigned {bits}-bit int")
        out.append(v)
    return out[0], out[1], out[2]


def _shm_views(shm, specs: list, frames: list, shm_resolver) -> tuple[dict[str, torch.Tensor], list]:
    """A shared-memory sample's tensors: views of the ring at the header's offsets."""
    if frames:
        raise ProtocolError("frames", f"shared-memory sample with {len(frames)} extra frames")
    if (
        not isinstance(shm, list)
        or len(shm) != 4
        or not isinstance(shm[0], str)
        or not isinstance(shm[1], list)
        or len(shm[1]) != len(specs)
        or not _type_ok(shm[2], "int")
        or not _type_ok(shm[3], "int")
        or shm[2] < 0
    ):
        raise ProtocolError("field", "shm must be [segment, [offset per tensor], stamp offset, stamp]")
    if shm_resolver is None:
        raise ProtocolError("field", "shared-memory sample on a connection without shared memory")
    tensors: dict[str, torch.Tensor] = {}
    bufs = []
    for spec, off in zip(specs, shm[1], strict=True):
        name, dtype, shape, _idx, nbytes = _check_spec(spec, None)
        if not isinstance(off, int) or off < 0:
            raise ProtocolError("field", f"bad shm offset {off!r}")
        try:
            buf = shm_resolver(shm[0], off, nbytes)
        except (OSError, ValueError) as e:
            raise ProtocolError("field", f"shm reference not readable: {e}") from None
        bufs.append(buf)
        tensors[name] = tensor_view(buf, dtype, shape)
    return tensors, bufs


def _frame_views(specs: list, frames: list, chunk: int = 0) -> tuple[dict[str, torch.Tensor], list]:
    """A framed sample's tensors: views of its frames, one per tensor in order; with `chunk`, a
    tensor in several frames is joined into one new buffer (every size is checked first)."""
    checked = [_check_spec(spec, len(frames)) for spec in specs]
    counts = [_nchunks(c[4], chunk) for c in checked]
    if len(frames) != sum(counts):
        raise ProtocolError(
            "frames",
            f"header declares {len(specs)} tensors in {sum(counts)} frames, got {len(frames)} frames",
        )
    views = [memoryview(f.buffer if hasattr(f, "buffer") else f) for f in frames]
    tensors: dict[str, torch.Tensor] = {}
    bufs = []
    first = 0
    for (name, dtype, shape, idx, nbytes), n, spec in zip(checked, counts, specs, strict=True):
        if idx != first + 1:
            raise ProtocolError("frames", f"tensor {name!r} names frame {idx}, expected {first + 1}")
        parts = views[first : first + n]
        first += n
        sizes = [p.nbytes for p in parts]
        want = [min(chunk, nbytes - i * chunk) for i in range(n)] if n > 1 else [nbytes]
        if sizes != want:
            raise ProtocolError(
                "length",
                f"tensor {name!r} {shape} {spec[1]} needs {nbytes} bytes, its frames hold {sum(sizes)}"
                + (f" in {n} chunks of {chunk}" if n > 1 else ""),
            )
        buf = parts[0] if n == 1 else _join(parts, nbytes)
        bufs.append(buf)
        tensors[name] = tensor_view(buf, dtype, shape)
    return tensors, bufs


def _join(parts: list[memoryview], nbytes: int) -> memoryview:
    """One buffer holding `parts` in order. numpy's copy: one thread, without the GIL (torch's
    copy spreads over its intra-op threads, which on a busy host made a student 5x slower)."""
    import numpy as np

    out = np.empty(nbytes, dtype=np.uint8)
    off = 0
    for p in parts:
        out[off : off + p.nbytes] = np.frombuffer(p, dtype=np.uint8)
        off += p.nbytes
    return memoryview(out)

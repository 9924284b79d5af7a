"""Typed configuration, loaded from YAML and validated once.

A run file has up to four sections; each role reads the ones it needs::

    teacher:    TeacherConfig (teacher/config.py)  - model, dataset, vLLM engine settings
    student:    StudentConfig (student/config.py)  - model, layer map, losses, optimizer
    transport:  TransportConfig (here)             - endpoints, credits, heartbeats, memory bounds
    spool:      SpoolConfig (here)                 - the safetensors fallback folder

Unknown keys fail at load with their dotted name and the allowed keys (no silent typos).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from distill.errors import ConfigError

GiB = 1 << 30
MiB = 1 << 20
# With `connections` / `io_threads` unset: this many per student / teacher socket, where the host
# has 4 cores for each (fewer: a quarter of its cores, at least 1). One connection's bytes (and
# CURVE's encryption) run on one I/O thread each side: one plain tcp connection carried ~1.5 GB/s
# under a teacher's load, where 8 layers of a Qwen3-8B teacher make 2.8 GB/s (BENCHMARKS.md,
# "Over tcp as a student on another host sees it"; "Transport and CURVE").
LANES = 4


def host_lanes() -> int:
    """Connections (student) or I/O threads (teacher) when they are unset: a quarter of this
    host's cores, at least 1 and at most LANES."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(LANES, cores // 4))


class Strict(BaseModel):
    """Base for every config section: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class CurveConfig(Strict):
    """ZeroMQ CURVE: every connection authenticated and encrypted. Keys: `distill-keygen`."""

    # This side's key pair: the `<name>.key_secret` file distill-keygen writes.
    secret_key: str
    # Students: the teacher's public key file (`<teacher>.key`).
    server_key: str | None = None
    # Teacher: folder of the public key files (`*.key`) of the students it accepts; others get nothing.
    authorized_keys: str | None = None


class TransportConfig(Strict):
    """How samples travel from teacher to students (ZeroMQ + optional shared memory)."""

    # Teacher side: endpoints the teacher binds (tcp://0.0.0.0:5555 across hosts, ipc:///tmp/x on one).
    bind: list[str] = Field(default_factory=lambda: ["tcp://127.0.0.1:5555"])
    # Student side: teacher endpoints to connect to (one or several teachers).
    connect: list[str] = Field(default_factory=lambda: ["tcp://127.0.0.1:5555"])
    # Teacher id carried in every header; default: hostname-pid.
    teacher_id: str | None = None
    # Teacher memory bound: bytes of samples waiting or in flight; beyond it samples spool to disk.
    max_buffer_bytes: int = Field(2 * GiB, gt=0)
    # With no student connected this long after start, samples spool instead of waiting in memory.
    connect_timeout_s: float = Field(10.0, ge=0)
    # Each side sends a heartbeat this often.
    heartbeat_interval_s: float = Field(0.5, gt=0)
    # A peer silent this long is dead: its unacked samples are redelivered to another student.
    heartbeat_timeout_s: float = Field(10.0, gt=0)
    # Student side: how long to wait for a teacher that went silent (or is not up yet) before giving
    # up with exit code 3; while waiting, a restarted teacher is picked up at once.
    teacher_wait_s: float = Field(600.0, gt=0)
    # Student credit window: unacked samples / bytes it may hold (memory bound on the student).
    # Cover three or more micro-batches: acks come after the optimizer step, so a window of one or
    # two batches makes the student wait for the teacher to refill it, and caps its batches.
    credit_samples: int = Field(64, gt=0)
    credit_bytes: int = Field(1 * GiB, gt=0)
    # Student side: ZeroMQ connections to each teacher endpoint. Samples are spread over them and
    # the credit window above is split among them (the student holds no more than with one). Across
    # hosts one connection's bytes run on one I/O thread each side (plain tcp ~1.5 GB/s under a
    # teacher's load; CURVE's encryption 1.2 GB/s on a 16-core GPU host, 3.2 GB/s with 4
    # connections), so several connections use several cores; the student gets that many I/O
    # threads. Each connection is a session at the teacher, named `<student>#<i>` for i >= 1; they
    # are opened 1 s apart (each on its own teacher I/O thread). Unset: a quarter of the host's
    # cores, at least 1 and at most 4 (on 2 cores: 1; more connections add nothing there).
    connections: int = Field(None, ge=1, le=16)  # type: ignore[assignment]  # set by _lanes
    # Same-host shared-memory data path: auto (used when the student can map the teacher's ring),
    # on (fail if it cannot), off (bytes always travel in ZeroMQ frames).
    shm: Literal["auto", "on", "off"] = "auto"
    # Size of the teacher's shared-memory ring (a sparse file in /dev/shm). It holds the samples in
    # flight to same-host students and the spool files read ahead (on CUDA, with ring staging, every
    # sample from the device until its student acks it); a sample that finds no room goes to its
    # student in frames (counted in shm_full, said once). 2 GiB: two default credit windows
    # (credit_bytes), one student's in flight plus as many queued for it (a 1 GiB ring missed half
    # the samples of Qwen3-8B with 8 layers, 67 MB each, on an H100: BENCHMARKS.md).
    shm_bytes: int = Field(2 * GiB, gt=0)
    shm_dir: str = "/dev/shm"
    # Payload checksum: computed once per sample on the producer's side, carried in the header and
    # the spool file, verified by every receiver (mismatch: rejected, counted, sent again).
    # xxh3-tree (the default): an xxh3-64 of 4 MiB chunk digests, hashed in parallel by the
    # connector's copy threads once the sample is out of pinned memory (off the engine's path);
    # a receiver checks a sample's chunks with 4 threads. xxh3: one xxh3-64 pass over all bytes
    # on the connector's sender thread. crc32: zlib's CRC32 (slow: ~1.5 GB/s on one core). none:
    # no payload digest on the wire (ring-slot stamps still catch stale shared memory; spool files
    # always carry a digest). A default on the data path changes only with the teacher and
    # end-to-end GPU benchmarks run on the new one (BENCHMARKS.md).
    checksum: Literal["none", "crc32", "xxh3", "xxh3-tree"] = "xxh3-tree"
    # Student side: raise glibc's mmap/trim thresholds so large received frames reuse warm heap
    # memory instead of a fresh mmap per sample (distill.transport.tune_malloc).
    tune_malloc: bool = True
    # Student side: how many keys it acked it remembers to drop a redelivered copy (oldest forgotten
    # first, so memory stays flat on runs of days; the teacher never resends an acked key, and the
    # student's ledger still skips everything it trained).
    dedup_keys: int = Field(1_000_000, gt=0)
    # Send/receive kernel buffer sizes for tcp (0 = OS default).
    socket_buffer_bytes: int = Field(4 * MiB, ge=0)
    # Teacher side: ZeroMQ I/O threads of the teacher's socket. Each student connection is served
    # by one of them (framing, and CURVE's encryption when `curve` is set), so with several tcp
    # students and CURVE more threads spread the encryption over more cores (one connection's
    # stays on one thread: about 0.8 GB/s on a 16-core GPU host); 1 keeps everything on one.
    # Shared-memory students move only headers. Measured: BENCHMARKS.md, "Transport and CURVE".
    # Unset: as many as a student's connections get by default (a quarter of the cores, 1 to 4).
    io_threads: int = Field(None, ge=1, le=64)  # type: ignore[assignment]  # set by _lanes
    # Teacher side: a tensor larger than this goes to a student over tcp in frames of this many
    # bytes, which the student joins (one copy). Each frame is then encrypted (CURVE) and copied
    # by the kernel while it is in cache: CURVE on one connection ran 2.5x faster with 1 MiB frames
    # than with 32 MiB tensors in one frame (BENCHMARKS.md, "Transport and CURVE"). Unset (the
    # default): 1 MiB with `curve`, whole tensors without it. 0: whole tensors always; else at
    # least 64 KiB. Shared-memory students get no frames (the bytes are in the ring).
    chunk_bytes: int | None = Field(None, ge=0)
    # Run identity carried in HELLO/WELCOME. Teacher: this id, else the one stored beside its journal
    # (`<journal>.run`, made at the first start), else one per process. Student: refuse a teacher of
    # another run; unset, it learns the id from the first teacher that welcomes it and refuses others
    # (students left over from an earlier run never take the next run's samples).
    run_id: str | None = None
    # Optional CURVE authentication and encryption (both sides must set it).
    curve: CurveConfig | None = None
    # Both sides: the largest message header accepted (headers are metadata; a teacher accepts
    # nothing larger from a student). Students: the largest ZeroMQ frame accepted (one tensor).
    max_header_bytes: int = Field(1 * MiB, ge=4096, le=64 * MiB)
    max_frame_bytes: int = Field(16 * GiB, gt=0)

    @model_validator(mode="after")
    def _lanes(self) -> TransportConfig:
        # Unset connections / io_threads: one per 4 cores of this host, 1 to LANES.
        lanes = host_lanes()
        for name in ("connections", "io_threads"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, lanes)  # no re-validation: the value is in range
        return self

    @field_validator("chunk_bytes")
    @classmethod
    def _chunk(cls, v: int | None) -> int | None:
        if v and v < 64 * 1024:
            raise ValueError(f"chunk_bytes must be 0 (whole tensors) or at least 65536, got {v}")
        return v

    @property
    def wire_chunk_bytes(self) -> int:
        """The frame size for tensors sent over tcp (0: whole tensors): `chunk_bytes`, or when
        unset 1 MiB with CURVE and 0 without."""
        if self.chunk_bytes is not None:
            return self.chunk_bytes
        return MiB if self.curve is not None else 0

    @field_validator("bind", "connect")
    @classmethod
    def _endpoints(cls, v: list[str]) -> list[str]:
        for ep in v:
            if not ep.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"endpoint {ep!r} must start with tcp://, ipc:// or inproc://")
        return v

    @property
    def connection_credit(self) -> tuple[int, int]:
        """(samples, bytes) of credit each of a student's connections asks for: the window split
        `connections` ways (at least one sample each; a sample larger than its connection's bytes
        still goes when that connection holds nothing)."""
        n = self.connections
        return max(1, self.credit_samples // n), max(1, self.credit_bytes // n)

    @property
    def credit_window(self) -> int:
        """The most unacked samples the teachers let one student hold: credit_samples per teacher
        endpoint it connects to (split among its `connections`)."""
        return self.connection_credit[0] * self.connections * len(self.connect)


class SpoolConfig(Strict):
    """The safetensors fallback: one file per sample in vLLM's layout."""

    # Folder for spooled samples; replayed to students when credit returns.
    dir: str = "runs/spool"
    # Keep spool files after their sample is acknowledged (default: delete on ack).
    keep: bool = False
    # Stop spooling (and block the producer) beyond this many bytes on disk; 0 = no limit. An empty
    # spool still takes one sample, however large (else that sample would block the teacher for good).
    max_bytes: int = Field(0, ge=0)
    # Replay: threads that read spool files ahead of the sender, and how many files they keep ready
    # (always within transport.max_buffer_bytes). More than one student batch of files ready keeps a
    # fast GPU student fed when its acks return a whole batch of credit at once.
    readers: int = Field(4, ge=1, le=64)
    read_ahead: int = Field(32, ge=1, le=4096)


class RunFile(Strict):
    """The top level of a YAML run file. Role sections are validated by their role's loader."""

    teacher: dict[str, Any] | None = None
    student: dict[str, Any] | None = None
    transport: TransportConfig = Field(default_factory=TransportConfig)
    spool: SpoolConfig = Field(default_factory=SpoolConfig)


M = TypeVar("M", bound=BaseModel)


def _format_errors(err: ValidationError, model: type[BaseModel], prefix: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        name = f"{prefix}{loc}" if prefix else loc
        if e["type"] == "extra_forbidden":
            # Find the model that owns the parent location to list its allowed keys.
            owner: Any = model
            for part in e["loc"][:-1]:
                field = getattr(owner, "model_fields", {}).get(part)
                ann = getattr(field, "annotation", None)
                owner = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
                if owner is None:
                    break
            allowed = sorted(owner.model_fields) if owner is not None else []
            lines.append(
                f"unknown key '{name}'" + (f"; allowed keys: {', '.join(allowed)}" if allowed else "")
            )
        else:
            lines.append(f"'{name}': {e['msg']} (got {e.get('input')!r})")
    return "; ".join(lines)


def validate(model: type[M], data: Any, prefix: str = "") -> M:
    """Validate `data` into `model`, turning pydantic's errors into one readable ConfigError."""
    try:
        return model.model_validate(data if data is not None else {})
    except ValidationError as e:
        raise ConfigError(f"invalid config: {_format_errors(e, model, prefix)}") from None


def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} not found")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping at the top level")
    return data


def load_run_file(path: str | os.PathLike, overrides: dict[str, Any] | None = None) -> RunFile:
    """Load and validate the top level of a run file (transport and spool sections typed)."""
    data = load_yaml(path)
    for dotted, value in (overrides or {}).items():
        _set_dotted(data, dotted, value)
    return validate(RunFile, data)


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    cur = data
    for p in parts[:-1]:
        cur = cur.setdefault(p, {})
        if not isinstance(cur, dict):
            raise ConfigError(f"cannot override {dotted!r}: {p!r} is not a section")
    cur[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """Parse a command-line override 'a.b=value' (value read as YAML: 3, true, [1,2], text)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    k, v = text.split("=", 1)
    return k.strip(), yaml.safe_load(v)


def eagle3_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's layers for an n-layer teacher: [2, n//2, n-3] (low, middle and high auxiliary
    states) and n (the last layer, before the final norm). The one definition of `layer_ids: eagle3`:
    the teacher's config (which also refuses n < 7), the export and the draft recipe use it."""
    n = num_layers
    return [2, n // 2, n - 3, n]

"""The safetensors fallback: one file per sample in vLLM's layout, written atomically.

A spool file holds the sample's tensors (`hidden_states` [num_tokens, num_layers, hidden] and
`token_ids` [num_tokens], as vLLM's ExampleHiddenStatesConnector writes them, plus `loss_mask`
[num_tokens] and, with `teacher.capture: loss_mask`, `positions` [R]: then `hidden_states` holds
those R positions' rows only, distill/capture.py) and, in the
safetensors header metadata, the sample key, teacher id, sequence number, layer ids, metadata and
a digest of the tensor bytes (`x3`: xxh3-64, or `crc`: CRC32 in files of earlier versions) that
`read_spool_file` verifies.
Files are written under a temporary name and renamed into place, so a reader never sees a partial
file. `read_spool_file` also reads files written by vLLM's own connector (no metadata: the key is
the file name), taking a shared flock on `<file>.lock` when one exists, as vLLM's reader does.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import shutil
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from distill.capture import positions_problem
from distill.digest import digest_mismatch
from distill.errors import SpoolChecksumError, SpoolFormatError
from distill.fp8 import dequantize_sample
from distill.protocol import Sample, sample_x3t, tensor_bytes

SUFFIX = ".safetensors"
TMP_SUFFIX = ".tmp"


def spool_name(key: str) -> str:
    """A file name for `key`: readable when the key is, unique either way."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in key)[:80]
    digest = hashlib.blake2s(key.encode(), digest_size=6).hexdigest()
    return f"{safe}-{digest}{SUFFIX}"


def lock_path(path: str | os.PathLike) -> Path:
    """The `<file>.lock` companion of a spool file (vLLM's readers take a shared flock on it)."""
    return Path(f"{path}.lock")


def remove_spool_file(path: str | os.PathLike) -> None:
    """Delete a spool file and its lock companion (either may be gone already)."""
    Path(path).unlink(missing_ok=True)
    lock_path(path).unlink(missing_ok=True)


def write_sample(directory: str | os.PathLike, sample: Sample) -> Path:
    """Write `sample` to `directory` atomically (temporary file, fsync-free rename); return the path.

    Contract (resume and delivery detection rely on it): the file is `directory/spool_name(key)`,
    with an empty `<file>.lock` beside it, as vLLM's own connector leaves.
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    final = d / spool_name(sample.key)
    tmp = final.with_name(f".{final.name}.{os.getpid()}{TMP_SUFFIX}")
    meta = {
        "key": sample.key,
        "teacher": sample.teacher,
        "seq": str(sample.seq),
        "layers": json.dumps(list(sample.layers)),
        "meta": json.dumps(sample.meta),
        "format": "distill-stream/1",
        # safetensors gives tensors back sorted by name: the producer's order, which the digest and
        # the wire frames follow, is kept here and restored by the reader.
        "order": json.dumps(list(sample.tensors)),
    }
    # A digest of the tensor bytes in order: a reader checks it (a damaged file is never used). The
    # digest the sample carries (xxh3 tree, xxh3-64, or CRC32 in files of earlier versions), else
    # the xxh3 tree digest computed here (transport.checksum's default, its leaves hashed in parallel).
    if sample.x3t is not None:
        meta["x3t"] = str(sample.x3t)
    elif sample.x3 is not None:
        meta["x3"] = str(sample.x3)
    elif sample.crc is not None:
        meta["crc"] = str(sample.crc)
    else:
        meta["x3t"] = str(sample_x3t(sample))
    tensors = {k: v.contiguous() for k, v in sample.tensors.items()}
    try:
        save_file(tensors, str(tmp), metadata=meta)
        # vLLM's load_hidden_states takes a shared flock on <file>.lock: make it exist.
        lock_path(final).touch()
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return final


# safetensors dtype names -> torch dtypes (the ones a hidden-state file can hold).
_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


# alloc(specs) -> (tensors to fill, handle) or None: where read_spool_file puts the bytes (e.g. a
# slot of the publisher's shared-memory ring); specs are name -> (shape, dtype) in sample order.
Alloc = Callable[[dict[str, tuple[list[int], torch.dtype]]], "tuple[dict[str, torch.Tensor], object] | None"]


def _read_header(fd: int, p: Path) -> tuple[dict, int, int]:
    """(header JSON, offset of the data section, its length) of a safetensors file."""
    size = os.fstat(fd).st_size
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        raise SpoolFormatError(f"{p}: {size} bytes, too short for a safetensors file")
    (n,) = struct.unpack("<Q", head)
    if n > _MAX_HEADER or 8 + n > size:
        raise SpoolFormatError(f"{p}: safetensors header of {n} bytes in a file of {size}")
    try:
        header = json.loads(os.pread(fd, n, 8))
    except ValueError as e:
        raise SpoolFormatError(f"{p}: safetensors header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise SpoolFormatError(f"{p}: safetensors header is not a JSON object")
    return header, 8 + n, size - 8 - n


def _tensor_specs(header: dict, data_len: int, p: Path) -> dict[str, tuple[list[int], torch.dtype, int, int]]:
    """name -> (shape, dtype, begin, end) for each tensor, checked against the data section."""
    specs = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dt = _DTYPES[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise SpoolFormatError(f"{p}: tensor {name!r} has an unreadable entry {info!r}") from None
        want = math.prod(shape) * torch.empty((), dtype=dt).element_size()
        if min(shape, default=0) < 0 or not 0 <= begin <= end <= data_len or end - begin != want:
            raise SpoolFormatError(
                f"{p}: tensor {name!r} ({info['dtype']} {shape}) does not fit its data offsets "
                f"[{begin}, {end}) in {data_len} bytes of data"
            )
        specs[name] = (shape, dt, begin, end)
    return specs


def _pread_into(fd: int, buf: memoryview, offset: int, p: Path) -> None:
    got = 0
    while got < len(buf):
        n = os.preadv(fd, [buf[got:]], offset + got)
        if n == 0:
            raise SpoolFormatError(f"{p}: file ends inside a tensor")
        got += n


def read_spool_file(path: str | os.PathLike, *, lock: bool = True) -> Sample:
    """Load one spool file (ours or vLLM's ExampleHiddenStatesConnector's) into a Sample.

    The tensor bytes are read straight into fresh tensors (one copy, no mmap page faults) and
    checked against the file's digest; fp8 hidden states are handed back in the model dtype
    (distill/fp8.py). Raises SpoolFormatError (not a well-formed safetensors
    file, or `positions` that disagree with what it holds), ValueError (no hidden_states),
    SpoolChecksumError, or OSError.
    """
    # fp8 hidden states (teacher.hidden_dtype: fp8) come back in the model dtype.
    return dequantize_sample(read_spool_into(path, lock=lock)[0])


def read_spool_into(
    path: str | os.PathLike, *, lock: bool = True, alloc: Alloc | None = None, release=None
) -> tuple[Sample, object]:
    """`read_spool_file`, also returning the handle `alloc` gave for the tensors (None when fresh
    tensors were used). On an error, `release(handle)` is called before raising."""
    p = Path(path)
    lock_file = lock_path(p)
    lfd = None
    if lock and lock_file.exists():
        lfd = os.open(lock_file, os.O_RDONLY)
        fcntl.flock(lfd, fcntl.LOCK_SH)
    handle = None
    try:
        fd = os.open(p, os.O_RDONLY)
        try:
            header, data_off, data_len = _read_header(fd, p)
            md = header.get("__metadata__") or {}
            specs = _tensor_specs(header, data_len, p)
            if "hidden_states" not in specs:
                raise ValueError(
                    f"{p} has no 'hidden_states' tensor (keys: {sorted(specs)}): not a hidden-state file"
                )
            # The producer's order (safetensors sorts by name); else the order of the bytes.
            order = json.loads(md["order"]) if "order" in md else []
            names = order if sorted(order) == sorted(specs) else sorted(specs, key=lambda k: specs[k][2])
            got = alloc({k: (specs[k][0], specs[k][1]) for k in names}) if alloc is not None else None
            if got is None:
                tensors = {k: torch.empty(specs[k][0], dtype=specs[k][1]) for k in names}
            else:
                tensors, handle = got
            for k in names:
                _, _, begin, end = specs[k]
                if end > begin:
                    _pread_into(fd, tensor_bytes(tensors[k]), data_off + begin, p)
        finally:
            os.close(fd)
        key = md.get("key") or (p.name[: -len(SUFFIX)] if p.name.endswith(SUFFIX) else p.name)
        x3 = int(md["x3"]) if md.get("x3", "").isdigit() else None
        x3t = int(md["x3t"]) if md.get("x3t", "").isdigit() else None
        crc = int(md["crc"]) if md.get("crc", "").isdigit() else None
        bad = digest_mismatch([tensor_bytes(t) for t in tensors.values()], crc, x3, x3t)
        if bad is not None:
            name, got_d, want = bad
            raise SpoolChecksumError(f"{p}: tensor bytes do not match the file's {name} ({got_d} != {want})")
        why = positions_problem(tensors)
        if why is not None:  # teacher.capture: loss_mask (distill/capture.py)
            raise SpoolFormatError(f"{p}: {why}")
        sample = Sample(
            crc=crc,
            x3=x3,
            x3t=x3t,
            key=key,
            tensors=tensors,
            layers=json.loads(md["layers"]) if "layers" in md else [],
            meta=json.loads(md["meta"]) if "meta" in md else {},
            teacher=md.get("teacher", ""),
            seq=int(md.get("seq", 0)),
        )
    except BaseException:
        if handle is not None and release is not None:
            release(handle)
        raise
    finally:
        if lfd is not None:
            fcntl.flock(lfd, fcntl.LOCK_UN)
            os.close(lfd)
    return sample, handle


def list_spool(directory: str | os.PathLike) -> list[Path]:
    """Complete spool files in `directory` (recursively: vLLM nests them), in name order."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted(p for p in d.rglob(f"*{SUFFIX}") if not p.name.startswith(".") and p.is_file())


def spool_bytes(directory: str | os.PathLike) -> int:
    """Bytes of the complete spool files in `directory` now (a file acked and removed between the
    listing and its stat counts 0)."""
    total = 0
    for p in list_spool(directory):
        try:
            total += p.stat().st_size
        except FileNotFoundError:
            pass
    return total


# What to do when spool.dir's filesystem fills up (said by the spooler and by distill-teacher).
SPOOL_FULL_ADVICE = (
    "free space there, or set spool.max_bytes below its free space so that the teacher waits for "
    "students instead"
)


def disk_room(path: str | os.PathLike) -> tuple[int, int, str] | None:
    """(free bytes, total bytes, "F of T MB free") of the filesystem holding `path`; None when it
    cannot be read."""
    try:
        du = shutil.disk_usage(path)
    except OSError:
        return None
    return du.free, du.total, f"{du.free / 1e6:.0f} of {du.total / 1e6:.0f} MB free"


def iter_spool(
    directory: str | os.PathLike, *, rank: int = 0, world_size: int = 1, skip_keys=None
) -> Iterator[Sample]:
    """Yield the samples of a spool folder; with `world_size` > 1, rank r takes files r, r+W, ...

    Raises:
        FileNotFoundError: at once (not at the first `next`) when the folder does not exist or
            holds no spool file.
    """
    files = list_spool(directory)
    if not files:
        raise FileNotFoundError(
            f"spool folder {str(directory)!r} has no *{SUFFIX} files: run the teacher first, or point "
            "spool.dir at the folder it wrote"
        )

    def gen() -> Iterator[Sample]:
        for p in files[rank::world_size]:
            s = read_spool_file(p)
            if skip_keys is not None and s.key in skip_keys:
                continue
            yield s

    return gen()

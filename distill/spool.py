"""The safetensors fallback: one file per sample in vLLM's layout, written atomically.

A spool file holds the sample's tensors (`hidden_states` [num_tokens, num_layers, hidden] and
`token_ids` [num_tokens], as vLLM's ExampleHiddenStatesConnector writes them) and, in the
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
import os
from collections.abc import Iterator
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from distill.protocol import Sample, digest_mismatch, sample_x3, tensor_bytes

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


class SpoolChecksumError(ValueError):
    """A spool file whose tensor bytes do not match the digest (xxh3-64 or CRC32) written with them."""


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
    # sample's xxh3-64 when it has one, else its CRC32 (files of earlier versions carry only that),
    # else an xxh3-64 computed here (far cheaper than a CRC32).
    if sample.x3 is not None:
        meta["x3"] = str(sample.x3)
    elif sample.crc is not None:
        meta["crc"] = str(sample.crc)
    else:
        meta["x3"] = str(sample_x3(sample))
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


def read_spool_file(path: str | os.PathLike, *, lock: bool = True) -> Sample:
    """Load one spool file (ours or vLLM's ExampleHiddenStatesConnector's) into a Sample."""
    p = Path(path)
    lock_file = lock_path(p)
    fd = None
    if lock and lock_file.exists():
        fd = os.open(lock_file, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        with safe_open(str(p), framework="pt") as f:
            md = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    finally:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
    if "hidden_states" not in tensors:
        raise ValueError(
            f"{p} has no 'hidden_states' tensor (keys: {sorted(tensors)}): not a hidden-state file"
        )
    order = json.loads(md["order"]) if "order" in md else []
    if sorted(order) == sorted(tensors):
        tensors = {k: tensors[k] for k in order}
    key = md.get("key") or (p.name[: -len(SUFFIX)] if p.name.endswith(SUFFIX) else p.name)
    x3 = int(md["x3"]) if md.get("x3", "").isdigit() else None
    crc = int(md["crc"]) if md.get("crc", "").isdigit() else None
    bad = digest_mismatch([tensor_bytes(t) for t in tensors.values()], crc, x3)
    if bad is not None:
        name, got, want = bad
        raise SpoolChecksumError(f"{p}: tensor bytes do not match the file's {name} ({got} != {want})")
    return Sample(
        crc=crc,
        x3=x3,
        key=key,
        tensors=tensors,
        layers=json.loads(md["layers"]) if "layers" in md else [],
        meta=json.loads(md["meta"]) if "meta" in md else {},
        teacher=md.get("teacher", ""),
        seq=int(md.get("seq", 0)),
    )


def list_spool(directory: str | os.PathLike) -> list[Path]:
    """Complete spool files in `directory` (recursively: vLLM nests them), in name order."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted(p for p in d.rglob(f"*{SUFFIX}") if not p.name.startswith(".") and p.is_file())


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

"""The payload digests a sample header may carry (distill/protocol.py): `crc` (CRC32), `x3` (xxh3-64)
and `x3t` (the xxh3 tree digest), each over the tensors' bytes in tensor order, and the check a
receiver or a spool reader makes. `x3t` cuts each tensor into DIGEST_CHUNK-byte leaves that can be
hashed in parallel, by the threads that copy them (`ChunkDigests`). Bytes only: no tensors, no
Sample.
"""

from __future__ import annotations

import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor

import xxhash

DIGEST_CHUNK = 4 << 20  # bytes per leaf of the `x3t` tree digest (part of the wire format: never change)
# `x3t_of` hashes the leaves of a buffer list with this many threads when there are several
# (xxhash releases the GIL), so a receiver is not bound by one core: a GPU student receives ~250 MB
# a step, and on one H100 host its subscriber thread spent 63% of a run hashing them on one core.
LEAF_THREADS = 4
_leaf_pool: ThreadPoolExecutor | None = None
_leaf_lock = threading.Lock()


def crc32_of(buffers: list) -> int:
    """CRC32 of the buffers' bytes, in order (what `crc` in a header means)."""
    crc = 0
    for b in buffers:
        crc = zlib.crc32(b, crc)
    return crc


def xxh3_of(buffers: list) -> int:
    """xxh3-64 (seed 0) of the buffers' bytes, in order (what `x3` in a header means)."""
    h = xxhash.xxh3_64()
    for b in buffers:
        h.update(b)
    return h.intdigest()


def _chunks(buf, chunk: int = DIGEST_CHUNK) -> list[memoryview]:
    """One tensor's bytes as `chunk`-byte pieces (the last shorter; none when empty)."""
    mv = memoryview(buf).cast("B")
    return [mv[i : i + chunk] for i in range(0, mv.nbytes, chunk)]


def chunk_digests(buf, chunk: int = DIGEST_CHUNK) -> list[int]:
    """xxh3-64 of each `chunk`-byte piece of one tensor's bytes (the leaves of `x3t`)."""
    return [xxhash.xxh3_64_intdigest(p) for p in _chunks(buf, chunk)]


def x3t_combine(leaves: list[int]) -> int:
    """The `x3t` root over the chunk digests of every tensor, in tensor order."""
    return xxhash.xxh3_64_intdigest(b"".join(d.to_bytes(8, "little") for d in leaves))


def x3t_of(buffers: list) -> int:
    """xxh3 tree digest of the buffers (one per tensor, in order): what `x3t` in a header means.
    Several leaves are hashed by LEAF_THREADS threads (the same digest)."""
    pieces = [p for b in buffers for p in _chunks(b)]
    if len(pieces) > 1 and LEAF_THREADS > 1:
        leaves = list(_pool().map(xxhash.xxh3_64_intdigest, pieces))
    else:
        leaves = [xxhash.xxh3_64_intdigest(p) for p in pieces]
    return x3t_combine(leaves)


def _pool() -> ThreadPoolExecutor:
    global _leaf_pool
    with _leaf_lock:
        if _leaf_pool is None:
            _leaf_pool = ThreadPoolExecutor(LEAF_THREADS, thread_name_prefix="distill-digest")
        return _leaf_pool


def _new_pool_in_child() -> None:
    """A forked child (vLLM may fork its engine core from the teacher) has none of the parent's
    threads: a pool inherited with them would take work and never run it. The child makes its own."""
    global _leaf_pool, _leaf_lock
    _leaf_pool, _leaf_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_new_pool_in_child)


class ChunkDigests:
    """Collects the `x3t` leaves of one sample's tensors, computed piecewise (possibly by several
    threads, each for its own chunk range) while the bytes are copied; `root()` gives the digest.

    `add(tensor_index, first_chunk, digests)` records the digests of chunks first_chunk.. of
    tensor `tensor_index`; `root()` checks every chunk of every tensor was recorded."""

    def __init__(self, nbytes_per_tensor: list[int], chunk: int = DIGEST_CHUNK):
        self.chunk = chunk
        self._leaves = [[None] * (-(-n // chunk)) for n in nbytes_per_tensor]

    def add(self, tensor_index: int, first_chunk: int, digests: list[int]) -> None:
        self._leaves[tensor_index][first_chunk : first_chunk + len(digests)] = digests

    def root(self) -> int:
        flat = [d for leaves in self._leaves for d in leaves]
        if any(d is None for d in flat):
            raise ValueError("x3t: a chunk was not digested")
        return x3t_combine(flat)


def digest_mismatch(
    bufs: list, crc: int | None, x3: int | None, x3t: int | None = None
) -> tuple[str, int, int] | None:
    """(algorithm, computed, recorded) of the first recorded digest the bytes do not match."""
    for name, want, fn in (("xxh3 tree", x3t, x3t_of), ("xxh3-64", x3, xxh3_of), ("CRC32", crc, crc32_of)):
        if want is not None:
            got = fn(bufs)
            if got != want:
                return name, got, want
    return None

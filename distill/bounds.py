"""`Bounds`: what a publisher holds against its two limits, and its counters.

Memory: `held_bytes` (samples submitted and not yet acked: inbox, pending, in flight, read ahead
from the spool) against `max_held_bytes` (transport.max_buffer_bytes). Spool: `spool_bytes`
(files written and not yet removed) against `spool_max_bytes` (spool.max_bytes, 0: no limit).
Every rule that reads these limits is a method here: where a new sample goes (`wait_for_room`) and
whether a spool file may be read ahead (`may_hold`). One lock for the bytes and the counters;
`cond` wakes a producer waiting for room and the spool's reader threads.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

from distill.errors import TransportError

log = logging.getLogger("distill.transport")


class Bounds:
    """The publisher's memory and spool limits, the bytes held against them, and its counters."""

    def __init__(self, max_held_bytes: int, spool_max_bytes: int = 0):
        self.max_held_bytes = max_held_bytes
        self.spool_max_bytes = spool_max_bytes
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.held_bytes = 0
        self.spool_bytes = 0
        self.counters: collections.Counter = collections.Counter()
        self.rejected: collections.Counter = collections.Counter()  # by reason
        self.waiting_since: float | None = None  # a producer waits for spool room since (monotonic)

    def count(self, name: str, n: float = 1) -> None:
        with self.lock:
            self.counters[name] += n

    def reject(self, reason: str) -> None:
        with self.lock:
            self.rejected[reason] += 1

    def add(self, *, held: int = 0, spool: int = 0) -> None:
        with self.lock:
            self.held_bytes += held
            self.spool_bytes += spool

    def free(self, *, held: int = 0, spool: int = 0) -> None:
        """Room again: wakes a waiting producer."""
        with self.cond:
            self.held_bytes -= held
            self.spool_bytes -= spool
            self.cond.notify_all()

    def may_hold(self, nbytes: int) -> bool:
        """(Under the lock) Whether `nbytes` more fit in memory (always true when nothing is held:
        one sample larger than the limit still moves)."""
        return self.held_bytes == 0 or self.held_bytes + nbytes <= self.max_held_bytes

    def wait_for_room(
        self,
        nbytes: int,
        *,
        no_students: Callable[[], bool],
        stopped: Callable[[], bool],
        give_up: Callable[[], bool] = lambda: False,
    ) -> bool:
        """(Under the lock) Whether a new sample of `nbytes` goes to the spool (memory full, or
        `no_students()`); when the spool is full too, wait until students take samples, said every
        30 s. Raises TransportError once `stopped()`, or when it would wait and `give_up()`."""
        limit = self.spool_max_bytes
        waited_since, logged = None, 0.0
        try:
            while True:
                if stopped():
                    raise TransportError("submit() on a closed publisher")
                to_spool = no_students() or self.held_bytes + nbytes > self.max_held_bytes
                if not to_spool or not limit or self.spool_bytes == 0 or self.spool_bytes + nbytes <= limit:
                    break
                if give_up():
                    raise TransportError(
                        f"spool.max_bytes ({limit} bytes) is full: the producer stopped waiting"
                    )
                now = time.monotonic()
                if waited_since is None:
                    waited_since = self.waiting_since = now
                    self.counters["spool_full_waits"] += 1
                if now - logged >= 30:
                    logged = now
                    log.warning(
                        "spool full (%d of %d bytes) and memory full: waiting for students (%.0f s so far)",
                        self.spool_bytes,
                        limit,
                        now - waited_since,
                    )
                self.cond.wait(0.5)
        finally:
            if waited_since is not None:
                self.waiting_since = None
                self.counters["spool_full_wait_s"] += time.monotonic() - waited_since
        return to_spool

    def waiting_s(self) -> float:
        """(Under the lock) How long a producer has been waiting for spool room (0: none waits)."""
        return 0.0 if self.waiting_since is None else time.monotonic() - self.waiting_since

    def snapshot(self) -> dict:
        with self.lock:
            s = dict(self.counters)
            s["buffered_bytes"] = self.held_bytes
            s["spool_bytes"] = self.spool_bytes
            s["rejected"] = sum(self.rejected.values())
            s["rejected_by_reason"] = dict(self.rejected)
        return s

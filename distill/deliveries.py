"""`Deliveries`: what a student's Subscriber holds for its consumer, between the I/O thread that
receives samples and the training loop that takes, acks, discards and commits them.

A received sample is HELD (handed to the consumer) until the consumer acks it (after the optimizer
step that used it) or discards it (its shared-memory slot was reused: the student was frozen past
the heartbeat timeout). A redelivered copy of a held key is never acknowledged on the held copy's
behalf: it waits beside it and is acked with it, or takes its place if the held copy is discarded.
A key already trained (in `skip`, the job's ledger: committed too; or consumed in this process) is
a duplicate: acked at once, never trained twice. One lock for all of it.
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Iterable

from distill.protocol import Sample

END_MARK = object()  # queued once every teacher has sent END
COMMIT = object()  # an entry of the ack queue: a checkpoint covers everything acked before it

NEW, COPY, DUPLICATE, DUPLICATE_COMMITTED = "new", "copy", "duplicate", "duplicate_committed"


class Deliveries:
    """Held samples, the consumer's queue, and the acks and commits it made (any thread)."""

    def __init__(self, *, skip_keys, dedup_keys: int, commit_on_ack: bool, counters: collections.Counter):
        self.commit_on_ack = commit_on_ack
        self._skip = skip_keys if skip_keys is not None else set()
        self._dedup_keys = dedup_keys
        self._counters = counters
        # keys acked in this process, oldest first, at most dedup_keys
        self._consumed: collections.OrderedDict[str, None] = collections.OrderedDict()
        # keys handed to the consumer and not yet acked -> redelivered copies waiting beside them
        self._held: dict[str, list[Sample]] = {}
        self._q: queue.Queue = queue.Queue()
        self._acks: collections.deque = collections.deque()  # (tid, seq, key, commit) | COMMIT
        self._uncommitted = 0
        self._lock = threading.Lock()

    # --- I/O thread ------------------------------------------------------------------------------

    def offer(self, s: Sample) -> str:
        """A sample received: NEW (queued for the consumer), COPY (a redelivered copy of a held
        key: waits beside it), or a duplicate to ack at once: DUPLICATE_COMMITTED (in the ledger)
        or DUPLICATE (consumed here; with commit_on_ack off, the next commit covers its ack)."""
        with self._lock:
            if s.key in self._held:
                self._held[s.key].append(s)
                self._counters["held_copies"] += 1
                return COPY
            if s.key in self._skip:
                self._counters["skipped_duplicates"] += 1
                return DUPLICATE_COMMITTED
            if s.key in self._consumed:
                self._counters["skipped_duplicates"] += 1
                if not self.commit_on_ack:
                    self._uncommitted += 1
                return DUPLICATE
            self._held[s.key] = []
        self._q.put(s)
        return NEW

    def end(self) -> None:
        """Every teacher sent END: the consumer's `get` returns None after what is queued."""
        self._q.put(END_MARK)

    def take_acks(self) -> list:
        """The acks and commits made since the last call, in order."""
        with self._lock:
            ops = list(self._acks)
            self._acks.clear()
        return ops

    # --- the consumer ----------------------------------------------------------------------------

    def next(self, timeout: float):
        """The next queued sample or END_MARK; raises queue.Empty after `timeout`."""
        return self._q.get(timeout=timeout)

    def ack(self, samples: Iterable[Sample]) -> None:
        with self._lock:
            for s in samples:
                self._consumed[s.key] = None
                copies = [s, *self._held.pop(s.key, [])]
                for c in copies:
                    self._acks.append((c.via or c.teacher, c.seq, c.key, self.commit_on_ack))
                self._counters["acked"] += 1
                if not self.commit_on_ack:
                    self._uncommitted += 1
            while len(self._consumed) > self._dedup_keys:
                self._consumed.popitem(last=False)

    def commit(self) -> None:
        with self._lock:
            self._acks.append(COMMIT)
            self._uncommitted = 0

    @property
    def uncommitted(self) -> int:
        return self._uncommitted

    def discard(self, samples: Iterable[Sample]) -> None:
        with self._lock:
            for s in samples:
                copies = self._held.pop(s.key, [])
                self._counters["discarded"] += 1
                if copies:
                    self._held[s.key] = copies[1:]
                    self._q.put(copies[0])

"""The publisher's bounds and its spool side: `Budget` (bytes held in memory and in the spool, and
the counters, all under one lock) and `Spooler` (samples that do not fit in memory, or that no
student takes, go to spool files; the files are replayed to students when credit returns, and
removed when acked). Used by distill/publisher.py."""

from __future__ import annotations

import collections
import logging
import threading
from pathlib import Path

from distill.config import SpoolConfig
from distill.protocol import Sample
from distill.spool import read_spool_file, remove_spool_file, write_sample
from distill.students import Entry

log = logging.getLogger("distill.transport")


class Budget:
    """Bytes a publisher holds in memory (`held_bytes`: inbox + pending + in flight) and in the
    spool (`spool_bytes`, for spool.max_bytes), and its counters. One lock for all of them; `cond`
    wakes a producer waiting for room."""

    def __init__(self):
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.held_bytes = 0
        self.spool_bytes = 0
        self.counters: collections.Counter = collections.Counter()
        self.rejected: collections.Counter = collections.Counter()  # by reason

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

    def snapshot(self) -> dict:
        with self.lock:
            s = dict(self.counters)
            s["buffered_bytes"] = self.held_bytes
            s["spool_bytes"] = self.spool_bytes
            s["rejected"] = sum(self.rejected.values())
            s["rejected_by_reason"] = dict(self.rejected)
        return s


class Spooler:
    """Spool files a publisher knows of: written by producers (`write`), left by earlier runs
    (`add_files`), and parked by the I/O thread (`park`); replayed in that order (`load_next`)."""

    def __init__(self, cfg: SpoolConfig, budget: Budget):
        self.cfg = cfg
        self.budget = budget
        self._new: collections.deque[tuple[Path, int]] = collections.deque()  # any thread, under the lock
        self.replay: collections.deque[tuple[Path, int]] = collections.deque()  # I/O thread

    def __len__(self) -> int:
        """Files waiting to be replayed."""
        return len(self.replay) + len(self._new)

    def has_new(self) -> bool:
        """(Under budget.lock) files written since the I/O thread last looked."""
        return bool(self._new)

    def write(self, sample: Sample, reserved: int) -> Path:
        """(Producer thread) Write `sample` to a spool file; `reserved` bytes of spool_bytes were
        taken for it (corrected to the file's size here)."""
        try:
            path = write_sample(self.cfg.dir, sample)
            size = path.stat().st_size
        except BaseException:
            self.budget.add(spool=-reserved)
            raise
        with self.budget.lock:
            self.budget.spool_bytes += size - reserved
            self.budget.counters["spooled"] += 1
            self.budget.counters["spooled_bytes"] += sample.nbytes
            self._new.append((path, size))
        return path

    def add_files(self, paths) -> None:
        """Replay these spool files too (e.g. written by another process)."""
        items = []
        for p in paths:
            try:
                items.append((Path(p), Path(p).stat().st_size))
            except FileNotFoundError:
                continue
        with self.budget.lock:
            self.budget.spool_bytes += sum(n for _, n in items)
            self._new.extend(items)

    def take_new(self) -> None:
        """(I/O thread) Queue the files written since the last look for replay."""
        with self.budget.lock:
            while self._new:
                self.replay.append(self._new.popleft())

    def park(self, e: Entry) -> None:
        """(I/O thread) A sample waiting in memory goes (back) to the spool and is replayed later."""
        if e.spool_path is None:
            path = write_sample(self.cfg.dir, e.sample)
            size = path.stat().st_size
            with self.budget.lock:
                self.budget.counters["spooled"] += 1
                self.budget.counters["spooled_bytes"] += e.nbytes
                self.budget.spool_bytes += size
        else:
            path, size = e.spool_path, e.spool_size  # replayed from the spool: it is still there
            self.budget.count("replayed", -1)
        self.replay.append((path, size))
        self.budget.free(held=e.nbytes)

    def write_leftover(self, e: Entry) -> None:
        """(Close) A sample in memory that no student acked goes to the spool (never lost)."""
        if e.spool_path is None:
            write_sample(self.cfg.dir, e.sample)
            with self.budget.lock:
                self.budget.counters["spooled"] += 1
                self.budget.counters["spooled_bytes"] += e.nbytes

    def release(self, e: Entry) -> None:
        """An acked sample: its spool file (if any) is removed (unless spool.keep), its bytes freed."""
        freed_spool = 0
        if e.spool_path is not None and not self.cfg.keep:
            remove_spool_file(e.spool_path)
            freed_spool = e.spool_size
        self.budget.free(held=e.nbytes, spool=freed_spool)

    def load_next(self, max_buffer_bytes: int) -> Entry | None:
        """(I/O thread) The next spool file as an entry held in memory, if memory allows; None when
        there is none or no room. A file that cannot be read is counted and set aside (.corrupt)."""
        while self.replay:
            p, size = self.replay[0]
            if not p.exists():
                self.replay.popleft()
                self.budget.free(spool=size)
                continue
            with self.budget.lock:
                held = self.budget.held_bytes
            if held > 0 and held + size > max_buffer_bytes:
                return None
            self.replay.popleft()
            try:
                s = read_spool_file(p, lock=False)
            except Exception as e:  # a corrupt file is counted and set aside for inspection
                self._set_aside(p, size, e)
                continue
            with self.budget.lock:
                self.budget.held_bytes += s.nbytes
                self.budget.counters["replayed"] += 1
            return Entry(s, s.nbytes, spool_path=p, spool_size=size)
        return None

    def _set_aside(self, p: Path, size: int, err: Exception) -> None:
        self.budget.reject("spool_file")
        bad = p.with_name(p.name + ".corrupt")
        try:
            p.rename(bad)  # no longer counts as spooled: distill-teacher generates it again
        except OSError:
            bad = p
        log.error("cannot replay spool file %s (kept as %s): %s", p, bad, err)
        self.budget.free(spool=size)

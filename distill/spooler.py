"""The publisher's spool side: `Spooler` (samples that do not fit in memory, or that no student
takes, go to spool files; the files are replayed to students when credit returns, and removed when
acked). The bytes it writes and reads ahead count against the publisher's `distill.bounds.Bounds`.
Used by distill/publisher.py."""

from __future__ import annotations

import collections
import errno
import logging
import os
import queue
import threading
import time
from pathlib import Path

from distill.bounds import Bounds
from distill.config import SpoolConfig
from distill.errors import TransportError
from distill.protocol import Sample
from distill.spool import (
    SPOOL_FULL_ADVICE,
    Alloc,
    disk_room,
    read_spool_into,
    remove_spool_file,
    write_sample,
)
from distill.students import Entry

log = logging.getLogger("distill.transport")


def _no_space(err: Exception) -> bool:
    """A full filesystem: an OSError from Python, or safetensors' own error (its Rust writer
    reports the errno only in the message)."""
    if isinstance(err, OSError):
        return err.errno in (errno.ENOSPC, errno.EDQUOT)
    return any(f"(os error {n})" in str(err) for n in (errno.ENOSPC, errno.EDQUOT))


class Spooler:
    """Spool files a publisher knows of: written by producers (`write`), left by earlier runs
    (`add_files`), and parked by the I/O thread (`park`); replayed in that order.

    Replay reads ahead: while a student is connected (`demand`), `spool.readers` threads (`start`)
    read and check the next files into memory (a ring slot when there is room) while the I/O thread
    sends, at most `spool.read_ahead` files and never past the publisher's memory bound; the I/O
    thread takes them with `load_next`, which never blocks. Several readers because one reads and
    hashes at ~2 GB/s (pread and xxh3 release the GIL), less than a GPU student takes. With no
    student, files read ahead are given back (memory freed, the files first in line again). Files
    are sent in about the order they were queued (readers finish out of order).
    """

    def __init__(self, cfg: SpoolConfig, bounds: Bounds, alloc: Alloc | None = None, free_slot=None):
        self.cfg = cfg
        self.bounds = bounds
        # Where replayed files are read to (alloc: a ring slot of the publisher, so that no second
        # copy is needed to send them through shared memory) and how such a slot is given back
        # (free_slot(offset)); fresh tensors without.
        self.alloc, self.free_slot = alloc, free_slot
        # All under bounds.lock: written since the I/O thread last looked; to replay, in order; read
        # ahead and checked (entries held in memory); being read now.
        self._new: collections.deque[tuple[Path, int]] = collections.deque()
        self._replay: collections.deque[tuple[Path, int]] = collections.deque()
        self._ready: collections.deque[Entry] = collections.deque()
        self._reading = 0
        self._demand = False
        self._wake_io = None
        self._stop = False
        self._threads: list[threading.Thread] = []
        self._trash: queue.SimpleQueue = queue.SimpleQueue()  # (path, size) of acked spool files
        # (Under bounds.lock) Absolute paths of the files queued, read ahead or in flight, until
        # acked or found gone: `add_files` skips them (a file is replayed once, not once per call).
        self._known: set[str] = set()
        self._remover: threading.Thread | None = None

    def __len__(self) -> int:
        """Files waiting to be replayed (including those read ahead)."""
        return self.to_replay() + len(self._new)

    def to_replay(self) -> int:
        """Files queued for replay, being read, or read and not yet taken by `load_next`."""
        return len(self._replay) + self._reading + len(self._ready)

    def ready(self) -> int:
        """Files read ahead and not yet taken by the I/O thread."""
        return len(self._ready)

    def start(self, wake_io) -> None:
        """Start the reader threads: they keep the publisher's held bytes within its bounds and
        call `wake_io()` when a file is ready."""
        self._wake_io = wake_io
        for i in range(self.cfg.readers):
            t = threading.Thread(target=self._read_ahead, name=f"distill-spool-replay-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        self._remover = threading.Thread(target=self._remove, name="distill-spool-remove", daemon=True)
        self._remover.start()

    def stop(self) -> None:
        """Stop the reader threads. Files read ahead stay in the spool (nothing is lost); their ring
        slots are given back."""
        with self.bounds.cond:
            self._stop = True
            self.bounds.cond.notify_all()
        for t in self._threads:
            t.join()
        self._threads = []
        self._give_back_ready()
        if self._remover is not None:  # every acked file is removed before stop() returns
            self._trash.put(None)
            self._remover.join()
            self._remover = None

    def demand(self, students: bool) -> None:
        """(I/O thread) Whether any student is connected: read ahead only then; without one, what
        was read ahead is given back."""
        with self.bounds.cond:
            changed = students != self._demand
            self._demand = students
            if changed:
                self.bounds.cond.notify_all()
            if students or not self._ready:
                return
        self._give_back_ready()

    def has_new(self) -> bool:
        """(Under bounds.lock) files written since the I/O thread last looked."""
        return bool(self._new)

    def _write(self, sample: Sample) -> Path:
        """write_sample; a full filesystem becomes one line that says what to change."""
        try:
            return write_sample(self.cfg.dir, sample)
        except Exception as err:
            if not _no_space(err):
                raise
            with self.bounds.lock:
                n = self.bounds.counters["spooled"]
            room = disk_room(self.cfg.dir)
            raise TransportError(
                f"spool.dir {self.cfg.dir} is full ({room[2] if room else 'no space left'}) after {n} "
                f"samples spooled by this teacher: {SPOOL_FULL_ADVICE}"
            ) from None

    def write(self, sample: Sample, reserved: int) -> Path:
        """(Producer thread) Write `sample` to a spool file; `reserved` bytes of spool_bytes were
        taken for it (corrected to the file's size here)."""
        try:
            path = self._write(sample)
            size = path.stat().st_size
        except BaseException:
            self.bounds.add(spool=-reserved)
            raise
        with self.bounds.lock:
            self.bounds.spool_bytes += size - reserved
            self.bounds.counters["spooled"] += 1
            self.bounds.counters["spooled_bytes"] += sample.nbytes
            self._new.append((path, size))
            self._known.add(os.path.abspath(path))
        return path

    def add_files(self, paths) -> None:
        """Replay these spool files too (e.g. written by another process); files this spooler
        already has queued, read ahead or in flight are skipped (a file is sent once)."""
        items = []
        for p in paths:
            try:
                items.append((Path(p), Path(p).stat().st_size, os.path.abspath(p)))
            except FileNotFoundError:
                continue
        with self.bounds.lock:
            for p, size, name in items:
                if name in self._known:
                    continue
                self._known.add(name)
                self.bounds.spool_bytes += size
                self._new.append((p, size))

    def _forget(self, path: Path) -> None:
        """A file no longer queued (acked, gone, set aside): `add_files` may take it again."""
        with self.bounds.lock:
            self._known.discard(os.path.abspath(path))

    def take_new(self) -> None:
        """(I/O thread) Queue the files written since the last look for replay."""
        with self.bounds.cond:
            if self._new:
                self._replay.extend(self._new)
                self._new.clear()
                self.bounds.cond.notify_all()

    def park(self, e: Entry) -> None:
        """(I/O thread) A sample waiting in memory goes (back) to the spool and is replayed later."""
        if e.spool_path is None:
            path = self._write(e.sample)
            size = path.stat().st_size
            with self.bounds.lock:
                self.bounds.counters["spooled"] += 1
                self.bounds.counters["spooled_bytes"] += e.nbytes
                self.bounds.spool_bytes += size
                self._known.add(os.path.abspath(path))
        else:
            path, size = e.spool_path, e.spool_size  # replayed from the spool: it is still there
            self.bounds.count("replayed", -1)
        with self.bounds.lock:
            self._replay.append((path, size))
        self.bounds.free(held=e.nbytes)

    def write_leftover(self, e: Entry) -> None:
        """(Close) A sample in memory that no student acked goes to the spool (never lost)."""
        if e.spool_path is None:
            self._write(e.sample)
            with self.bounds.lock:
                self.bounds.counters["spooled"] += 1
                self.bounds.counters["spooled_bytes"] += e.nbytes

    def release(self, e: Entry) -> None:
        """An acked sample: its memory is freed; its spool file (if any, unless spool.keep) is
        removed by the remover thread (unlinking an 8 MB file on tmpfs takes milliseconds, which
        the I/O thread would spend not sending), and its spool bytes freed once it is gone. A crash
        before the removal leaves the file of a delivered sample: distill-teacher removes those of
        committed keys before it serves."""
        self.bounds.free(held=e.nbytes)
        if e.spool_path is not None:
            self._forget(e.spool_path)
            if not self.cfg.keep:
                self._trash.put((e.spool_path, e.spool_size))

    def _remove(self) -> None:
        """(Remover thread) Unlink the files of acked samples until stop() sends None."""
        while (item := self._trash.get()) is not None:
            path, size = item
            try:
                remove_spool_file(path)
            except OSError as err:
                log.warning("cannot remove spool file %s of an acked sample: %s", path, err)
            self.bounds.free(spool=size)

    def load_next(self) -> Entry | None:
        """(I/O thread) The next spool file read ahead into memory, or None when none is ready."""
        with self.bounds.lock:
            return self._ready.popleft() if self._ready else None

    def _read_ahead(self) -> None:
        """(Reader threads) Read the next file while a student is connected, fewer than
        `spool.read_ahead` wait and memory allows. A file that is gone was removed since (its sample
        committed); one that cannot be read is counted and set aside (.corrupt)."""
        while True:
            with self.bounds.cond:
                while not self._stop and not self._may_read():
                    self.bounds.cond.wait(0.5)
                if self._stop:
                    return
                p, size = self._replay.popleft()
                self._reading += 1
                self.bounds.held_bytes += size  # reserved while it is read (corrected after)
            e = None
            t0 = time.monotonic()
            try:
                e = self._read(p, size)
            finally:
                with self.bounds.lock:
                    self._reading -= 1
                    self.bounds.counters["replay_read_s"] += time.monotonic() - t0
                    if e is not None:
                        self._ready.append(e)
            if e is not None and self._wake_io is not None:
                self._wake_io()

    def _may_read(self) -> bool:
        """(Under the lock) A student is connected, a file waits, fewer than `spool.read_ahead` are
        ready, and it fits in memory."""
        if not self._demand or not self._replay or len(self._ready) + self._reading >= self.cfg.read_ahead:
            return False
        return self.bounds.may_hold(self._replay[0][1])

    def _read(self, p: Path, size: int) -> Entry | None:
        """The file as an entry held in memory; `size` bytes of held_bytes were reserved for it."""
        try:
            s, slot = read_spool_into(
                p, lock=False, alloc=self.alloc, release=lambda sl: self.free_slot(sl.offset)
            )
        except FileNotFoundError:  # removed since (its sample was committed): nothing to replay
            self._forget(p)
            self.bounds.free(held=size, spool=size)
            return None
        except Exception as err:  # a corrupt file is counted and set aside for inspection
            self._forget(p)
            self.bounds.free(held=size)
            self._set_aside(p, size, err)
            return None
        e = Entry(s, s.nbytes, spool_path=p, spool_size=size)
        with self.bounds.lock:
            self.bounds.held_bytes += s.nbytes - size
            self.bounds.counters["replayed"] += 1
            if slot is not None:
                e.shm = (slot.offset, slot.offsets, slot.stamp)
                self.bounds.counters["shm_samples"] += 1
        return e

    def _give_back_ready(self) -> None:
        """Files read ahead and not sent: slots and memory freed, the files first in line again."""
        with self.bounds.lock:
            ready, self._ready = list(self._ready), collections.deque()
            self._replay.extendleft((e.spool_path, e.spool_size) for e in reversed(ready))
            self.bounds.counters["replayed"] -= len(ready)
        for e in ready:
            if e.shm is not None:
                self.free_slot(e.shm[0])
                e.shm = None
            self.bounds.free(held=e.nbytes)

    def _set_aside(self, p: Path, size: int, err: Exception) -> None:
        self.bounds.reject("spool_file")
        bad = p.with_name(p.name + ".corrupt")
        try:
            p.rename(bad)  # no longer counts as spooled: distill-teacher generates it again
        except OSError:
            bad = p
        log.error("cannot replay spool file %s (kept as %s): %s", p, bad, err)
        self.bounds.free(spool=size)

"""Teacher side of the transport: `Publisher` (ZeroMQ ROUTER, binds). The conversation is in
distill/transport.py's docstring; the contract in distill/API.md.

Where a sample is, from `submit` to the end (one owner: the I/O thread, except `submit`):

    inbox -> pending -> in flight at one student -> acked (memory freed, credit back)
                \\-> spool file (memory full / no student) -> replay -> pending ...
    acked keys wait in their student session until COMMIT (a checkpoint covers them) -> journal.
    A session that ends with acked, uncommitted keys: they are LOST (journal `!lost`, take_lost()).

The parts, each an object this I/O loop wires together: distill/student_sessions.py (`StudentSessions`:
the conversation with students, lost keys), distill/students.py (the session table, credit, what
each student holds), distill/bounds.py (`Bounds`: memory and spool limits, counters),
distill/spooler.py (spool fallback and replay), distill/ring_lane.py (`RingLane`: the shared-memory
ring's slots for same-host students, distill/shm.py), distill/sockets.py
(the socket, CURVE), distill/journal.py (committed / lost keys, the run id).
"""

from __future__ import annotations

import collections
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import zmq

from distill import protocol as P
from distill.bounds import Bounds
from distill.config import SpoolConfig, TransportConfig
from distill.errors import JournalBusy, TransportError
from distill.iothread import RateLimitedLog, Wake
from distill.journal import Journal, check_key, stored_run_id
from distill.protocol import Sample
from distill.ring_lane import RingLane
from distill.shm import RingSlot
from distill.sockets import close_router, router_socket
from distill.spool import list_spool, spool_name
from distill.spooler import Spooler
from distill.student_sessions import StudentSessions
from distill.students import Entry, FlowClock, Student

log = logging.getLogger("distill.transport")


class Publisher:
    """Teacher side of the transport. See distill/API.md for the contract."""

    def __init__(
        self,
        cfg: TransportConfig,
        spool: SpoolConfig | None = None,
        *,
        journal: str | None = None,
        journal_lock_wait_s: float = 10.0,
        auto_end: bool = True,
        replay_keys: Iterable[str] | None = None,
    ):
        self.cfg = cfg
        self.spool_cfg = spool or SpoolConfig()
        self.tid = cfg.teacher_id or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"
        self.journal_path = Path(journal) if journal else None
        self.journal_lock_wait_s = journal_lock_wait_s
        # auto_end: END once the input is closed and every sample is acked and committed. Otherwise
        # END only after `end()` (distill-teacher decides when the run is complete).
        self.auto_end = auto_end
        # The spool files `start()` replays: those of these keys (the run's), or every file in
        # spool.dir (None). Other files stay where they are (another dataset's, say).
        self.replay_keys = None if replay_keys is None else set(replay_keys)
        # Bytes in memory and spool against their limits, and the counters; its lock guards the
        # fields below too.
        self._bounds = Bounds(cfg.max_buffer_bytes, self.spool_cfg.max_bytes)
        self._lock = self._bounds.lock
        # The same-host lane (its ring is made in start()); what it holds is freed on ack.
        self._ring = RingLane(cfg, self.tid)
        self._spooler = Spooler(self.spool_cfg, self._bounds, self._replay_slot, self._ring.free)
        self._inbox: collections.deque[Entry] = collections.deque()  # submitted, not yet seen by I/O
        self._seq = 0
        self._input_closed = False
        self._end_requested = False
        self._done = threading.Event()  # END sent
        self._idle = threading.Event()  # input closed, nothing waits or is in flight
        self._stop = threading.Event()
        self._no_room_wait = threading.Event()  # stop_waiting_for_room(): submit() no longer waits
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._reject_log = RateLimitedLog(log)
        self._wake = Wake()
        self._thread: threading.Thread | None = None
        self._sock: zmq.Socket | None = None
        self._journal: Journal | None = None
        self._auth = None  # zmq.auth ThreadAuthenticator (CURVE)
        self.run_id = cfg.run_id  # resolved in start()
        # I/O-thread state
        self._pending: collections.deque[Entry] = collections.deque()  # waiting for a student
        self._sessions = StudentSessions(
            cfg,
            self.tid,
            send=self._send_frames,
            bounds=self._bounds,
            pending=self._pending,
            release=self._release,
            reject_log=self._reject_log,
        )
        self._students = self._sessions.students  # the sessions' table (dispatch reads credit)
        self._chunk = cfg.wire_chunk_bytes  # frame size for tensors sent in frames (0: whole)
        self._flow = FlowClock()  # who waited on whom (stats: flow_s, student_idle_s, no_credit_s)

    # --- public API (any thread) -------------------------------------------------------------

    def start(self) -> Publisher:
        if self.journal_path:
            # Locked while this teacher appends to it: a second teacher on the same journal, or
            # distill-reconcile rewriting it, would lose acknowledged keys.
            try:
                self._journal = Journal(self.journal_path).open(self.journal_lock_wait_s)
            except JournalBusy as e:
                raise TransportError(str(e)) from None
        # No configured id and no journal: no run identity (a restart could not keep it anyway).
        self.run_id = self.cfg.run_id or stored_run_id(self.journal_path)
        try:
            self._sock, self._auth = router_socket(self.cfg)
            self._ring.open()
        except TransportError:
            if self._sock is not None:
                self._sock.close(0)
            self._close_journal()
            raise
        self._sessions.open(run_id=self.run_id, journal=self._journal, shm=self._ring.welcome())
        # Samples left in the spool by an earlier run (or the engine phase) are replayed too.
        self.add_spool_files(self._spool_files_to_replay())
        self._thread = threading.Thread(target=self._run, name="distill-publisher", daemon=True)
        self._thread.start()
        self._spooler.start(self._wake.set)
        self._started.wait()
        return self

    def _spool_files_to_replay(self) -> list[Path]:
        """The files in spool.dir that `start()` replays: every one, or those of `replay_keys`
        (one log line says how many others were left in place)."""
        files = list_spool(self.spool_cfg.dir)
        if self.replay_keys is None:
            return files
        names = {spool_name(k) for k in self.replay_keys}
        mine = [p for p in files if p.name in names]
        other = [p.name for p in files if p.name not in names]
        if other:
            shown = ", ".join(other[:3]) + (", ..." if len(other) > 3 else "")
            log.warning(
                "spool.dir %s: %d files of keys outside this run not replayed (left in place): %s",
                self.spool_cfg.dir,
                len(other),
                shown,
            )
        return mine

    def __enter__(self) -> Publisher:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def endpoints(self) -> list[str]:
        return [self._sock.getsockopt_string(zmq.LAST_ENDPOINT)] if self._sock is not None else []

    def ring_slot(self, specs: dict[str, tuple[list[int], torch.dtype]]) -> RingSlot | None:
        """Writable tensors in one slot of the shared-memory ring, to fill and pass to `submit`.

        Filling these instead of fresh tensors saves the copy into the ring on the same-host path
        (the producer writes the sample's bytes once); students on other hosts get frames sent
        straight from the slot. Returns None when there is no ring or it has no room: use ordinary
        tensors then. A slot that is not submitted must be given back with `release_slot`.

        Args:
            specs: tensor name -> (shape, dtype), in the order the sample will hold them.
        """
        return self._ring.slot(specs)

    def ring_memory(self) -> tuple[int, int] | None:
        """(address, length) of the whole shared-memory ring with every page reserved, for a producer
        that registers it with its device (CUDA: page-locked) and copies samples straight into
        `ring_slot` tensors; None when there is no ring or its filesystem cannot hold all of it.
        Call it after `start`; the ring then takes its whole `transport.shm_bytes` at once."""
        return self._ring.memory()

    def _replay_slot(self, specs):
        """(Spool reader threads) A ring slot for a spool file being replayed: its bytes are read
        into it."""
        slot = self.ring_slot(specs)
        return None if slot is None else (dict(slot.tensors), slot)

    def release_slot(self, slot: RingSlot) -> None:
        """Give back a slot from `ring_slot` that was not submitted."""
        self._ring.free(slot.offset)

    def submit(self, sample: Sample, slot: RingSlot | None = None) -> str:
        """Hand `sample` to the transport. Waits only when memory and the spool are both full.

        Allowed after `close_input` too (keys returned by `take_lost`, generated again).

        Args:
            sample: CPU tensors; the publisher keeps them until acknowledged (do not modify them).
            slot: the ring slot from `ring_slot` whose tensors `sample.tensors` are (optional).

        Returns:
            "stream:<teacher id>:<seq>" when the sample is held in memory for a student, or the
            path of the spool file it was written to.
        """
        self.check()
        _check_sample(sample, slot)
        # The configured digest, once, on the producer's thread; carried everywhere (header, spool).
        if self.cfg.checksum == "crc32" and sample.crc is None:
            sample.crc = P.sample_crc(sample)
        elif self.cfg.checksum == "xxh3" and sample.x3 is None:
            sample.x3 = P.sample_x3(sample)
        elif (
            self.cfg.checksum == "xxh3-tree"
            and sample.x3t is None
            and sample.x3 is None
            and sample.crc is None
        ):
            sample.x3t = P.sample_x3t(sample)  # the connector's CUDA path brings it already
        nbytes = sample.nbytes
        b = self._bounds
        with b.cond:
            to_spool = b.wait_for_room(
                nbytes,
                no_students=self._no_students,
                stopped=self._stop.is_set,
                give_up=self._no_room_wait.is_set,
            )
            self._seq += 1
            sample.seq = self._seq
            sample.teacher = self.tid
            b.counters["submitted"] += 1
            self._sessions.resubmitted(sample.key)  # (its lock is taken inside the bounds' only)
            if to_spool:
                b.spool_bytes += nbytes  # reserved; corrected to the file's size
            else:
                b.held_bytes += nbytes
                e = Entry(sample, nbytes)
                if slot is not None:
                    e.shm = (slot.offset, slot.offsets, slot.stamp)
                    b.counters["shm_samples"] += 1
                self._inbox.append(e)
        if not to_spool:
            self._wake.set()
            return f"stream:{self.tid}:{sample.seq}"
        try:
            path = self._spooler.write(sample, reserved=nbytes)
        finally:
            if slot is not None:
                self.release_slot(slot)
        self._wake.set()
        return str(path)

    def _no_students(self) -> bool:
        """No student connected for transport.connect_timeout_s: new samples go to the spool."""
        return self._students.count == 0 and (
            time.monotonic() - self._students.last_seen > self.cfg.connect_timeout_s
        )

    def awaiting_students(self) -> bool:
        """No student has come yet and transport.connect_timeout_s has not passed since the start:
        samples wait in memory for the first one."""
        return self._students.joined == 0 and not self._no_students()

    def student_names(self) -> list[str]:
        """The students this Publisher serves: open sessions, and sessions that ended in silence
        whose student has neither come back nor left. A later Publisher on these endpoints
        `expect_students` them."""
        return self._sessions.names()

    def expect_students(self, names) -> None:
        """Students of an earlier Publisher on these endpoints (`student_names`): one that has
        not come when END goes out is waited for as a session that ended in silence when this was
        called (`wait_end_delivered`), and gets END when it comes."""
        self._sessions.expect(names)

    def add_spool_files(self, paths) -> None:
        """Replay these spool files to students too (e.g. written by another process). Files
        already queued (spool.dir's, which `start()` takes, or an earlier call's) are skipped: each
        is sent once."""
        self._spooler.add_files(paths)
        self._wake.set()

    def check(self) -> None:
        """Raise TransportError when the I/O thread has failed: nothing is sent, received or
        spooled any more (what it held is written to the spool by `close`)."""
        if self._error is not None:
            raise TransportError(f"publisher I/O thread failed: {self._error!r}")

    def close_input(self) -> None:
        """The producer is done: students get DRAIN once nothing waits (END per `auto_end`)."""
        with self._lock:
            self._input_closed = True
        self._wake.set()

    def end(self) -> None:
        """(auto_end=False) The run is complete: send END once nothing is waiting or in flight."""
        with self._lock:
            self._end_requested = True
        self._wake.set()

    def take_lost(self) -> list[str]:
        """Keys acked by a student session that ended before a checkpoint covered them (they are
        also in the journal as lost): generate and submit them again. With auto_end, END waits
        until each is submitted again (or committed by a student that comes back)."""
        return self._sessions.take_lost()

    def wait_done(self, timeout: float | None = None) -> bool:
        """Wait until END was sent: input closed, every sample acked and committed (auto_end), or
        `end()` called with nothing waiting or in flight."""
        return self._done.wait(timeout)

    def wait_end_delivered(
        self, min_s: float, grace_s: float, stop: Callable[[], bool] | None = None
    ) -> list[str]:
        """After END was sent (`wait_done` returned True): keep serving until END has reached the
        students. A student confirms END by leaving (BYE). Serves at least `min_s` (students of an
        earlier publisher on these endpoints come back within a few heartbeats and get END on
        arrival), then while a session is open, and while a student whose session ended in
        silence (a link down, a frozen process) within the last `grace_s` has not come back for
        END. Returns the names of the students END may not have reached (empty: it reached all);
        returns early, with them, when `stop()` says so."""
        t0 = time.monotonic()
        cap = min_s + self.cfg.heartbeat_timeout_s + grace_s  # a silent open session ends in between
        said = False
        waited: set[str] = set()  # silent students waited for (those not back at the end: missing)
        while True:
            now = time.monotonic()
            open_ = [st.name for _, st in self._students.items()]
            silent = self._sessions.silent_since(now - grace_s)
            waited.update(silent)
            waiting = set(open_) | set(silent)
            done = now - t0 >= min_s and not waiting
            if done or now - t0 >= cap or (stop is not None and stop()):
                return sorted(waiting | (waited & set(self._sessions.silent_since(float("-inf")))))
            if silent and not said:
                said = True
                log.warning(
                    "END sent; the sessions of %s ended in silence (heartbeat_timeout_s=%.0f): "
                    "waiting up to %.0fs for them to come back for END",
                    ", ".join(sorted(silent)),
                    self.cfg.heartbeat_timeout_s,
                    max(0.0, max(silent.values()) + grace_s - now),
                )
            time.sleep(0.05)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until the input is closed and every sample is acked (nothing waits, nothing in flight)."""
        return self._idle.wait(timeout)

    def close(self, linger_s: float = 1.0) -> None:
        """Stop. Samples not yet acknowledged are written to the spool (never lost)."""
        if self._thread is None:
            return
        self._stop.set()
        with self._bounds.cond:
            self._bounds.cond.notify_all()
        self._wake.set()
        self._thread.join()
        self._thread = None
        self._spooler.stop()  # files read ahead and not sent stay in the spool
        # Everything still in memory goes to the spool; spool-backed entries are already on disk.
        leftovers = list(self._inbox) + list(self._pending)
        for st in self._students.values():
            leftovers.extend(st.inflight.values())
        self._inbox.clear()
        self._pending.clear()
        unsaved, why = 0, None
        for e in leftovers:
            try:
                self._spooler.write_leftover(e)
            except TransportError as err:  # the spool's filesystem is full
                unsaved, why = unsaved + 1, err
        if unsaved:
            log.warning(
                "%d samples held in memory could not be spooled at close (%s); they are not "
                "committed, so the next run generates them again",
                unsaved,
                why,
            )
        self._ring.close()
        self._close_journal()
        close_router(self._sock, self.cfg, int(linger_s * 1000))
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self._wake.close()

    def _close_journal(self) -> None:
        if self._journal is not None:
            self._journal.close()
            self._journal = None

    def stop_waiting_for_room(self) -> None:
        """A `submit` waiting for spool room raises TransportError now, and so does every later one
        that would wait (one with room still goes through): for a producer that shuts down with the
        spool full and no student to drain it."""
        self._no_room_wait.set()
        with self._bounds.cond:
            self._bounds.cond.notify_all()

    def spool_full_wait_s(self) -> float:
        """How long a `submit` has been waiting for spool room (spool.max_bytes full while samples
        must go to the spool); 0 when none waits."""
        with self._bounds.lock:
            return self._bounds.waiting_s()

    def stats(self) -> dict:
        s = self._bounds.snapshot()
        for k in _ZERO_STATS:
            s.setdefault(k, 0)
        studs = self._students.values()
        s["sessions"] = self._students.count  # connections: a student may open several
        s["sessions_peak"] = self._students.peak  # the most at once
        s["students"] = len({st.student for st in studs})
        s["uncommitted"] = sum(len(st.uncommitted) for st in studs)
        s["inflight"] = sum(len(st.inflight) for st in studs)
        s["credit_free"] = sum(max(st.credit_samples, 0) for st in studs)  # samples it may send now
        s["pending"] = len(self._pending) + len(self._inbox)
        s["spool_files"] = len(self._spooler)
        s["read_ahead_ready"] = self._spooler.ready()
        s.update(self._flow.snapshot())
        s["teacher_id"] = self.tid
        s["run_id"] = self.run_id
        return s

    @staticmethod
    def journal_keys(path: str | os.PathLike) -> set[str]:
        """Keys committed by students in an earlier run (distill.journal.Journal.read)."""
        return Journal.read(path).committed

    # --- I/O thread --------------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake.r, zmq.POLLIN)
        self._started.set()
        interval = self.cfg.heartbeat_interval_s
        next_hb = time.monotonic() + interval
        try:
            while not self._stop.is_set():
                timeout_ms = max(0, int((next_hb - time.monotonic()) * 1000))
                events = dict(poller.poll(timeout_ms))
                if self._wake.r in events:
                    self._wake.drain()
                self._take_inbox()
                if self._sock in events:
                    self._recv_all()
                now = time.monotonic()
                if now >= next_hb:
                    self._sessions.heartbeat(now)
                    next_hb = now + interval
                self._dispatch()
                self._spool_if_abandoned()
                self._check_done()
                self._tick_flow()
        except Exception as e:  # surfaced to submit() callers; never silent
            log.exception("publisher I/O thread failed")
            self._error = e
            self._started.set()

    def _send_frames(self, ident: bytes, frames: list, copy: bool) -> None:
        """(StudentSessions' send) One non-blocking send to one student."""
        self._sock.send_multipart([ident, *frames], zmq.NOBLOCK, copy=copy)

    def _recv_all(self) -> None:
        """Every message waiting on the socket, to the sessions."""
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._sessions.on_message(frames[0].bytes, frames[1:])

    def _release(self, e: Entry) -> None:
        """An acked sample: its ring slot, memory and spool file are freed."""
        self._ring.free_entry(e)
        self._spooler.release(e)

    def _tick_flow(self) -> None:
        """(I/O thread, after dispatch) The flow clock: whether the producer may still submit (or
        spool files wait to be replayed) and whether samples wait for credit."""
        with self._lock:
            producing = not self._input_closed or bool(self._inbox) or self._spooler.has_new()
        producing = producing or self._spooler.to_replay() > 0
        waiting = bool(self._pending) or self._spooler.ready() > 0
        self._flow.tick(time.monotonic(), self._students, producing, waiting)

    def _spool_if_abandoned(self) -> None:
        """No student for connect_timeout_s: what waits in memory goes to the spool (replayed later)."""
        if not self._pending or not self._no_students():
            return
        n = 0
        while self._pending:
            e = self._pending.popleft()
            self._ring.free_entry(e)
            self._spooler.park(e)
            n += 1
        log.warning(
            "no student for %.0f s: %d samples moved from memory to the spool", self.cfg.connect_timeout_s, n
        )

    def _take_inbox(self) -> None:
        with self._lock:
            while self._inbox:
                self._pending.append(self._inbox.popleft())
        self._spooler.take_new()

    def _load_replay(self) -> bool:
        """Move the next spool file read ahead (Spooler) into pending. True if one was ready."""
        e = self._spooler.load_next()
        if e is None:
            return False
        with self._lock:
            self._seq += 1
            e.sample.seq = self._seq
        e.sample.teacher = self.tid
        self._pending.append(e)
        return True

    def _dispatch(self) -> None:
        self._spooler.demand(len(self._students) > 0)
        while True:
            if not self._pending and not (
                self._spooler.to_replay() and self._students.has_credit() and self._load_replay()
            ):
                return
            e = self._pending[0]
            st = self._students.pick(e.nbytes)
            if st is None:
                return
            self._pending.popleft()
            if not self._send_sample(st, e):
                self._pending.appendleft(e)
                return

    def _send_sample(self, st: Student, e: Entry) -> bool:
        # Usually already on the sample (submit); a replayed spool file may carry another digest.
        checksum = self.cfg.checksum
        if st.shm_ok and self._ring.active and e.shm is None:
            self._to_ring(e)
        if st.shm_ok and e.shm is not None:
            off, offsets, stamp = e.shm
            header, _ = P.sample_header(
                e.sample, checksum=checksum, shm=(str(self._ring.path), offsets, off, stamp)
            )
            frames = [P.pack(header)]
            chunked = False
        else:
            frames = P.encode_sample(e.sample, checksum=checksum, chunk=self._chunk)
            chunked = len(frames) > 1 + len(e.sample.tensors)
        if not self._sessions.send(st.ident, frames, sample=True):
            return False
        st.sent(e)
        self._idle.clear()
        with self._lock:
            self._bounds.counters["sent"] += 1
            self._bounds.counters["bytes_sent"] += e.nbytes
            self._bounds.counters["chunked"] += chunked
        return True

    def _to_ring(self, e: Entry) -> None:
        """A same-host send of a sample held in ordinary tensors: into a ring slot, or counted (and
        said once) as a send in frames when the ring has no room."""
        if self._ring.place(e):
            self._bounds.count("shm_samples")
            return
        self._bounds.count("shm_full")
        in_flight = sum(len(st.inflight) for st in self._students.values())
        self._ring.say_full(e.nbytes, in_flight, self._spooler.ready())

    def _check_done(self) -> None:
        with self._lock:
            closed = self._input_closed and not self._inbox and not self._spooler.has_new()
            end_requested = self._end_requested
        if not closed or self._pending or self._spooler.to_replay():
            self._idle.clear()
            return
        studs = self._students.items()
        for ident, st in studs:
            if not st.drain_sent:
                st.drain_sent = self._sessions.send(ident, [P.encode_control(P.DRAIN, tid=self.tid)])
        if any(st.inflight for _, st in studs):
            self._idle.clear()
            return
        self._idle.set()
        if self.auto_end:
            if any(st.uncommitted for _, st in studs):
                return  # students commit at their drain checkpoint (they got DRAIN)
            if self._sessions.lost_open():
                return  # the producer has keys to generate again (take_lost)
        elif not end_requested:
            return
        for ident, st in self._students.items():
            if not st.end_sent:
                st.end_sent = self._sessions.send(ident, [P.encode_control(P.END, tid=self.tid)])
        self._done.set()


_ZERO_STATS = (
    "submitted",
    "sent",
    "acked",
    "committed",
    "lost",
    "redelivered",
    "spooled",
    "replayed",
    "bytes_sent",
    "chunked",
    "late_acks",
    "shm_samples",
    "shm_full",
)


def _check_sample(sample: Sample, slot: RingSlot | None) -> None:
    """A valid key and contiguous CPU tensors (made contiguous here), matching the slot's names."""
    check_key(sample.key)
    tensors = {}
    for k, t in sample.tensors.items():
        if t.device.type != "cpu":
            raise ValueError(f"tensor {k!r} is on {t.device}; submit CPU tensors")
        tensors[k] = t if t.is_contiguous() else t.contiguous()
    if slot is not None and list(tensors) != list(slot.tensors):
        raise ValueError(f"sample tensors {list(tensors)} do not match the slot's {list(slot.tensors)}")
    sample.tensors = tensors

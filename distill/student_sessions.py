"""`StudentSessions`: the publisher's conversation with its students (the control records of
distill/transport.py's docstring): HELLO and the run check, CREDIT, ACK (credit back, the sample
freed), ACKED, COMMIT (journaled), BYE and heartbeat timeouts (in-flight samples redelivered, acked
but uncommitted keys journaled as lost), REFUSE and RESET.

An object of the Publisher (distill/publisher.py), driven by its I/O thread. What it is given, and
nothing else: a `send` callable (one non-blocking send of frames to one student), the journal, the
publisher's `Bounds` (counters), its `pending` queue (redelivered samples go back to its front) and
a `release` callable (an acked sample's memory, ring slot and spool file are freed). What it owns:
the table of sessions (`students`) and the keys found lost (`take_lost`).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

import zmq

from distill import protocol as P
from distill.bounds import Bounds
from distill.config import TransportConfig
from distill.errors import ProtocolError
from distill.journal import Journal
from distill.students import Entry, Student, StudentTable

log = logging.getLogger("distill.transport")

# Why a session ended without the student saying so (it may come back: a link down, a freeze).
_SILENT = ("heartbeat timeout", "unreachable")

# send(ident, frames, copy) -> None: one non-blocking send; raises zmq.Again / zmq.ZMQError.
Send = Callable[[bytes, list, bool], None]


class StudentSessions:
    """Control records from students, and the session bookkeeping they drive (I/O thread, except
    `take_lost`, `resubmitted` and `lost_open`, which any thread may call)."""

    def __init__(
        self,
        cfg: TransportConfig,
        tid: str,
        *,
        send: Send,
        bounds: Bounds,
        pending: collections.deque[Entry],
        release: Callable[[Entry], None],
        reject_log: Callable[..., None],
    ):
        self.cfg = cfg
        self.tid = tid
        self.run_id: str | None = cfg.run_id
        self.students = StudentTable()
        self._raw_send = send
        self._bounds = bounds
        self._pending = pending
        self._release = release
        self._reject_log = reject_log
        self._journal: Journal | None = None
        self._shm: list | None = None  # [ring path, nonce] offered in WELCOME, None without a ring
        self._refused: dict[bytes, float] = {}  # ident -> last REFUSE sent (rate limit)
        self._io_hinted = False  # the io_threads hint is logged once
        self._lost_lock = threading.Lock()
        self._lost: list[str] = []  # keys of sessions that ended uncommitted, not yet taken
        self._lost_open: set[str] = set()  # lost keys neither submitted again nor committed since
        # Students whose session ended in silence (heartbeat timeout, unreachable) and who have
        # not come back (HELLO) or left (BYE) since: name -> when. After END the teacher waits a
        # while for them (a link down, a frozen process): END reaches a student only in a session.
        # Kept for transport.teacher_wait_s: a student silent that long has stopped by itself.
        self._silent: dict[str, float] = {}

    def open(self, *, run_id: str | None, journal: Journal | None, shm: list | None) -> None:
        """The publisher started: its run id, its journal (commits and lost keys are appended to
        it) and the ring offered to students ([path, nonce] or None)."""
        self.run_id, self._journal, self._shm = run_id, journal, shm

    # --- any thread ------------------------------------------------------------------------------

    def take_lost(self) -> list[str]:
        """Keys lost since the last call (see Publisher.take_lost)."""
        with self._lost_lock:
            out, self._lost = self._lost, []
        return out

    def resubmitted(self, key: str) -> None:
        """`key` was submitted again: it is no longer an open loss."""
        with self._lost_lock:
            self._lost_open.discard(key)

    def lost_open(self) -> bool:
        """Whether lost keys wait to be submitted again (or committed by a student that returns)."""
        with self._lost_lock:
            return bool(self._lost_open)

    def silent_since(self, after: float) -> dict[str, float]:
        """Students whose session ended in silence after `after` (monotonic) and who have neither
        come back nor left since: name -> when the session ended."""
        with self._lost_lock:
            return {n: t for n, t in self._silent.items() if t > after}

    def names(self) -> list[str]:
        """The students of open sessions and of sessions that ended in silence (not back since)."""
        with self._lost_lock:
            self._forget_stopped(time.monotonic())
            silent = set(self._silent)
        return sorted(silent | {st.name for st in self.students.values()})

    def expect(self, names) -> None:
        """Students of an earlier publisher on these endpoints: until they come (HELLO) or leave
        (BYE), they count as students whose session ended in silence now."""
        now = time.monotonic()
        open_ = {st.name for st in self.students.values()}
        with self._lost_lock:
            for n in names:
                if n not in open_:
                    self._silent.setdefault(n, now)
            self._forget_stopped(now)

    def _forget_stopped(self, now: float) -> None:
        """(_lost_lock held) Drop the students silent for longer than transport.teacher_wait_s:
        each has given up on its teacher and stopped by itself (a long run keeps no list of them)."""
        for n in [n for n, t in self._silent.items() if now - t > self.cfg.teacher_wait_s]:
            del self._silent[n]

    # --- I/O thread ------------------------------------------------------------------------------

    def on_message(self, ident: bytes, frames: list) -> None:
        """One message from student `ident` (its frames after the identity)."""
        try:
            if len(frames) != 1:
                raise ProtocolError("frames", f"control message with {len(frames)} frames")
            header = P.decode_header(frames[0], self.cfg.max_header_bytes)
            if header["k"] == P.SAMPLE:
                raise ProtocolError("kind", "students do not send samples")
            self._handle(ident, P.decode_control(header))
        except ProtocolError as e:
            self._bounds.reject(e.reason)
            self._reject_log(e.reason, "rejected message from student %s: %s", repr(ident), e)
            if e.reason == "version":
                self._refuse(ident, f"the teacher speaks protocol version {P.PROTOCOL_VERSION}")

    def send(self, ident: bytes, frames: list, *, sample: bool = False) -> bool:
        """Send without blocking; False when it would block or the student is unreachable (then its
        session ends: what it holds is redelivered)."""
        try:
            self._raw_send(ident, frames, not sample)
            return True
        except (zmq.Again, zmq.ZMQError) as e:
            if isinstance(e, zmq.ZMQError) and e.errno == zmq.EHOSTUNREACH:
                self.drop(ident, "unreachable")
            return False

    def heartbeat(self, now: float) -> None:
        """End the sessions of students silent past heartbeat_timeout_s; a heartbeat to the others."""
        for ident, st in self.students.items():
            if now - st.last_seen > self.cfg.heartbeat_timeout_s:
                self.drop(ident, "heartbeat timeout")
            else:
                self.send(ident, [P.encode_control(P.HEARTBEAT, tid=self.tid)])

    def drop(self, ident: bytes, why: str, *, lose: bool = True) -> None:
        """End a student's session: its samples in flight go back to the front of pending; with
        `lose`, its acked and uncommitted keys are lost (journaled, to generate again)."""
        st = self.students.pop(ident)
        if st is None:
            return
        now = time.monotonic()
        with self._lost_lock:
            # Silent for half a heartbeat timeout or more: a link down or a frozen process (ZeroMQ's
            # own heartbeats close such a connection, hence "unreachable" too). A killed process's
            # connection closes at once: it is not waited for.
            if why in _SILENT and now - st.last_seen >= self.cfg.heartbeat_timeout_s / 2:
                self._silent[st.name] = now
                self._forget_stopped(now)
            else:
                self._silent.pop(st.name, None)
        back = sorted(st.inflight.values(), key=lambda e: e.sample.seq, reverse=True)
        self._pending.extendleft(back)  # descending seqs: they end up first, in order
        if back:
            self._bounds.count("redelivered", len(back))
        lost = list(st.uncommitted) if lose else []
        if lost:
            # Trained into a model state that no checkpoint covers: if that student is gone, so is
            # the training. The producer generates them again (a student that comes back skips
            # them: its job knows them).
            if self._journal is not None:
                self._journal.append_lost(lost)
            with self._lost_lock:
                self._lost.extend(lost)
                self._lost_open.update(lost)
            self._bounds.count("lost", len(lost))
        (log.warning if back or lost else log.info)(
            "student %s gone (%s): %d samples to redeliver, %d acked but not checkpointed (lost: to regenerate)",
            st.name,
            why,
            len(back),
            len(lost),
        )

    def _refuse(self, ident: bytes, reason: str) -> None:
        """Tell a peer why it gets nothing (at most every 5 s per peer)."""
        now = time.monotonic()
        if now - self._refused.get(ident, -1e9) < 5.0:
            return
        if len(self._refused) > 10_000:
            self._refused.clear()
        self._refused[ident] = now
        self.send(
            ident, [P.encode_control(P.REFUSE, tid=self.tid, reason=reason, version=P.PROTOCOL_VERSION)]
        )

    def _handle(self, ident: bytes, h: dict) -> None:
        kind = h["k"]
        st = self.students.get(ident)
        if st is not None:
            st.last_seen = time.monotonic()
        if kind == P.HELLO:
            self._hello(ident, h)
        elif kind == P.COMMIT:
            # Accepted from any peer: a student whose session we dropped (frozen, declared gone)
            # may still commit what its checkpoint covers; a later commit wins over `lost`.
            self._commit(h["keys"])
            if st is not None:
                for k in h["keys"]:
                    st.uncommitted.pop(k, None)
        elif st is None:
            if kind != P.BYE:
                self.send(ident, [P.encode_control(P.RESET, tid=self.tid)])
            elif h.get("name") is not None:
                # It left after its session here had ended (e.g. END came through a link that was
                # down while its session timed out): it is not missing.
                with self._lost_lock:
                    self._silent.pop(h["name"], None)
        elif kind == P.CREDIT:
            st.ready = True
            st.shm_ok = h["shm_ok"] and self._shm is not None
            if self._shm is not None and not st.shm_ok and self.cfg.shm == "on":
                log.warning("student %s cannot map the shared-memory ring; using frames", st.name)
        elif kind == P.ACK:
            if h["tid"] != self.tid:
                self._bounds.count("foreign_acks")  # for an earlier teacher incarnation
                return
            self._ack(st, h["seqs"], bool(h["commit"]))
        elif kind == P.ACKED:
            for k in h["keys"]:
                st.uncommitted[k] = None
        elif kind == P.BYE:
            self.drop(ident, "bye")
        elif kind != P.HEARTBEAT:
            raise ProtocolError("kind", f"students do not send kind {kind}")

    def _hello(self, ident: bytes, h: dict) -> None:
        cs, cb = h["credit_samples"], h["credit_bytes"]
        if cs <= 0 or cb <= 0:
            raise ProtocolError("field", "HELLO needs positive credit_samples and credit_bytes")
        if h["run"] is not None and self.run_id is not None and h["run"] != self.run_id:
            self._bounds.count("refused")
            self._refuse(
                ident, f"this teacher serves run {self.run_id!r}, the student belongs to run {h['run']!r}"
            )
            log.warning("refused student %s of run %r (this run: %r)", h["name"], h["run"], self.run_id)
            return
        if self.students.get(ident) is not None:  # reconnect: its in-flight samples are redelivered
            self.drop(ident, "re-hello", lose=False)
        st = Student(ident, h["name"], cs, cb)
        self.students.add(st)
        with self._lost_lock:
            self._silent.pop(st.name, None)
        self.send(ident, [P.encode_control(P.WELCOME, tid=self.tid, shm=self._shm, run=self.run_id)])
        log.info("student %s connected (%d now)", st.name, self.students.count)
        sessions = self.students.count
        if self.cfg.curve is not None and sessions > self.cfg.io_threads and not self._io_hinted:
            self._io_hinted = True
            log.info(
                "%d student sessions share transport.io_threads=%d with CURVE on: each connection is"
                " encrypted by one I/O thread (about 0.8 GB/s a core); set transport.io_threads up to"
                " the sessions (students x transport.connections) as this host's cores allow",
                sessions,
                self.cfg.io_threads,
            )

    def _commit(self, keys: list[str]) -> None:
        if self._journal is not None:
            self._journal.append_committed(keys)
        self._bounds.count("committed", len(keys))
        with self._lost_lock:
            self._lost_open.difference_update(keys)

    def _ack(self, st: Student, seqs: list[int], commit: bool) -> None:
        keys = []
        for seq in seqs:
            e = st.acked(seq)
            if e is None:
                e = self._late_ack(seq)
                if e is None:
                    continue
            self._release(e)
            keys.append(e.sample.key)
        if keys:
            self._bounds.count("acked", len(keys))
            if commit:
                self._commit(keys)
            else:
                st.uncommitted.update(dict.fromkeys(keys))

    def _late_ack(self, seq: int) -> Entry | None:
        """A late ack for a sample of this student's earlier session (it said HELLO again): if the
        sample waits for redelivery, take it out (it is consumed); if another student holds it now,
        ignore (that student skips it, its job knows the key)."""
        self._bounds.count("late_acks")
        for i, pe in enumerate(self._pending):
            if pe.sample.seq == seq:
                del self._pending[i]
                return pe
        return None

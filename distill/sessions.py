"""The publisher's conversation with its students (the control records of distill/transport.py's
docstring): HELLO and the run check, CREDIT, ACK (credit back, the sample freed), ACKED, COMMIT
(journaled), BYE and heartbeat timeouts (in-flight samples redelivered, acked but uncommitted keys
journaled as lost), REFUSE and RESET. Runs on the Publisher's I/O thread.

`StudentSessions` is a part of `distill.publisher.Publisher` (a mixin: it uses the Publisher's
socket `_sock`, `_students` table, `_pending` queue, `_budget`, `_spooler`, `_journal`, `_lock`,
`_lost` / `_lost_open` and `_free_ring_slot`); it exists so that each file keeps one job.
"""

from __future__ import annotations

import logging
import time

import zmq

from distill import protocol as P
from distill.protocol import ProtocolError
from distill.students import Entry, Student

log = logging.getLogger("distill.transport")


class StudentSessions:
    """Control records from students, and the session bookkeeping they drive."""

    def _reject(self, who: str, e: ProtocolError) -> None:
        self._budget.reject(e.reason)
        self._reject_log(e.reason, "rejected message from student %s: %s", who, e)

    def _recv_all(self) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            ident = frames[0].bytes
            try:
                if len(frames) != 2:
                    raise ProtocolError("frames", f"control message with {len(frames) - 1} frames")
                header = P.decode_header(frames[1], self.cfg.max_header_bytes)
                if header["k"] == P.SAMPLE:
                    raise ProtocolError("kind", "students do not send samples")
                self._handle(ident, P.decode_control(header))
            except ProtocolError as e:
                self._reject(repr(ident), e)
                if e.reason == "version":
                    self._refuse(ident, f"the teacher speaks protocol version {P.PROTOCOL_VERSION}")

    def _refuse(self, ident: bytes, reason: str) -> None:
        """Tell a peer why it gets nothing (at most every 5 s per peer)."""
        now = time.monotonic()
        if now - self._refused.get(ident, -1e9) < 5.0:
            return
        if len(self._refused) > 10_000:
            self._refused.clear()
        self._refused[ident] = now
        self._send(
            ident, [P.encode_control(P.REFUSE, tid=self.tid, reason=reason, version=P.PROTOCOL_VERSION)]
        )

    def _send(self, ident: bytes, frames: list, *, sample: bool = False) -> bool:
        try:
            self._sock.send_multipart([ident, *frames], zmq.NOBLOCK, copy=not sample)
            return True
        except (zmq.Again, zmq.ZMQError) as e:
            if isinstance(e, zmq.ZMQError) and e.errno == zmq.EHOSTUNREACH:
                self._drop_student(ident, "unreachable")
            return False

    def _handle(self, ident: bytes, h: dict) -> None:
        kind = h["k"]
        st = self._students.get(ident)
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
                self._send(ident, [P.encode_control(P.RESET, tid=self.tid)])
        elif kind == P.CREDIT:
            st.ready = True
            st.shm_ok = h["shm_ok"] and self._ring is not None
            if self._ring is not None and not st.shm_ok and self.cfg.shm == "on":
                log.warning("student %s cannot map the shared-memory ring; using frames", st.name)
        elif kind == P.ACK:
            if h["tid"] != self.tid:
                self._budget.count("foreign_acks")  # for an earlier teacher incarnation
                return
            self._ack(st, h["seqs"], bool(h["commit"]))
        elif kind == P.ACKED:
            for k in h["keys"]:
                st.uncommitted[k] = None
        elif kind == P.BYE:
            self._drop_student(ident, "bye")
        elif kind != P.HEARTBEAT:
            raise ProtocolError("kind", f"students do not send kind {kind}")

    def _hello(self, ident: bytes, h: dict) -> None:
        cs, cb = h["credit_samples"], h["credit_bytes"]
        if cs <= 0 or cb <= 0:
            raise ProtocolError("field", "HELLO needs positive credit_samples and credit_bytes")
        if h["run"] is not None and self.run_id is not None and h["run"] != self.run_id:
            self._budget.count("refused")
            self._refuse(
                ident, f"this teacher serves run {self.run_id!r}, the student belongs to run {h['run']!r}"
            )
            log.warning("refused student %s of run %r (this run: %r)", h["name"], h["run"], self.run_id)
            return
        if self._students.get(ident) is not None:  # reconnect: its in-flight samples are redelivered
            self._drop_student(ident, "re-hello", lose=False)
        st = Student(ident, h["name"], cs, cb)
        self._students.add(st)
        shm = [str(self._ring.path), self._ring.nonce] if self._ring is not None else None
        self._send(ident, [P.encode_control(P.WELCOME, tid=self.tid, shm=shm, run=self.run_id)])
        log.info("student %s connected (%d now)", st.name, self._students.count)

    def _commit(self, keys: list[str]) -> None:
        if self._journal is not None:
            self._journal.append_committed(keys)
        with self._lock:
            self._budget.counters["committed"] += len(keys)
            self._lost_open.difference_update(keys)

    def _ack(self, st: Student, seqs: list[int], commit: bool) -> None:
        keys = []
        for seq in seqs:
            e = st.acked(seq)
            if e is None:
                e = self._late_ack(seq)
                if e is None:
                    continue
            self._free_ring_slot(e)
            self._spooler.release(e)
            keys.append(e.sample.key)
        if keys:
            self._budget.count("acked", len(keys))
            if commit:
                self._commit(keys)
            else:
                st.uncommitted.update(dict.fromkeys(keys))

    def _late_ack(self, seq: int) -> Entry | None:
        """A late ack for a sample of this student's earlier session (it said HELLO again): if the
        sample waits for redelivery, take it out (it is consumed); if another student holds it now,
        ignore (that student skips it, its job knows the key)."""
        self._budget.count("late_acks")
        for i, pe in enumerate(self._pending):
            if pe.sample.seq == seq:
                del self._pending[i]
                return pe
        return None

    def _drop_student(self, ident: bytes, why: str, *, lose: bool = True) -> None:
        st = self._students.pop(ident)
        if st is None:
            return
        back = sorted(st.inflight.values(), key=lambda e: e.sample.seq, reverse=True)
        self._pending.extendleft(back)  # descending seqs: they end up first, in order
        if back:
            self._budget.count("redelivered", len(back))
        lost = list(st.uncommitted) if lose else []
        if lost:
            # Trained into a model state that no checkpoint covers: if that student is gone, so is
            # the training. The producer generates them again (a student that comes back skips
            # them: its job knows them).
            if self._journal is not None:
                self._journal.append_lost(lost)
            with self._lock:
                self._lost.extend(lost)
                self._lost_open.update(lost)
                self._budget.counters["lost"] += len(lost)
        (log.warning if back or lost else log.info)(
            "student %s gone (%s): %d samples to redeliver, %d acked but not checkpointed (lost: to regenerate)",
            st.name,
            why,
            len(back),
            len(lost),
        )

    def _heartbeat(self, now: float) -> None:
        for ident, st in self._students.items():
            if now - st.last_seen > self.cfg.heartbeat_timeout_s:
                self._drop_student(ident, "heartbeat timeout")
            else:
                self._send(ident, [P.encode_control(P.HEARTBEAT, tid=self.tid)])

"""The student's view of each teacher endpoint (`TeacherLink`) and what the Subscriber's I/O thread does
with what a teacher sends: samples (held, redelivered copies, duplicates), the WELCOME that opens a
session, the controls only the session's teacher may send, and the keepalive that notices a silent
teacher. A mixin of `distill.subscriber.Subscriber`, whose fields it uses: cfg, run_id, _shm,
_lock, _held, _skip, _consumed, _q, _counters, _teachers, _by_tid, _error, commit_on_ack,
_uncommitted, and its methods _send, _hello, _send_commits.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field

import zmq

from distill import protocol as P
from distill.iothread import TeacherGone, TransportError
from distill.protocol import ProtocolError

log = logging.getLogger("distill.transport")

_SILENT_LOG_EVERY_S = 10.0
END_MARK = object()  # queued once every teacher has sent END


@dataclass
class TeacherLink:
    endpoint: str
    sock: zmq.Socket
    tid: str | None = None
    ring: str | None = None  # the shared-memory ring of the current session
    welcomed: bool = False
    hello_pending: bool = False  # a HELLO went out and no WELCOME came yet
    hellos_out: int = 0  # HELLOs not answered yet (a keepalive HELLO and a RESET's may overlap)
    draining: bool = False
    ended: bool = False
    last_seen: float = field(default_factory=time.monotonic)
    last_hello: float = 0.0
    silent_logged: float = 0.0
    ever_welcomed: bool = False  # a valid WELCOME came once: this teacher speaks our version
    version_errors: int = 0  # messages in a row that carried another protocol version
    uncommitted: dict[str, None] = field(default_factory=dict)  # acked here, no checkpoint yet
    commit_out: list[str] = field(default_factory=list)  # committed, not yet told this endpoint
    # Messages that must arrive (ACK, COMMIT, CREDIT, ACKED) and could not be sent without
    # blocking: sent first, in order, on the next turns of the I/O loop. (kind, bytes)
    outbox: collections.deque = field(default_factory=collections.deque)


class TeacherSessions:
    """Handlers of the Subscriber's I/O thread (see the module docstring)."""

    def _keepalive(self, t: TeacherLink, now: float) -> None:
        """Heartbeat; notice a silent teacher, say so, look for a restarted one, give up in the end."""
        silent = now - t.last_seen
        if silent > self.cfg.heartbeat_timeout_s:
            if t.welcomed:
                t.welcomed = False  # samples from it stop; HELLO again below
                log.warning(
                    "teacher %s silent for %.0f s (heartbeat_timeout_s=%.0f); waiting for it up to "
                    "transport.teacher_wait_s=%.0f s",
                    t.endpoint,
                    silent,
                    self.cfg.heartbeat_timeout_s,
                    self.cfg.teacher_wait_s,
                )
                t.silent_logged = now
            elif now - t.silent_logged >= _SILENT_LOG_EVERY_S:
                t.silent_logged = now
                log.warning(
                    "no word from teacher %s for %.0f s; %d samples trained here so far; waiting up to %.0f s",
                    t.endpoint,
                    silent,
                    self._counters["acked"],
                    self.cfg.teacher_wait_s,
                )
            if silent > self.cfg.teacher_wait_s and self._error is None:
                self._error = TeacherGone(
                    f"no word from teacher {t.endpoint} for {silent:.0f} s (transport.teacher_wait_s)"
                )
        if not t.welcomed and now - t.last_hello > self.cfg.heartbeat_timeout_s:
            self._hello(t)  # the teacher may have restarted or not be up yet
        self._send(t, P.HEARTBEAT, P.encode_control(P.HEARTBEAT, name=self.name))

    def _on_sample(self, t: TeacherLink, h: dict, frames: list) -> None:
        if not t.welcomed:
            raise ProtocolError("kind", "sample before WELCOME")
        if h.get("tid") != t.tid:
            raise ProtocolError("foreign", f"sample of teacher {h.get('tid')!r}, talking to {t.tid!r}")
        s = P.decode_sample(h, frames, self._shm.resolve)
        t.last_seen = time.monotonic()
        t.draining = False
        self._counters["received"] += 1
        self._counters["bytes_received"] += s.nbytes
        if "shm" in h:
            self._counters["shm_samples"] += 1
        with self._lock:
            if s.key in self._held:
                # A redelivered copy of a sample the consumer holds: acked together with it
                # (never on its behalf while it is held), or handed over if it is discarded.
                self._held[s.key].append(s)
                self._counters["held_copies"] += 1
                return
            ledger = s.key in self._skip
            dup = ledger or s.key in self._consumed
            if not dup:
                self._held[s.key] = []
        if dup:
            # Already trained (ledger: a checkpoint covers it, so it is committed too) or
            # consumed here: ack this copy at once, never train a sample twice.
            self._counters["skipped_duplicates"] += 1
            commit = ledger or self.commit_on_ack
            if not commit:
                t.uncommitted[s.key] = None
                with self._lock:
                    self._uncommitted += 1  # the next commit() covers this ack too
            self._send(t, P.ACK, P.encode_control(P.ACK, tid=s.teacher, seqs=[s.seq], commit=commit))
            return
        self._q.put(s)

    def _on_welcome(self, t: TeacherLink, h: dict) -> None:
        if not t.hello_pending:
            if t.hellos_out > 0 and h["tid"] == t.tid:
                # The answer to an earlier HELLO of this session (two HELLOs crossed, e.g. a
                # keepalive one and a RESET's): the first answer already set the session up.
                t.hellos_out -= 1
                self._counters["extra_welcomes"] += 1
                return
            raise ProtocolError("foreign", "WELCOME without a HELLO")
        t.hellos_out = max(0, t.hellos_out - 1)
        t.last_seen = time.monotonic()
        if h["run"] is not None and self.run_id is not None and h["run"] != self.run_id:
            self._error = TransportError(
                f"teacher at {t.endpoint} serves run {h['run']!r}; this student belongs to run "
                f"{self.run_id!r} (a student of another run: start it with the run file of this run)"
            )
            return
        if self.run_id is None:
            self.run_id = h["run"]
        tid = h["tid"]
        t.tid = tid
        self._by_tid[tid] = t
        shm_ok = False
        shm = h["shm"]
        if self.cfg.shm != "off" and shm is not None:
            shm_ok = self._shm.attach(shm[0], shm[1])
        t.ring = shm[0] if shm_ok else None
        if self.cfg.shm == "on" and not shm_ok:
            self._error = TransportError(
                f"transport.shm is 'on' but the ring of teacher {t.endpoint} cannot be mapped"
            )
        t.welcomed = t.ever_welcomed = True
        t.hello_pending = False
        t.draining = t.ended = False
        self._send(t, P.CREDIT, P.encode_control(P.CREDIT, shm_ok=shm_ok))
        # A new session (perhaps a restarted teacher): what this side acked and no checkpoint
        # covers yet belongs to this session now; what was committed meanwhile is told.
        keys = list(t.uncommitted)
        for i in range(0, len(keys), P.MAX_KEYS_PER_MESSAGE):
            self._send(t, P.ACKED, P.encode_control(P.ACKED, keys=keys[i : i + P.MAX_KEYS_PER_MESSAGE]))
        self._send_commits(t)

    def _on_session_control(self, t: TeacherLink, kind: int, h: dict) -> None:
        """HEARTBEAT / DRAIN / END: accepted only from the teacher of this session."""
        if t.tid is None or h.get("tid", t.tid) != t.tid:
            raise ProtocolError(
                "foreign", f"{P.KIND_NAMES[kind]} from teacher {h.get('tid')!r}, talking to {t.tid!r}"
            )
        t.last_seen = time.monotonic()
        if kind == P.HEARTBEAT:
            pass
        elif kind == P.DRAIN:
            t.draining = True
        elif kind == P.END:
            t.ended = True
            if all(x.ended for x in self._teachers):
                self._q.put(END_MARK)
        else:
            raise ProtocolError("kind", f"teachers do not send kind {kind}")

"""`TeacherSessions`: a student's Subscriber's side of the conversation with its teachers (the
control records of distill/transport.py's docstring), one `TeacherLink` per teacher endpoint:
HELLO, WELCOME and the run check, CREDIT, samples (to `Deliveries`: held, redelivered copies,
duplicates acked at once), ACK and COMMIT (the consumer's, batched), ACKED after a new session,
HEARTBEAT and the keepalive that notices a silent teacher, DRAIN, END, REFUSE, RESET, BYE.

An object of the Subscriber (distill/subscriber.py), driven by its I/O thread. What it is given:
the transport config, the student's name, the `Deliveries` it hands samples to and takes acks
from, the counters, and the shared-memory reader. What it owns: the links (one DEALER socket each,
`connect`), the run id learned from the first WELCOME, and `error`: a condition this side cannot
fix (TeacherGone, another protocol version, a refusal), raised to the consumer by the Subscriber.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field

import zmq

from distill import protocol as P
from distill.config import TransportConfig
from distill.deliveries import COMMIT, DUPLICATE, DUPLICATE_COMMITTED, Deliveries
from distill.errors import ProtocolError, TeacherGone, TransportError
from distill.iothread import RateLimitedLog
from distill.shm import ShmReader

log = logging.getLogger("distill.transport")

_SILENT_LOG_EVERY_S = 10.0
_VERSION_ERRORS_FATAL = 10  # that many in a row from a known teacher: it was replaced by another version


@dataclass
class TeacherLink:
    endpoint: str
    sock: zmq.Socket
    name: str  # the student's name in this session's HELLO (`lane_name`)
    lane: int = 0  # which of the student's `connections` to this endpoint
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
    """The links to every teacher endpoint and what the I/O thread does on each (module docstring)."""

    def __init__(
        self,
        cfg: TransportConfig,
        name: str,
        *,
        deliveries: Deliveries,
        counters: collections.Counter,
        shm: ShmReader,
    ):
        self.cfg = cfg
        self.name = name
        self.run_id: str | None = cfg.run_id  # learned from the first WELCOME when not configured
        self.links: list[TeacherLink] = []
        self.error: TransportError | None = None  # raised to the consumer by Subscriber.get
        self.rejected: collections.Counter = collections.Counter()  # by reason
        self._deliveries = deliveries
        self._counters = counters
        self._shm = shm
        self._by_tid: dict[str, TeacherLink] = {}  # every tid seen -> its endpoint (kept after restarts)
        self._reject_log = RateLimitedLog(log)

    def connect(self, endpoint: str, sock: zmq.Socket, lane: int = 0) -> TeacherLink:
        t = TeacherLink(endpoint, sock, P.lane_name(self.name, lane), lane)
        self.links.append(t)
        return t

    @staticmethod
    def _key(t: TeacherLink, tid: str) -> str:
        """Where acks for a sample of teacher `tid` that came on `t` go (`Sample.via`, `_by_tid`)."""
        return tid if t.lane == 0 else f"{tid}#{t.lane}"

    # --- read by any thread ----------------------------------------------------------------------

    @property
    def draining(self) -> bool:
        return all(t.draining or t.ended for t in self.links)

    def silent_s(self) -> float:
        """Seconds since the longest-silent live teacher was heard (0 while all are heard)."""
        now = time.monotonic()
        worst = max((now - t.last_seen for t in self.links if not t.ended), default=0.0)
        return worst if worst > self.cfg.heartbeat_timeout_s else 0.0

    # --- I/O thread ------------------------------------------------------------------------------

    def send(self, t: TeacherLink, kind: int, msg: bytes) -> None:
        """Never block the I/O thread (a peer that is not connected, e.g. a CURVE handshake that
        fails, makes a blocking send wait forever). HELLO/HEARTBEAT/BYE are dropped when they would
        block; the others wait in the outbox, in order."""
        must = kind in (P.ACK, P.COMMIT, P.CREDIT, P.ACKED)
        if must and t.outbox:
            t.outbox.append((kind, msg))
            return
        try:
            t.sock.send(msg, zmq.NOBLOCK)
        except zmq.Again:
            if must:
                t.outbox.append((kind, msg))
            else:
                self._counters["dropped_control"] += 1

    def flush_outbox(self, t: TeacherLink) -> None:
        while t.outbox:
            try:
                t.sock.send(t.outbox[0][1], zmq.NOBLOCK)
            except zmq.Again:
                return
            t.outbox.popleft()

    def hello(self, t: TeacherLink) -> None:
        t.welcomed = False
        t.hello_pending = True
        t.hellos_out += 1
        t.last_hello = time.monotonic()
        # What belonged to the old session's handshake is void; ACKs and COMMITs still go out.
        t.outbox = collections.deque(x for x in t.outbox if x[0] not in (P.CREDIT, P.ACKED))
        self.send(
            t,
            P.HELLO,
            P.encode_control(
                P.HELLO,
                name=t.name,
                credit_samples=self.cfg.connection_credit[0],
                credit_bytes=self.cfg.connection_credit[1],
                run=self.run_id,
            ),
        )

    def bye(self) -> None:
        """The student leaves: what must go out goes, then BYE to every teacher still running (one
        that sent END got its BYE then)."""
        for t in self.links:
            if not t.ended:
                self.flush_outbox(t)
                self.send(t, P.BYE, P.encode_control(P.BYE, name=t.name))

    def send_acks(self) -> None:
        """The consumer's acks (batched per teacher) and commits, in the order it made them."""
        ops = self._deliveries.take_acks()
        if not ops:
            return
        batch: dict[tuple[str, bool], list[int]] = collections.defaultdict(list)
        for op in ops:
            if op is COMMIT:
                self._flush_acks(batch)
                batch.clear()
                for t in self.links:
                    t.commit_out.extend(t.uncommitted)
                    t.uncommitted.clear()
                    self._send_commits(t)
                continue
            via, seq, key, commit = op  # via: the link key (`_key`)
            t = self._by_tid.get(via)
            if t is None:
                continue
            if not commit:
                t.uncommitted[key] = None
            if t.tid is not None and self._key(t, t.tid) == via and t.welcomed:
                batch[(via, commit)].append(seq)
            # else: that teacher incarnation is gone; its successor replays the sample and this
            # side acks that copy as a duplicate.
        self._flush_acks(batch)

    def _flush_acks(self, batch: dict[tuple[str, bool], list[int]]) -> None:
        for (via, commit), seqs in batch.items():
            t = self._by_tid[via]
            self.send(t, P.ACK, P.encode_control(P.ACK, tid=t.tid, seqs=seqs, commit=commit))

    def _send_commits(self, t: TeacherLink) -> None:
        if not t.welcomed or not t.commit_out:
            return
        keys, t.commit_out = t.commit_out, []
        for i in range(0, len(keys), P.MAX_KEYS_PER_MESSAGE):
            self.send(t, P.COMMIT, P.encode_control(P.COMMIT, keys=keys[i : i + P.MAX_KEYS_PER_MESSAGE]))
        self._counters["committed"] += len(keys)

    def recv_all(self, t: TeacherLink) -> None:
        """Every message waiting on this link's socket."""
        while True:
            try:
                frames = t.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                header = P.decode_header(frames[0], self.cfg.max_header_bytes)
                t.version_errors = 0
                self._handle(t, header, frames[1:])
            except ProtocolError as e:
                self.rejected[e.reason] += 1
                if e.reason == "version":
                    t.version_errors += 1
                if e.reason == "checksum" and t.welcomed:
                    # A sample whose bytes are not what the teacher sent: never used, never acked.
                    # A new session makes the teacher send what this session holds again.
                    self.hello(t)
                # A teacher that never spoke our version (or stopped: restarted with another
                # release) is fatal and said so. One such message from a teacher that speaks ours
                # is a damaged frame: counted and dropped like any other.
                if e.reason == "version" and (
                    not t.ever_welcomed or t.version_errors >= _VERSION_ERRORS_FATAL
                ):
                    self.error = TransportError(
                        f"teacher at {t.endpoint} speaks another protocol version ({e}); "
                        "install the same distill-stream version on teacher and students"
                    )
                self._reject_log(e.reason, "rejected message from teacher %s: %s", t.endpoint, e)

    def _handle(self, t: TeacherLink, h: dict, frames: list) -> None:
        kind = h["k"]
        if kind == P.SAMPLE:
            self._on_sample(t, h, frames)
            return
        h = P.decode_control(h)
        if kind == P.WELCOME:
            self._on_welcome(t, h)
        elif kind == P.REFUSE:
            versions = (
                f" (teacher protocol version {h['version']}, ours {P.PROTOCOL_VERSION})"
                if h["version"] != P.PROTOCOL_VERSION
                else ""
            )
            self.error = TransportError(
                f"teacher at {t.endpoint} refused this student: {h['reason']}{versions}"
            )
        elif kind == P.RESET:
            t.last_seen = time.monotonic()
            if not t.ended:  # after END (and BYE) there is no session to start again
                self.hello(t)  # the teacher (perhaps a new incarnation) does not know this session
        else:
            self._on_session_control(t, kind, h)

    def keepalive(self, t: TeacherLink, now: float) -> None:
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
            if silent > self.cfg.teacher_wait_s and self.error is None:
                self.error = TeacherGone(
                    f"no word from teacher {t.endpoint} for {silent:.0f} s (transport.teacher_wait_s)"
                )
        if not t.welcomed and now - t.last_hello > self.cfg.heartbeat_timeout_s:
            self.hello(t)  # the teacher may have restarted or not be up yet
        self.send(t, P.HEARTBEAT, P.encode_control(P.HEARTBEAT, name=t.name))

    def _on_sample(self, t: TeacherLink, h: dict, frames: list) -> None:
        if not t.welcomed:
            raise ProtocolError("kind", "sample before WELCOME")
        if h.get("tid") != t.tid:
            raise ProtocolError("foreign", f"sample of teacher {h.get('tid')!r}, talking to {t.tid!r}")
        s = P.decode_sample(h, frames, self._shm.resolve)
        if t.lane:
            s.via = self._key(t, t.tid)
        t.last_seen = time.monotonic()
        t.draining = False
        self._counters["received"] += 1
        self._counters["bytes_received"] += s.nbytes
        if "shm" in h:
            self._counters["shm_samples"] += 1
        fate = self._deliveries.offer(s)
        if fate not in (DUPLICATE, DUPLICATE_COMMITTED):
            return  # NEW: queued for the consumer; COPY: waits beside the held one
        # Already trained (ledger: a checkpoint covers it, so it is committed too) or consumed
        # here: ack this copy at once, never train a sample twice.
        commit = fate == DUPLICATE_COMMITTED or self._deliveries.commit_on_ack
        if not commit:
            t.uncommitted[s.key] = None  # the next commit() covers this ack too
        self.send(t, P.ACK, P.encode_control(P.ACK, tid=s.teacher, seqs=[s.seq], commit=commit))

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
            self.error = TransportError(
                f"teacher at {t.endpoint} serves run {h['run']!r}; this student belongs to run "
                f"{self.run_id!r} (a student of another run: start it with the run file of this run)"
            )
            return
        if self.run_id is None:
            self.run_id = h["run"]
        tid = h["tid"]
        t.tid = tid
        self._by_tid[self._key(t, tid)] = t
        shm_ok = False
        shm = h["shm"]
        if self.cfg.shm != "off" and shm is not None:
            shm_ok = self._shm.attach(shm[0], shm[1])
        t.ring = shm[0] if shm_ok else None
        if self.cfg.shm == "on" and not shm_ok:
            self.error = TransportError(
                f"transport.shm is 'on' but the ring of teacher {t.endpoint} cannot be mapped"
            )
        t.welcomed = t.ever_welcomed = True
        t.hello_pending = False
        t.draining = t.ended = False
        self.send(t, P.CREDIT, P.encode_control(P.CREDIT, shm_ok=shm_ok))
        # A new session (perhaps a restarted teacher): what this side acked and no checkpoint
        # covers yet belongs to this session now; what was committed meanwhile is told.
        keys = list(t.uncommitted)
        for i in range(0, len(keys), P.MAX_KEYS_PER_MESSAGE):
            self.send(t, P.ACKED, P.encode_control(P.ACKED, keys=keys[i : i + P.MAX_KEYS_PER_MESSAGE]))
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
            if not t.ended:
                # BYE tells the teacher that END arrived: it serves until every student has left.
                self.flush_outbox(t)
                self.send(t, P.BYE, P.encode_control(P.BYE, name=t.name))
            t.ended = True
            if all(x.ended for x in self.links):
                self._deliveries.end()
        else:
            raise ProtocolError("kind", f"teachers do not send kind {kind}")

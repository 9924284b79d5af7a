"""Student side of the transport: `Subscriber` (ZeroMQ DEALER, one per teacher endpoint,
connects). The conversation is in distill/transport.py's docstring; the contract in distill/API.md.

A received sample is HELD (handed to the consumer) until the consumer acks it (after the optimizer
step that used it) or discards it (its shared-memory slot was reused: the student was frozen past
the heartbeat timeout). A redelivered copy of a held key is never acknowledged on the held copy's
behalf: it waits beside it and is acked with it, or takes its place if the held copy is discarded.
Acked keys stay UNCOMMITTED (per teacher endpoint) until `commit()` (a checkpoint covers them),
unless commit_on_ack.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Iterable, Iterator

import zmq

from distill import protocol as P
from distill.config import TransportConfig
from distill.fp8 import dequantize_sample
from distill.iothread import RateLimitedLog, TransportError, Wake, tune_malloc
from distill.protocol import ProtocolError, Sample
from distill.security import dealer_socket
from distill.shm import ShmReader
from distill.subscriber_sessions import END_MARK, TeacherLink, TeacherSessions

log = logging.getLogger("distill.transport")

_VERSION_ERRORS_FATAL = 10  # that many in a row from a known teacher: it was replaced by another version
_COMMIT = object()


class Subscriber(TeacherSessions):
    """Student side of the transport. See distill/API.md for the contract."""

    def __init__(
        self,
        cfg: TransportConfig,
        *,
        skip_keys=None,
        name: str | None = None,
        commit_on_ack: bool = True,
        dequantize: bool = True,
    ):
        self.cfg = cfg
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self.commit_on_ack = commit_on_ack
        # fp8 samples (teacher.hidden_dtype: fp8): `get` hands back the model dtype; False keeps
        # float8 values + `hidden_scale` for a consumer that dequantizes on its GPU (the student).
        self.dequantize = dequantize
        self._skip = skip_keys if skip_keys is not None else set()
        # keys acked in this process, oldest first, at most cfg.dedup_keys
        self._consumed: collections.OrderedDict[str, None] = collections.OrderedDict()
        # keys handed to the consumer and not yet acked -> redelivered copies waiting beside them
        self._held: dict[str, list[Sample]] = {}
        self._q: queue.Queue = queue.Queue()
        self._acks: collections.deque = collections.deque()  # (tid, seq, key, commit) | _COMMIT
        self._uncommitted = 0
        self._lock = threading.Lock()
        self._wake = Wake()
        self._stop = threading.Event()
        self._started = threading.Event()
        self._shm = ShmReader()
        self._teachers: list[TeacherLink] = []
        self._by_tid: dict[str, TeacherLink] = {}  # every tid seen -> its endpoint (kept after restarts)
        self._counters = collections.Counter()
        self._rejected = collections.Counter()
        self._reject_log = RateLimitedLog(log)
        self._error: TransportError | None = None
        self.run_id = cfg.run_id  # learned from the first WELCOME when not configured
        self._finished = False
        self._thread: threading.Thread | None = None

    def start(self) -> Subscriber:
        if self.cfg.tune_malloc:
            tune_malloc()
        for ep in self.cfg.connect:
            sock = dealer_socket(self.cfg, self.name, ep)
            self._teachers.append(TeacherLink(ep, sock))
        self._thread = threading.Thread(target=self._run, name="distill-subscriber", daemon=True)
        self._thread.start()
        self._started.wait()
        return self

    def __enter__(self) -> Subscriber:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def __iter__(self) -> Iterator[Sample]:
        while True:
            s = self.get(timeout=None)
            if s is None:
                return
            yield s

    def get(self, timeout: float | None = None) -> Sample | None:
        """Next sample; None on timeout, or once every teacher has sent END (then `finished`).

        Raises:
            TeacherGone: no teacher was heard for transport.teacher_wait_s.
            TransportError: a condition this side cannot fix (another protocol version, a refusal).
        """
        if self._finished:
            return None
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._error is not None:
                raise self._error
            wait = 0.2 if deadline is None else max(0.0, min(0.2, deadline - time.monotonic()))
            try:
                item = self._q.get(timeout=wait)
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                continue
            if item is END_MARK:
                self._finished = True
                return None
            return dequantize_sample(item) if self.dequantize else item  # fp8 -> the model dtype

    def ack(self, samples: Sample | Iterable[Sample]) -> None:
        """Acknowledge consumed samples (after the optimizer step that used them): the teacher frees
        them and credit returns. Their tensors (zero-copy views) must not be used afterwards."""
        if isinstance(samples, Sample):
            samples = [samples]
        with self._lock:
            for s in samples:
                self._consumed[s.key] = None
                copies = [s, *self._held.pop(s.key, [])]
                for c in copies:
                    self._acks.append((c.teacher, c.seq, c.key, self.commit_on_ack))
                self._counters["acked"] += 1
                if not self.commit_on_ack:
                    self._uncommitted += 1
            while len(self._consumed) > self.cfg.dedup_keys:
                self._consumed.popitem(last=False)
        self._wake.set()

    def commit(self) -> None:
        """Everything acked so far is covered by a saved checkpoint: the teachers journal it."""
        with self._lock:
            self._acks.append(_COMMIT)
            self._uncommitted = 0
        self._wake.set()

    @property
    def uncommitted(self) -> int:
        """Samples acked since the last `commit()` (0 with commit_on_ack)."""
        return self._uncommitted

    def valid(self, sample: Sample) -> bool:
        """True if the bytes read from `sample` so far were its own. Call it after copying them: a
        shared-memory slot is reused once the teacher declared this student gone."""
        if sample.stamp is None:
            return True
        seg, off, stamp = sample.stamp
        ok = self._shm.stamp(seg, off) == stamp
        if not ok:
            self._counters["stale"] += 1
        return ok

    def discard(self, samples: Sample | Iterable[Sample]) -> None:
        """Forget held samples without acking them (not trained; the teacher redelivers them). A
        redelivered copy that waited beside one is handed to the consumer instead."""
        if isinstance(samples, Sample):
            samples = [samples]
        with self._lock:
            for s in samples:
                copies = self._held.pop(s.key, [])
                self._counters["discarded"] += 1
                if copies:
                    self._held[s.key] = copies[1:]
                    self._q.put(copies[0])

    @property
    def draining(self) -> bool:
        return all(t.draining or t.ended for t in self._teachers)

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def teacher_silent_s(self) -> float:
        """Seconds since the longest-silent live teacher was heard (0 while all are heard)."""
        now = time.monotonic()
        silent = [now - t.last_seen for t in self._teachers if not t.ended]
        worst = max(silent, default=0.0)
        return worst if worst > self.cfg.heartbeat_timeout_s else 0.0

    def stats(self) -> dict:
        s = dict(self._counters)
        for k in ("received", "acked", "skipped_duplicates", "bytes_received", "shm_samples", "stale"):
            s.setdefault(k, 0)
        s["rejected"] = sum(self._rejected.values())
        s["rejected_by_reason"] = dict(self._rejected)
        return s

    def close(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._wake.set()
        self._thread.join()
        self._thread = None
        for t in self._teachers:
            t.sock.close(linger=0)
        self._shm.close()
        self._wake.close()

    # --- I/O thread --------------------------------------------------------------------------

    def _send(self, t: TeacherLink, kind: int, msg: bytes) -> None:
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

    def _flush_outbox(self, t: TeacherLink) -> None:
        while t.outbox:
            try:
                t.sock.send(t.outbox[0][1], zmq.NOBLOCK)
            except zmq.Again:
                return
            t.outbox.popleft()

    def _hello(self, t: TeacherLink) -> None:
        t.welcomed = False
        t.hello_pending = True
        t.hellos_out += 1
        t.last_hello = time.monotonic()
        # What belonged to the old session's handshake is void; ACKs and COMMITs still go out.
        t.outbox = collections.deque(x for x in t.outbox if x[0] not in (P.CREDIT, P.ACKED))
        self._send(
            t,
            P.HELLO,
            P.encode_control(
                P.HELLO,
                name=self.name,
                credit_samples=self.cfg.credit_samples,
                credit_bytes=self.cfg.credit_bytes,
                run=self.run_id,
            ),
        )

    def _run(self) -> None:
        poller = zmq.Poller()
        for t in self._teachers:
            poller.register(t.sock, zmq.POLLIN)
            self._hello(t)
        poller.register(self._wake.r, zmq.POLLIN)
        self._started.set()
        interval = self.cfg.heartbeat_interval_s
        next_hb = time.monotonic() + interval
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(max(0, int((next_hb - time.monotonic()) * 1000))))
                if self._wake.r in events:
                    self._wake.drain()
                for t in self._teachers:
                    self._flush_outbox(t)
                self._send_acks()
                for t in self._teachers:
                    if t.sock in events:
                        self._recv_all(t)
                now = time.monotonic()
                if now >= next_hb:
                    next_hb = now + interval
                    for t in self._teachers:
                        if not t.ended:
                            self._keepalive(t, now)
                    # Rings of earlier teacher sessions, once no held sample views them.
                    self._shm.detach_unused({t.ring for t in self._teachers if t.ring})
            self._send_acks()
            for t in self._teachers:
                if not t.ended:
                    self._flush_outbox(t)
                    self._send(t, P.BYE, P.encode_control(P.BYE, name=self.name))
        except Exception as e:
            log.exception("subscriber I/O thread failed")
            self._error = TransportError(f"subscriber I/O thread failed: {e!r}")
            self._started.set()

    def _send_acks(self) -> None:
        with self._lock:
            ops = list(self._acks)
            self._acks.clear()
        if not ops:
            return
        batch: dict[tuple[str, bool], list[int]] = collections.defaultdict(list)
        for op in ops:
            if op is _COMMIT:
                self._flush_acks(batch)
                batch.clear()
                for t in self._teachers:
                    t.commit_out.extend(t.uncommitted)
                    t.uncommitted.clear()
                    self._send_commits(t)
                continue
            tid, seq, key, commit = op
            t = self._by_tid.get(tid)
            if t is None:
                continue
            if not commit:
                t.uncommitted[key] = None
            if t.tid == tid and t.welcomed:
                batch[(tid, commit)].append(seq)
            # else: that teacher incarnation is gone; its successor replays the sample and this
            # side acks that copy as a duplicate.
        self._flush_acks(batch)

    def _flush_acks(self, batch: dict[tuple[str, bool], list[int]]) -> None:
        for (tid, commit), seqs in batch.items():
            self._send(self._by_tid[tid], P.ACK, P.encode_control(P.ACK, tid=tid, seqs=seqs, commit=commit))

    def _send_commits(self, t: TeacherLink) -> None:
        if not t.welcomed or not t.commit_out:
            return
        keys, t.commit_out = t.commit_out, []
        for i in range(0, len(keys), P.MAX_KEYS_PER_MESSAGE):
            self._send(t, P.COMMIT, P.encode_control(P.COMMIT, keys=keys[i : i + P.MAX_KEYS_PER_MESSAGE]))
        self._counters["committed"] += len(keys)

    def _recv_all(self, t: TeacherLink) -> None:
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
                self._rejected[e.reason] += 1
                if e.reason == "version":
                    t.version_errors += 1
                if e.reason == "checksum" and t.welcomed:
                    # A sample whose bytes are not what the teacher sent: never used, never acked.
                    # A new session makes the teacher send what this session holds again.
                    self._hello(t)
                # A teacher that never spoke our version (or stopped: restarted with another
                # release) is fatal and said so. One such message from a teacher that speaks ours
                # is a damaged frame: counted and dropped like any other.
                if e.reason == "version" and (
                    not t.ever_welcomed or t.version_errors >= _VERSION_ERRORS_FATAL
                ):
                    self._error = TransportError(
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
            self._error = TransportError(
                f"teacher at {t.endpoint} refused this student: {h['reason']}{versions}"
            )
        elif kind == P.RESET:
            t.last_seen = time.monotonic()
            self._hello(t)  # the teacher (perhaps a new incarnation) does not know this session
        else:
            self._on_session_control(t, kind, h)

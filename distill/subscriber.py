"""Student side of the transport: `Subscriber` (ZeroMQ DEALER, one per teacher endpoint,
connects). The conversation is in distill/transport.py's docstring; the contract in distill/API.md.

The Subscriber is the public API and the I/O loop that wires its two parts:
distill/deliveries.py (`Deliveries`: samples held for the consumer until it acks or discards
them, redelivered copies, duplicates, the acks and commits it made) and
distill/teacher_sessions.py (`TeacherSessions`: one link per teacher endpoint, the conversation on
each). Acked keys stay UNCOMMITTED (per teacher endpoint) until `commit()` (a checkpoint covers
them), unless commit_on_ack.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Iterable, Iterator

import zmq

from distill.config import TransportConfig
from distill.deliveries import END_MARK, Deliveries
from distill.errors import TransportError
from distill.fp8 import dequantize_sample
from distill.iothread import Wake, tune_malloc
from distill.protocol import Sample
from distill.shm import ShmReader
from distill.sockets import dealer_sockets
from distill.teacher_sessions import TeacherSessions

log = logging.getLogger("distill.transport")


_made = itertools.count()  # Subscribers made in this process


def _default_name() -> str:
    """host-pid, and -k for the k-th further Subscriber of this process: the teacher tells students
    apart by name (who was lost, whom to expect, a student's several connections)."""
    k = next(_made)
    return f"{socket.gethostname()}-{os.getpid()}" + (f"-{k}" if k else "")


class Subscriber:
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
        self.name = name or _default_name()
        self.commit_on_ack = commit_on_ack
        # fp8 samples (teacher.hidden_dtype: fp8): `get` hands back the model dtype; False keeps
        # float8 values + `hidden_scale` for a consumer that dequantizes on its GPU (the student).
        self.dequantize = dequantize
        self._counters: collections.Counter = collections.Counter()
        self._deliveries = Deliveries(
            skip_keys=skip_keys,
            dedup_keys=cfg.dedup_keys,
            commit_on_ack=commit_on_ack,
            counters=self._counters,
        )
        self._shm = ShmReader()
        self._sessions = TeacherSessions(
            cfg, self.name, deliveries=self._deliveries, counters=self._counters, shm=self._shm
        )
        self._wake = Wake()
        self._stop = threading.Event()
        self._started = threading.Event()
        self._error: TransportError | None = None  # the I/O thread failed
        self._finished = False
        self._thread: threading.Thread | None = None

    @property
    def run_id(self) -> str | None:
        """The run this student belongs to: configured, or learned from the first WELCOME."""
        return self._sessions.run_id

    @property
    def credit_window(self) -> int:
        """The most unacked samples the teachers let this student hold (`TransportConfig.credit_window`)."""
        return self.cfg.credit_window

    def start(self) -> Subscriber:
        if self.cfg.tune_malloc:
            tune_malloc()
        for ep in self.cfg.connect:
            for lane, sock in enumerate(dealer_sockets(self.cfg, self.name, ep)):
                self._sessions.connect(ep, sock, lane)
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
            error = self._error or self._sessions.error
            if error is not None:
                raise error
            wait = 0.2 if deadline is None else max(0.0, min(0.2, deadline - time.monotonic()))
            try:
                item = self._deliveries.next(timeout=wait)
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
        self._deliveries.ack([samples] if isinstance(samples, Sample) else samples)
        self._wake.set()

    def commit(self) -> None:
        """Everything acked so far is covered by a saved checkpoint: the teachers journal it."""
        self._deliveries.commit()
        self._wake.set()

    @property
    def uncommitted(self) -> int:
        """Samples acked since the last `commit()` (0 with commit_on_ack)."""
        return self._deliveries.uncommitted

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
        self._deliveries.discard([samples] if isinstance(samples, Sample) else samples)

    @property
    def draining(self) -> bool:
        return self._sessions.draining

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def teacher_silent_s(self) -> float:
        """Seconds since the longest-silent live teacher was heard (0 while all are heard)."""
        return self._sessions.silent_s()

    def stats(self) -> dict:
        s = dict(self._counters)
        for k in ("received", "acked", "skipped_duplicates", "bytes_received", "shm_samples", "stale"):
            s.setdefault(k, 0)
        rejected = self._sessions.rejected
        s["rejected"] = sum(rejected.values())
        s["rejected_by_reason"] = dict(rejected)
        return s

    def close(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._wake.set()
        self._thread.join()
        self._thread = None
        for t in self._sessions.links:
            t.sock.close(linger=0)
        self._shm.close()
        self._wake.close()

    # --- I/O thread --------------------------------------------------------------------------

    def _run(self) -> None:
        sessions, links = self._sessions, self._sessions.links
        poller = zmq.Poller()
        for t in links:
            poller.register(t.sock, zmq.POLLIN)
            sessions.hello(t)
        poller.register(self._wake.r, zmq.POLLIN)
        self._started.set()
        interval = self.cfg.heartbeat_interval_s
        next_hb = time.monotonic() + interval
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(max(0, int((next_hb - time.monotonic()) * 1000))))
                if self._wake.r in events:
                    self._wake.drain()
                for t in links:
                    sessions.flush_outbox(t)
                sessions.send_acks()
                for t in links:
                    if t.sock in events:
                        sessions.recv_all(t)
                now = time.monotonic()
                if now >= next_hb:
                    next_hb = now + interval
                    for t in links:
                        if not t.ended:
                            sessions.keepalive(t, now)
                    # Rings of earlier teacher sessions, once no held sample views them.
                    self._shm.detach_unused({t.ring for t in links if t.ring})
            sessions.send_acks()
            sessions.bye()
        except Exception as e:
            log.exception("subscriber I/O thread failed")
            self._error = TransportError(f"subscriber I/O thread failed: {e!r}")
            self._started.set()

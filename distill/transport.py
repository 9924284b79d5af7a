"""Transport: teacher `Publisher` (ROUTER, binds) and student `Subscriber` (DEALER, connects).

No sample is dropped silently: a teacher sends a sample only against credit that a student granted
(bounded in samples and bytes), keeps it until the student acknowledges it, and redelivers it to
another student when the first stops heartbeating or says BYE. Each sample goes to exactly one
student. When the teacher's memory bound is reached, or no student is connected, samples go to the
spool (safetensors files) and are replayed when credit returns.

Conversation (all control records are one msgpack frame, see protocol.py)::

    student                         teacher
    HELLO{name, credits}      ->
                              <-    WELCOME{tid, shm: [path, nonce] | None}
    CREDIT{shm_ok}            ->                 (student ready; teacher may send)
                              <-    SAMPLE ...   (frames, or header + shm slot reference)
    ACK{seqs}                 ->                 (after the consumer is done; returns credit)
    HEARTBEAT                <->    HEARTBEAT    (every heartbeat_interval_s)
                              <-    DRAIN        (input closed and nothing waits: flush batches)
                              <-    END          (every sample acknowledged)
    BYE                       ->                 (clean leave; unacked samples redelivered at once)
    any (unknown peer)        ->
                              <-    RESET        (student sends HELLO again)

Threads: each side has one I/O thread that owns its ZeroMQ sockets; `submit` / `ack` hand work
to it through a queue and a wake-up pipe.
"""

from __future__ import annotations

import collections
import fcntl
import logging
import math
import os
import queue
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import zmq

from distill import protocol as P
from distill.config import SpoolConfig, TransportConfig
from distill.protocol import ProtocolError, Sample
from distill.shm import ShmReader, ShmRing
from distill.spool import list_spool, read_spool_file, write_sample

log = logging.getLogger(__name__)


class TransportError(RuntimeError):
    """A condition the transport cannot recover from by itself (e.g. a protocol version mismatch)."""


def _pad(n: int) -> int:
    """Tensors of one ring slot start on 64-byte boundaries."""
    return (n + 63) // 64 * 64


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass
class RingSlot:
    """Tensors that live in one slot of the publisher's shared-memory ring (see Publisher.ring_slot)."""

    tensors: dict[str, torch.Tensor]
    offset: int  # slot start in the ring
    offsets: list[int]  # per-tensor start, in `tensors` order


def tune_malloc(mmap_threshold: int = 256 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Let glibc serve large blocks from the heap and keep them (process-wide).

    libzmq allocates one buffer per received message; glibc serves blocks of 32 MiB and more with a
    fresh mmap each time, so every large sample costs page faults (zeroed pages) on the receiver:
    measured here, tcp at 32 MiB went from 1.4 to 2-3 GB/s with this. Students hold at most
    `credit_bytes` anyway. Returns False where mallopt is unavailable (not glibc).
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's mallopt parameter numbers
        return bool(libc.mallopt(m_mmap_threshold, mmap_threshold)) and bool(
            libc.mallopt(m_trim_threshold, trim_threshold)
        )
    except (OSError, AttributeError):
        return False


class _Wake:
    """A pipe that lets other threads wake the I/O thread out of its poll."""

    def __init__(self):
        self.r, self.w = os.pipe()
        os.set_blocking(self.r, False)
        os.set_blocking(self.w, False)

    def set(self) -> None:
        try:
            os.write(self.w, b"x")
        except BlockingIOError:
            pass  # already pending

    def drain(self) -> None:
        try:
            while os.read(self.r, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self.r)
        os.close(self.w)


# --------------------------------------------------------------------------------------------
# Teacher side
# --------------------------------------------------------------------------------------------


@dataclass
class _Entry:
    """A sample the publisher holds until it is acknowledged."""

    sample: Sample
    nbytes: int
    spool_path: Path | None = None  # set when the sample came from (or went to) the spool
    shm: tuple[int, list[int]] | None = None  # (slot offset, per-tensor offsets) once in the ring


@dataclass
class _Student:
    ident: bytes
    name: str
    credit_samples: int
    credit_bytes: int
    ready: bool = False  # CREDIT received
    shm_ok: bool = False
    last_seen: float = field(default_factory=time.monotonic)
    inflight: dict[int, _Entry] = field(default_factory=dict)  # seq -> entry
    inflight_bytes: int = 0
    drain_sent: bool = False
    end_sent: bool = False


class Publisher:
    """Teacher side of the transport. See distill/API.md for the contract."""

    def __init__(
        self,
        cfg: TransportConfig,
        spool: SpoolConfig | None = None,
        *,
        journal: str | None = None,
        journal_lock_wait_s: float = 10.0,
    ):
        self.cfg = cfg
        # How long start() waits for another process to let go of the journal before refusing.
        self.journal_lock_wait_s = journal_lock_wait_s
        self.spool_cfg = spool or SpoolConfig()
        self.tid = cfg.teacher_id or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"
        self.journal_path = Path(journal) if journal else None
        self._lock = threading.Lock()
        self._inbox: collections.deque[_Entry] = collections.deque()  # submitted, not yet seen by I/O
        self._spooled_paths: collections.deque[Path] = collections.deque()  # new spool files to replay
        self._held_bytes = 0  # bytes of samples in memory (inbox + pending + in flight)
        self._seq = 0
        self._input_closed = False
        self._done = threading.Event()
        self._stop = threading.Event()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._t0 = time.monotonic()
        self._last_student_seen = time.monotonic()
        self._nstudents = 0
        self._counters = collections.Counter()
        self._rejected = collections.Counter()
        self._wake = _Wake()
        self._thread: threading.Thread | None = None
        self._ring: ShmRing | None = None
        # I/O-thread state
        self._pending: collections.deque[_Entry] = collections.deque()  # waiting for a student
        self._replay: collections.deque[Path] = collections.deque()  # spool files not yet loaded
        self._students: dict[bytes, _Student] = {}
        self._rr = 0
        self._journal_f = None

    # --- public API (any thread) -------------------------------------------------------------

    def start(self) -> Publisher:
        if self.journal_path:
            # Locked while this teacher appends to it: a second teacher on the same journal, or
            # distill-reconcile rewriting it, would lose acknowledged keys.
            self.journal_path.parent.mkdir(parents=True, exist_ok=True)
            self._journal_f = open(self.journal_path, "a", buffering=1)
            deadline = time.monotonic() + self.journal_lock_wait_s
            while True:
                try:
                    fcntl.flock(self._journal_f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError:
                    if time.monotonic() >= deadline:
                        self._close_journal()
                        raise TransportError(
                            f"journal {str(self.journal_path)!r} is in use by another process (a "
                            "teacher running with the same journal, or distill-reconcile); give each "
                            "teacher its own"
                        ) from None
                # A restarted teacher may find the previous one's engine still exiting.
                time.sleep(0.1)
        ctx = zmq.Context.instance()
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # credits bound what we queue; never drop
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_HEADER_BYTES + 64 * 1024)  # students send control only
        if self.cfg.socket_buffer_bytes:
            self._sock.setsockopt(zmq.SNDBUF, self.cfg.socket_buffer_bytes)
            self._sock.setsockopt(zmq.RCVBUF, self.cfg.socket_buffer_bytes)
        for ep in self.cfg.bind:
            try:
                self._sock.bind(ep)
            except zmq.ZMQError as e:
                self._sock.close(0)
                self._close_journal()
                raise TransportError(f"cannot bind teacher endpoint {ep!r}: {e}") from None
        if self.cfg.shm != "off":
            try:
                self._ring = ShmRing(self.cfg.shm_dir, f"distill-{self.tid}.ring", self.cfg.shm_bytes)
            except OSError as e:
                if self.cfg.shm == "on":
                    self._sock.close(0)
                    self._close_journal()
                    raise TransportError(
                        f"cannot create shared-memory ring in {self.cfg.shm_dir}: {e}"
                    ) from None
                log.warning("shared-memory ring unavailable (%s); all samples travel in frames", e)
        # Samples left in the spool by an earlier run are replayed too.
        self._replay.extend(list_spool(self.spool_cfg.dir))
        self._thread = threading.Thread(target=self._run, name="distill-publisher", daemon=True)
        self._thread.start()
        self._started.wait()
        return self

    def __enter__(self) -> Publisher:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def endpoints(self) -> list[str]:
        return [self._sock.getsockopt_string(zmq.LAST_ENDPOINT)] if hasattr(self, "_sock") else []

    def ring_slot(self, specs: dict[str, tuple[list[int], torch.dtype]]) -> RingSlot | None:
        """Writable tensors in one slot of the shared-memory ring, to fill and pass to `submit`.

        Filling these instead of fresh tensors saves the copy into the ring on the same-host path
        (the producer writes the sample's bytes once); students on other hosts get frames sent
        straight from the slot. Returns None when there is no ring or it has no room: use ordinary
        tensors then. A slot that is not submitted must be given back with `release_slot`.

        Args:
            specs: tensor name -> (shape, dtype), in the order the sample will hold them.
        """
        if self._ring is None:
            return None
        sizes = [math.prod(shape) * _itemsize(dt) for shape, dt in specs.values()]
        off = self._ring.alloc(sum(_pad(n) for n in sizes))
        if off is None:
            return None
        tensors, offsets, cur = {}, [], off
        for (name, (shape, dt)), n in zip(specs.items(), sizes, strict=True):
            view = self._ring.view[cur : cur + n]
            tensors[name] = P._view(view, dt, list(shape)) if n else torch.empty(shape, dtype=dt)
            offsets.append(cur)
            cur += _pad(n)
        return RingSlot(tensors, off, offsets)

    def release_slot(self, slot: RingSlot) -> None:
        """Give back a slot from `ring_slot` that was not submitted."""
        self._ring.free(slot.offset)

    def submit(self, sample: Sample, slot: RingSlot | None = None) -> str:
        """Hand `sample` to the transport. Never waits for students.

        Args:
            sample: CPU tensors; the publisher keeps them until acknowledged (do not modify them).
            slot: the ring slot from `ring_slot` whose tensors `sample.tensors` are (optional).

        Returns:
            "stream:<teacher id>:<seq>" when the sample is held in memory for a student, or the
            path of the spool file it was written to.
        """
        if self._error is not None:
            raise TransportError(f"publisher I/O thread failed: {self._error!r}")
        with self._lock:
            if self._input_closed:
                raise TransportError("submit() after close_input()")
            self._seq += 1
            sample.seq = self._seq
            sample.teacher = self.tid
            tensors = {}
            for k, t in sample.tensors.items():
                if t.device.type != "cpu":
                    raise ValueError(f"tensor {k!r} is on {t.device}; submit CPU tensors")
                tensors[k] = t if t.is_contiguous() else t.contiguous()
            sample.tensors = tensors
            if slot is not None and list(tensors) != list(slot.tensors):
                raise ValueError(
                    f"sample tensors {list(tensors)} do not match the slot's {list(slot.tensors)}"
                )
            nbytes = sample.nbytes
            no_students = self._nstudents == 0 and (
                time.monotonic() - self._last_student_seen > self.cfg.connect_timeout_s
            )
            over = self._held_bytes + nbytes > self.cfg.max_buffer_bytes
            if not (no_students or over):
                self._held_bytes += nbytes
                e = _Entry(sample, nbytes)
                if slot is not None:
                    e.shm = (slot.offset, slot.offsets)
                    self._counters["shm_samples"] += 1
                self._inbox.append(e)
                self._counters["submitted"] += 1
        if no_students or over:
            try:
                path = write_sample(self.spool_cfg.dir, sample)
            finally:
                if slot is not None:
                    self.release_slot(slot)
            with self._lock:
                self._counters["submitted"] += 1
                self._counters["spooled"] += 1
                self._counters["spooled_bytes"] += nbytes
                self._spooled_paths.append(path)
            self._wake.set()
            return str(path)
        self._wake.set()
        return f"stream:{self.tid}:{sample.seq}"

    def close_input(self) -> None:
        """No more samples will be submitted: students get DRAIN once nothing waits, END when all is acked."""
        with self._lock:
            self._input_closed = True
        self._wake.set()

    def wait_done(self, timeout: float | None = None) -> bool:
        """Wait until input is closed and every sample (spool included) is acknowledged."""
        return self._done.wait(timeout)

    def close(self, linger_s: float = 1.0) -> None:
        """Stop. Samples not yet acknowledged are written to the spool (never lost)."""
        if self._thread is None:
            return
        self._stop.set()
        self._wake.set()
        self._thread.join()
        self._thread = None
        # Everything still in memory goes to the spool; spool-backed entries are already on disk.
        leftovers = list(self._inbox) + list(self._pending)
        for st in self._students.values():
            leftovers.extend(st.inflight.values())
        self._inbox.clear()
        self._pending.clear()
        for e in leftovers:
            if e.spool_path is None:
                write_sample(self.spool_cfg.dir, e.sample)
                self._counters["spooled"] += 1
                self._counters["spooled_bytes"] += e.nbytes
        if self._ring is not None:
            self._ring.close()
        self._close_journal()
        self._sock.close(linger=int(linger_s * 1000))
        self._wake.close()

    def _close_journal(self) -> None:
        if self._journal_f:
            self._journal_f.close()  # also releases its lock
            self._journal_f = None

    def stats(self) -> dict:
        with self._lock:
            s = dict(self._counters)
            s["buffered_bytes"] = self._held_bytes
        for k in (
            "submitted",
            "sent",
            "acked",
            "redelivered",
            "spooled",
            "replayed",
            "bytes_sent",
            "late_acks",
        ):
            s.setdefault(k, 0)
        s["rejected"] = sum(self._rejected.values())
        s["rejected_by_reason"] = dict(self._rejected)
        s["students"] = self._nstudents
        s["spool_files"] = len(self._replay) + len(self._spooled_paths)
        s["teacher_id"] = self.tid
        return s

    @staticmethod
    def journal_keys(path: str | os.PathLike) -> set[str]:
        """Keys acknowledged by students in an earlier run (one per line in the journal)."""
        p = Path(path)
        if not p.exists():
            return set()
        return {line.rstrip("\n") for line in p.read_text().splitlines() if line.strip()}

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
                    self._heartbeat(now)
                    next_hb = now + interval
                self._dispatch()
                self._spool_if_abandoned(now)
                self._check_done()
        except Exception as e:  # surfaced to submit() callers; never silent
            log.exception("publisher I/O thread failed")
            self._error = e
            self._started.set()

    def _spool_if_abandoned(self, now: float) -> None:
        """No student for connect_timeout_s: what waits in memory goes to the spool (replayed later)."""
        if self._students or not self._pending:
            return
        if now - self._last_student_seen <= self.cfg.connect_timeout_s:
            return
        n = 0
        while self._pending:
            e = self._pending.popleft()
            if e.spool_path is None:
                path = write_sample(self.spool_cfg.dir, e.sample)
                with self._lock:
                    self._counters["spooled"] += 1
                    self._counters["spooled_bytes"] += e.nbytes
            else:
                path = e.spool_path  # replayed from the spool: it is still there
                with self._lock:
                    self._counters["replayed"] -= 1
            self._replay.append(path)
            if e.shm is not None and self._ring is not None:
                self._ring.free(e.shm[0])
                e.shm = None
            with self._lock:
                self._held_bytes -= e.nbytes
            n += 1
        log.warning(
            "no student for %.0f s: %d samples moved from memory to the spool", self.cfg.connect_timeout_s, n
        )

    def _take_inbox(self) -> None:
        with self._lock:
            while self._inbox:
                self._pending.append(self._inbox.popleft())
            while self._spooled_paths:
                self._replay.append(self._spooled_paths.popleft())

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
                header = P.decode_header(frames[1])
                self._handle(ident, header)
            except ProtocolError as e:
                self._rejected[e.reason] += 1
                log.warning("rejected message from student %r: %s", ident, e)

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
            cs, cb = h.get("credit_samples"), h.get("credit_bytes")
            if not (isinstance(cs, int) and isinstance(cb, int) and cs > 0 and cb > 0):
                raise ProtocolError("field", "HELLO needs positive credit_samples and credit_bytes")
            if st is not None:  # reconnect of a known student: its in-flight samples are redelivered
                self._drop_student(ident, "re-hello")
            st = _Student(ident, str(h.get("name", "")), cs, cb)
            self._students[ident] = st
            self._nstudents = len(self._students)
            self._last_student_seen = time.monotonic()
            shm = [str(self._ring.path), self._ring.nonce] if self._ring is not None else None
            self._send(ident, [P.encode_control(P.WELCOME, tid=self.tid, shm=shm)])
            log.info("student %s connected (%d now)", st.name, self._nstudents)
        elif st is None:
            if kind != P.BYE:
                self._send(ident, [P.encode_control(P.RESET, tid=self.tid)])
        elif kind == P.CREDIT:
            st.ready = True
            st.shm_ok = bool(h.get("shm_ok")) and self._ring is not None
            if self._ring is not None and not st.shm_ok and self.cfg.shm == "on":
                log.warning("student %s cannot map the shared-memory ring; using frames", st.name)
        elif kind == P.ACK:
            seqs = h.get("seqs")
            if not isinstance(seqs, list):
                raise ProtocolError("field", "ACK needs a list of seqs")
            self._ack(st, seqs)
        elif kind == P.HEARTBEAT:
            pass
        elif kind == P.BYE:
            self._drop_student(ident, "bye")
        else:
            raise ProtocolError("kind", f"students do not send kind {kind}")

    def _ack(self, st: _Student, seqs: list) -> None:
        keys = []
        for seq in seqs:
            e = st.inflight.pop(seq, None) if isinstance(seq, int) else None
            if e is None:
                # A late ack from a student we declared dead: if the sample waits for redelivery,
                # take it out (it is consumed); if another student holds it now, ignore.
                self._counters["late_acks"] += 1
                for i, pe in enumerate(self._pending):
                    if pe.sample.seq == seq:
                        del self._pending[i]
                        e = pe
                        break
                if e is None:
                    continue
            else:
                st.credit_samples += 1
                st.credit_bytes += e.nbytes
                st.inflight_bytes -= e.nbytes
            self._release(e)
            keys.append(e.sample.key)
        if keys:
            with self._lock:
                self._counters["acked"] += len(keys)
            if self._journal_f:
                self._journal_f.write("".join(k + "\n" for k in keys))

    def _release(self, e: _Entry) -> None:
        if e.shm is not None and self._ring is not None:
            self._ring.free(e.shm[0])
            e.shm = None
        if e.spool_path is not None and not self.spool_cfg.keep:
            e.spool_path.unlink(missing_ok=True)
            Path(str(e.spool_path) + ".lock").unlink(missing_ok=True)
        with self._lock:
            self._held_bytes -= e.nbytes

    def _drop_student(self, ident: bytes, why: str) -> None:
        st = self._students.pop(ident, None)
        if st is None:
            return
        self._nstudents = len(self._students)
        self._last_student_seen = time.monotonic()
        back = sorted(st.inflight.values(), key=lambda e: e.sample.seq, reverse=True)
        self._pending.extendleft(back)  # descending seqs: they end up first, in order
        if back:
            self._counters["redelivered"] += len(back)
        (log.warning if back else log.info)(
            "student %s gone (%s): %d samples to redeliver", st.name, why, len(back)
        )

    def _heartbeat(self, now: float) -> None:
        for ident, st in list(self._students.items()):
            if now - st.last_seen > self.cfg.heartbeat_timeout_s:
                self._drop_student(ident, "heartbeat timeout")
            else:
                self._send(ident, [P.encode_control(P.HEARTBEAT, tid=self.tid)])

    def _pick_student(self, nbytes: int) -> _Student | None:
        studs = [s for s in self._students.values() if s.ready]
        n = len(studs)
        for i in range(n):
            st = studs[(self._rr + i) % n]
            if st.credit_samples > 0 and (st.credit_bytes >= nbytes or not st.inflight):
                self._rr = (self._rr + i + 1) % n
                return st
        return None

    def _load_replay(self) -> bool:
        """Load the next spool file into pending if memory allows. True if one was loaded."""
        while self._replay:
            p = self._replay[0]
            try:
                size = p.stat().st_size
            except FileNotFoundError:
                self._replay.popleft()
                continue
            with self._lock:
                if self._held_bytes > 0 and self._held_bytes + size > self.cfg.max_buffer_bytes:
                    return False
            self._replay.popleft()
            try:
                s = read_spool_file(p, lock=False)
            except Exception as e:  # a corrupt file is counted and left in place for inspection
                self._rejected["spool_file"] += 1
                log.error("cannot replay spool file %s: %s", p, e)
                continue
            with self._lock:
                self._seq += 1
                s.seq = self._seq
                s.teacher = self.tid
                self._held_bytes += s.nbytes
                self._counters["replayed"] += 1
            self._pending.append(_Entry(s, s.nbytes, spool_path=p))
            return True
        return False

    def _has_credit(self) -> bool:
        return any(s.ready and s.credit_samples > 0 for s in self._students.values())

    def _dispatch(self) -> None:
        while True:
            if not self._pending and not (self._replay and self._has_credit() and self._load_replay()):
                return
            e = self._pending[0]
            st = self._pick_student(e.nbytes)
            if st is None:
                return
            self._pending.popleft()
            if not self._send_sample(st, e):
                self._pending.appendleft(e)
                return

    def _send_sample(self, st: _Student, e: _Entry) -> bool:
        s = e.sample
        with_crc = self.cfg.checksum == "crc32"
        if st.shm_ok and self._ring is not None and e.shm is None:
            self._to_ring(e)
        if st.shm_ok and e.shm is not None:
            header, _ = P.sample_header(e.sample, with_crc=with_crc, shm=(str(self._ring.path), e.shm[1]))
            frames = [P.pack(header)]
        else:
            frames = P.encode_sample(e.sample, with_crc=with_crc)
        if not self._send(st.ident, frames, sample=True):
            return False
        st.credit_samples -= 1
        st.credit_bytes -= e.nbytes
        st.inflight_bytes += e.nbytes
        st.inflight[s.seq] = e
        with self._lock:
            self._counters["sent"] += 1
            self._counters["bytes_sent"] += e.nbytes
        return True

    def _to_ring(self, e: _Entry) -> None:
        """Copy the sample's tensors into one ring slot and keep only views of it."""
        slot = self.ring_slot({k: (list(t.shape), t.dtype) for k, t in e.sample.tensors.items()})
        if slot is None:
            return  # no room in the ring: this sample travels in frames
        for k, t in e.sample.tensors.items():
            if t.numel():
                slot.tensors[k].copy_(t)
        e.shm = (slot.offset, slot.offsets)
        e.sample.tensors = dict(slot.tensors)  # the original tensors can be freed now
        self._counters["shm_samples"] += 1

    def _check_done(self) -> None:
        with self._lock:
            closed = self._input_closed and not self._inbox and not self._spooled_paths
        if not closed or self._pending or self._replay:
            return
        for ident, st in list(self._students.items()):
            if not st.drain_sent:
                st.drain_sent = self._send(ident, [P.encode_control(P.DRAIN, tid=self.tid)])
        if any(st.inflight for st in self._students.values()):
            return
        for ident, st in list(self._students.items()):
            if not st.end_sent:
                st.end_sent = self._send(ident, [P.encode_control(P.END, tid=self.tid)])
        self._done.set()


# --------------------------------------------------------------------------------------------
# Student side
# --------------------------------------------------------------------------------------------


@dataclass
class _Teacher:
    endpoint: str
    sock: zmq.Socket
    tid: str | None = None
    welcomed: bool = False
    draining: bool = False
    ended: bool = False
    last_seen: float = field(default_factory=time.monotonic)
    last_hello: float = 0.0
    ever_welcomed: bool = False  # a valid WELCOME came once: this teacher speaks our version
    version_errors: int = 0  # messages in a row that carried another protocol version


_VERSION_ERRORS_FATAL = 10  # that many in a row from a known teacher: it was replaced by another version

_END = object()


class Subscriber:
    """Student side of the transport. See distill/API.md for the contract."""

    def __init__(self, cfg: TransportConfig, *, skip_keys=None, name: str | None = None):
        self.cfg = cfg
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self._skip = skip_keys if skip_keys is not None else set()
        # keys acked in this process, oldest first, at most cfg.dedup_keys
        self._consumed: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._held: set[str] = set()  # keys handed to the consumer and not yet acked
        self._q: queue.Queue = queue.Queue()
        self._acks: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._wake = _Wake()
        self._stop = threading.Event()
        self._started = threading.Event()
        self._shm = ShmReader()
        self._teachers: list[_Teacher] = []
        self._by_tid: dict[str, _Teacher] = {}
        self._counters = collections.Counter()
        self._rejected = collections.Counter()
        self._error: str | None = None
        self._finished = False
        self._thread: threading.Thread | None = None

    def start(self) -> Subscriber:
        if self.cfg.tune_malloc:
            tune_malloc()
        ctx = zmq.Context.instance()
        for ep in self.cfg.connect:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.ROUTING_ID, f"{self.name}-{uuid.uuid4().hex[:8]}".encode())
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            if self.cfg.socket_buffer_bytes:
                sock.setsockopt(zmq.SNDBUF, self.cfg.socket_buffer_bytes)
                sock.setsockopt(zmq.RCVBUF, self.cfg.socket_buffer_bytes)
            try:
                sock.connect(ep)
            except zmq.ZMQError as e:
                raise TransportError(f"cannot connect to teacher endpoint {ep!r}: {e}") from None
            self._teachers.append(_Teacher(ep, sock))
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
        """Next sample; None on timeout, or once every teacher has sent END (then `finished`)."""
        if self._finished:
            return None
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._error:
                raise TransportError(self._error)
            wait = 0.2 if deadline is None else max(0.0, min(0.2, deadline - time.monotonic()))
            try:
                item = self._q.get(timeout=wait)
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                continue
            if item is _END:
                self._finished = True
                return None
            return item

    def ack(self, samples: Sample | Iterable[Sample]) -> None:
        """Acknowledge consumed samples: the teacher frees them and credit returns.

        Their tensors (zero-copy views) must not be used afterwards.
        """
        if isinstance(samples, Sample):
            samples = [samples]
        with self._lock:
            for s in samples:
                self._consumed[s.key] = None
                self._held.discard(s.key)
                self._acks.append((s.teacher, s.seq))
                self._counters["acked"] += 1
            while len(self._consumed) > self.cfg.dedup_keys:
                self._consumed.popitem(last=False)
        self._wake.set()

    @property
    def draining(self) -> bool:
        return all(t.draining or t.ended for t in self._teachers)

    @property
    def finished(self) -> bool:
        return self._finished

    def stats(self) -> dict:
        s = dict(self._counters)
        for k in ("received", "acked", "skipped_duplicates", "bytes_received", "shm_samples"):
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

    def _hello(self, t: _Teacher) -> None:
        t.welcomed = False
        t.last_hello = time.monotonic()
        t.sock.send(
            P.encode_control(
                P.HELLO,
                name=self.name,
                credit_samples=self.cfg.credit_samples,
                credit_bytes=self.cfg.credit_bytes,
            )
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
                self._send_acks()
                for t in self._teachers:
                    if t.sock in events:
                        self._recv_all(t)
                now = time.monotonic()
                if now >= next_hb:
                    next_hb = now + interval
                    for t in self._teachers:
                        if t.ended:
                            continue
                        if not t.welcomed and now - t.last_hello > self.cfg.heartbeat_timeout_s:
                            self._hello(t)  # the teacher may have restarted or not be up yet
                        t.sock.send(P.encode_control(P.HEARTBEAT, name=self.name))
            for t in self._teachers:
                if not t.ended:
                    self._send_acks()
                    t.sock.send(P.encode_control(P.BYE, name=self.name), zmq.NOBLOCK)
        except Exception as e:
            log.exception("subscriber I/O thread failed")
            self._error = f"subscriber I/O thread failed: {e!r}"
            self._started.set()

    def _send_acks(self) -> None:
        with self._lock:
            acks = list(self._acks)
            self._acks.clear()
        if not acks:
            return
        by_tid: dict[str, list[int]] = collections.defaultdict(list)
        for tid, seq in acks:
            by_tid[tid].append(seq)
        for tid, seqs in by_tid.items():
            t = self._by_tid.get(tid)
            if t is not None:
                t.sock.send(P.encode_control(P.ACK, seqs=seqs))

    def _recv_all(self, t: _Teacher) -> None:
        while True:
            try:
                frames = t.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            t.last_seen = time.monotonic()
            try:
                header = P.decode_header(frames[0])
                t.version_errors = 0
                self._handle(t, header, frames[1:])
            except ProtocolError as e:
                self._rejected[e.reason] += 1
                if e.reason == "version":
                    t.version_errors += 1
                # A teacher that never spoke our version (or stopped: restarted with another
                # release) is fatal and said so. One such message from a teacher that speaks ours
                # is a damaged frame: counted and dropped like any other.
                if e.reason == "version" and (
                    not t.ever_welcomed or t.version_errors >= _VERSION_ERRORS_FATAL
                ):
                    self._error = (
                        f"teacher at {t.endpoint} speaks another protocol version ({e}); "
                        "install the same distill-stream version on teacher and students"
                    )
                log.warning("rejected message from teacher %s: %s", t.endpoint, e)

    def _handle(self, t: _Teacher, h: dict, frames: list) -> None:
        kind = h["k"]
        if kind == P.SAMPLE:
            if not t.welcomed:
                raise ProtocolError("kind", "sample before WELCOME")
            s = P.decode_sample(h, frames, self._shm.resolve)
            self._counters["received"] += 1
            self._counters["bytes_received"] += s.nbytes
            if "shm" in h:
                self._counters["shm_samples"] += 1
            with self._lock:
                dup = s.key in self._skip or s.key in self._consumed or s.key in self._held
                if not dup:
                    self._held.add(s.key)
            if dup:
                # Already trained (ledger), consumed here, or a redelivered copy of one the consumer
                # holds: ack this copy at once, never train a sample twice.
                self._counters["skipped_duplicates"] += 1
                t.sock.send(P.encode_control(P.ACK, seqs=[s.seq]))
                return
            self._q.put(s)
        elif kind == P.WELCOME:
            tid = h.get("tid")
            if not isinstance(tid, str):
                raise ProtocolError("field", "WELCOME without tid")
            if t.tid is not None:
                self._by_tid.pop(t.tid, None)
            t.tid = tid
            self._by_tid[tid] = t
            shm_ok = False
            shm = h.get("shm")
            if self.cfg.shm != "off" and isinstance(shm, list) and len(shm) == 2:
                shm_ok = self._shm.attach(str(shm[0]), str(shm[1]))
            if self.cfg.shm == "on" and not shm_ok:
                self._error = f"transport.shm is 'on' but the ring of teacher {t.endpoint} cannot be mapped"
            t.welcomed = t.ever_welcomed = True
            t.draining = t.ended = False
            t.sock.send(P.encode_control(P.CREDIT, shm_ok=shm_ok))
        elif kind == P.HEARTBEAT:
            pass
        elif kind == P.RESET:
            self._hello(t)
        elif kind == P.DRAIN:
            t.draining = True
        elif kind == P.END:
            t.ended = True
            if all(x.ended for x in self._teachers):
                self._q.put(_END)
        else:
            raise ProtocolError("kind", f"teachers do not send kind {kind}")

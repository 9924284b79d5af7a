"""Teacher side of the transport: `Publisher` (ZeroMQ ROUTER, binds). The conversation is in
distill/transport.py's docstring; the contract in distill/API.md.

Where a sample is, from `submit` to the end (one owner: the I/O thread, except `submit`):

    inbox -> pending -> in flight at one student -> acked (memory freed, credit back)
                \\-> spool file (memory full / no student) -> replay -> pending ...
    acked keys wait in their student session until COMMIT (a checkpoint covers them) -> journal.
    A session that ends with acked, uncommitted keys: they are LOST (journal `!lost`, take_lost()).
"""

from __future__ import annotations

import collections
import logging
import math
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import zmq

from distill import protocol as P
from distill.config import SpoolConfig, TransportConfig
from distill.iothread import RateLimitedLog, TransportError, Wake
from distill.journal import Journal, JournalBusy, check_key
from distill.protocol import ProtocolError, Sample
from distill.shm import STAMP_BYTES, ShmRing, clean_stale, ring_name
from distill.spool import list_spool, read_spool_file, remove_spool_file, write_sample

log = logging.getLogger("distill.transport")


def _pad(n: int) -> int:
    """Tensors of one ring slot start on 64-byte boundaries."""
    return (n + 63) // 64 * 64


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass
class RingSlot:
    """Tensors that live in one slot of the publisher's shared-memory ring (see Publisher.ring_slot)."""

    tensors: dict[str, torch.Tensor]
    offset: int  # slot start in the ring (its stamp word)
    offsets: list[int]  # per-tensor start, in `tensors` order
    stamp: int = 0


@dataclass
class _Entry:
    """A sample the publisher holds until it is acknowledged."""

    sample: Sample
    nbytes: int
    spool_path: Path | None = None  # set when the sample came from (or went to) the spool
    spool_size: int = 0
    shm: tuple[int, list[int], int] | None = None  # (slot offset, per-tensor offsets, stamp) once in the ring


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
    uncommitted: dict[str, None] = field(default_factory=dict)  # acked keys no checkpoint covers yet
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
        auto_end: bool = True,
    ):
        self.cfg = cfg
        self.spool_cfg = spool or SpoolConfig()
        self.tid = cfg.teacher_id or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"
        self.journal_path = Path(journal) if journal else None
        self.journal_lock_wait_s = journal_lock_wait_s
        # auto_end: END once the input is closed and every sample is acked and committed. Otherwise
        # END only after `end()` (distill-teacher decides when the run is complete).
        self.auto_end = auto_end
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # notified when memory or spool space frees
        self._inbox: collections.deque[_Entry] = collections.deque()  # submitted, not yet seen by I/O
        self._spooled_paths: collections.deque[tuple[Path, int]] = collections.deque()  # to replay
        self._held_bytes = 0  # bytes of samples in memory (inbox + pending + in flight)
        self._spool_bytes = 0  # bytes of spool files this publisher knows of (max_bytes bound)
        self._seq = 0
        self._stamp = secrets.randbits(40) << 20  # ring slot stamps: unique per publisher
        self._input_closed = False
        self._end_requested = False
        self._lost: list[str] = []  # keys of sessions that ended uncommitted, not yet taken
        self._lost_open: set[str] = set()  # lost keys neither submitted again nor committed since
        self._done = threading.Event()  # END sent
        self._idle = threading.Event()  # input closed, nothing waits or is in flight
        self._stop = threading.Event()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._last_student_seen = time.monotonic()
        self._nstudents = 0
        self._counters = collections.Counter()
        self._rejected = collections.Counter()
        self._reject_log = RateLimitedLog(log)
        self._wake = Wake()
        self._thread: threading.Thread | None = None
        self._sock: zmq.Socket | None = None
        self._ring: ShmRing | None = None
        self._journal: Journal | None = None
        self._auth = None  # zmq.auth ThreadAuthenticator (CURVE)
        self.run_id = cfg.run_id  # resolved in start()
        # I/O-thread state
        self._pending: collections.deque[_Entry] = collections.deque()  # waiting for a student
        self._replay: collections.deque[tuple[Path, int]] = collections.deque()  # spool files to load
        self._students: dict[bytes, _Student] = {}
        self._refused: dict[bytes, float] = {}  # ident -> last REFUSE sent (rate limit)
        self._rr = 0

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
        self.run_id = self.cfg.run_id or _stored_run_id(self.journal_path)
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        if self.cfg.curve is not None:
            try:
                self._auth = curve_server(ctx, sock, self.cfg.curve)
            except (OSError, ValueError) as e:
                sock.close(0)
                self._close_journal()
                raise TransportError(f"transport.curve: {e}") from None
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.setsockopt(zmq.SNDHWM, 0)  # credits bound what we queue; never drop
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        # Students send control records only: nothing larger than a header is accepted.
        sock.setsockopt(zmq.MAXMSGSIZE, self.cfg.max_header_bytes + 64 * 1024)
        # ZeroMQ heartbeats close connections silent for heartbeat_timeout_s (a link that was down),
        # so a student's reconnect is not stuck behind a dead TCP connection.
        hb_ms = max(1, int(self.cfg.heartbeat_interval_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_IVL, hb_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(hb_ms, int(self.cfg.heartbeat_timeout_s * 1000)))
        if self.cfg.socket_buffer_bytes:
            sock.setsockopt(zmq.SNDBUF, self.cfg.socket_buffer_bytes)
            sock.setsockopt(zmq.RCVBUF, self.cfg.socket_buffer_bytes)
        for ep in self.cfg.bind:
            try:
                sock.bind(ep)
            except zmq.ZMQError as e:
                sock.close(0)
                self._close_journal()
                raise TransportError(f"cannot bind teacher endpoint {ep!r}: {e}") from None
        self._sock = sock
        if self.cfg.shm != "off":
            clean_stale(self.cfg.shm_dir)
            try:
                self._ring = ShmRing(self.cfg.shm_dir, ring_name(self.tid), self.cfg.shm_bytes)
            except OSError as e:
                if self.cfg.shm == "on":
                    self._sock.close(0)
                    self._close_journal()
                    raise TransportError(
                        f"cannot create shared-memory ring in {self.cfg.shm_dir}: {e}"
                    ) from None
                log.warning("shared-memory ring unavailable (%s); all samples travel in frames", e)
        # Samples left in the spool by an earlier run (or the engine phase) are replayed too.
        self.add_spool_files(list_spool(self.spool_cfg.dir))
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
        if self._ring is None:
            return None
        sizes = [math.prod(shape) * _itemsize(dt) for shape, dt in specs.values()]
        off = self._ring.alloc(STAMP_BYTES + sum(_pad(n) for n in sizes))
        if off is None:
            return None
        with self._lock:
            self._stamp += 1
            stamp = self._stamp
        self._ring.set_stamp(off, stamp)  # before any byte of the sample
        tensors, offsets, cur = {}, [], off + STAMP_BYTES
        for (name, (shape, dt)), n in zip(specs.items(), sizes, strict=True):
            view = self._ring.view[cur : cur + n]
            tensors[name] = P._view(view, dt, list(shape)) if n else torch.empty(shape, dtype=dt)
            offsets.append(cur)
            cur += _pad(n)
        return RingSlot(tensors, off, offsets, stamp)

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
        if self._error is not None:
            raise TransportError(f"publisher I/O thread failed: {self._error!r}")
        check_key(sample.key)
        tensors = {}
        for k, t in sample.tensors.items():
            if t.device.type != "cpu":
                raise ValueError(f"tensor {k!r} is on {t.device}; submit CPU tensors")
            tensors[k] = t if t.is_contiguous() else t.contiguous()
        if slot is not None and list(tensors) != list(slot.tensors):
            raise ValueError(f"sample tensors {list(tensors)} do not match the slot's {list(slot.tensors)}")
        sample.tensors = tensors
        if self.cfg.checksum == "crc32" and sample.crc is None:
            sample.crc = P.sample_crc(sample)  # once, on the producer's thread; carried everywhere
        nbytes = sample.nbytes
        limit = self.spool_cfg.max_bytes
        waited_since, logged = None, 0.0
        with self._cond:
            while True:
                if self._stop.is_set():
                    raise TransportError("submit() on a closed publisher")
                no_students = self._nstudents == 0 and (
                    time.monotonic() - self._last_student_seen > self.cfg.connect_timeout_s
                )
                to_spool = no_students or self._held_bytes + nbytes > self.cfg.max_buffer_bytes
                if not to_spool or not limit or self._spool_bytes == 0 or self._spool_bytes + nbytes <= limit:
                    break
                # Memory and spool are full: the producer waits (spool.max_bytes) until students
                # take samples. Said every 30 s.
                now = time.monotonic()
                if waited_since is None:
                    waited_since = now
                    self._counters["spool_full_waits"] += 1
                if now - logged >= 30:
                    logged = now
                    log.warning(
                        "spool full (%d of %d bytes) and memory full: waiting for students (%.0f s so far)",
                        self._spool_bytes,
                        limit,
                        now - waited_since,
                    )
                self._cond.wait(0.5)
            if waited_since is not None:
                self._counters["spool_full_wait_s"] += time.monotonic() - waited_since
            self._seq += 1
            sample.seq = self._seq
            sample.teacher = self.tid
            self._counters["submitted"] += 1
            self._lost_open.discard(sample.key)
            if to_spool:
                self._spool_bytes += nbytes  # reserved; corrected to the file's size below
            else:
                self._held_bytes += nbytes
                e = _Entry(sample, nbytes)
                if slot is not None:
                    e.shm = (slot.offset, slot.offsets, slot.stamp)
                    self._counters["shm_samples"] += 1
                self._inbox.append(e)
        if to_spool:
            try:
                path = write_sample(self.spool_cfg.dir, sample)
                size = path.stat().st_size
            except BaseException:
                with self._lock:
                    self._spool_bytes -= nbytes
                raise
            finally:
                if slot is not None:
                    self.release_slot(slot)
            with self._lock:
                self._spool_bytes += size - nbytes
                self._counters["spooled"] += 1
                self._counters["spooled_bytes"] += nbytes
                self._spooled_paths.append((path, size))
            self._wake.set()
            return str(path)
        self._wake.set()
        return f"stream:{self.tid}:{sample.seq}"

    def add_spool_files(self, paths) -> None:
        """Replay these spool files to students too (e.g. written by another process)."""
        items = []
        for p in paths:
            try:
                items.append((Path(p), Path(p).stat().st_size))
            except FileNotFoundError:
                continue
        with self._lock:
            self._spool_bytes += sum(n for _, n in items)
            self._spooled_paths.extend(items)
        self._wake.set()

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
        with self._lock:
            out, self._lost = self._lost, []
        return out

    def wait_done(self, timeout: float | None = None) -> bool:
        """Wait until END was sent: input closed, every sample acked and committed (auto_end), or
        `end()` called with nothing waiting or in flight."""
        return self._done.wait(timeout)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until the input is closed and every sample is acked (nothing waits, nothing in flight)."""
        return self._idle.wait(timeout)

    def close(self, linger_s: float = 1.0) -> None:
        """Stop. Samples not yet acknowledged are written to the spool (never lost)."""
        if self._thread is None:
            return
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
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
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self._wake.close()

    def _close_journal(self) -> None:
        if self._journal is not None:
            self._journal.close()
            self._journal = None

    def stats(self) -> dict:
        with self._lock:
            s = dict(self._counters)
            s["buffered_bytes"] = self._held_bytes
            s["spool_bytes"] = self._spool_bytes
        for k in (
            "submitted",
            "sent",
            "acked",
            "committed",
            "lost",
            "redelivered",
            "spooled",
            "replayed",
            "bytes_sent",
            "late_acks",
        ):
            s.setdefault(k, 0)
        studs = list(self._students.values())
        s["rejected"] = sum(self._rejected.values())
        s["rejected_by_reason"] = dict(self._rejected)
        s["students"] = self._nstudents
        s["uncommitted"] = sum(len(st.uncommitted) for st in studs)
        s["inflight"] = sum(len(st.inflight) for st in studs)
        s["pending"] = len(self._pending) + len(self._inbox)
        s["spool_files"] = len(self._replay) + len(self._spooled_paths)
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
                size = path.stat().st_size
                with self._lock:
                    self._counters["spooled"] += 1
                    self._counters["spooled_bytes"] += e.nbytes
                    self._spool_bytes += size
            else:
                path, size = e.spool_path, e.spool_size  # replayed from the spool: it is still there
                with self._lock:
                    self._counters["replayed"] -= 1
            self._replay.append((path, size))
            if e.shm is not None and self._ring is not None:
                self._ring.free(e.shm[0])
                e.shm = None
            with self._cond:
                self._held_bytes -= e.nbytes
                self._cond.notify_all()
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

    def _reject(self, who: str, e: ProtocolError) -> None:
        self._rejected[e.reason] += 1
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
            cs, cb = h["credit_samples"], h["credit_bytes"]
            if cs <= 0 or cb <= 0:
                raise ProtocolError("field", "HELLO needs positive credit_samples and credit_bytes")
            if h["run"] is not None and self.run_id is not None and h["run"] != self.run_id:
                self._counters["refused"] += 1
                self._refuse(
                    ident, f"this teacher serves run {self.run_id!r}, the student belongs to run {h['run']!r}"
                )
                log.warning("refused student %s of run %r (this run: %r)", h["name"], h["run"], self.run_id)
                return
            if st is not None:  # reconnect of a known student: its in-flight samples are redelivered
                self._drop_student(ident, "re-hello", lose=False)
            st = _Student(ident, h["name"], cs, cb)
            self._students[ident] = st
            self._nstudents = len(self._students)
            self._last_student_seen = time.monotonic()
            shm = [str(self._ring.path), self._ring.nonce] if self._ring is not None else None
            self._send(ident, [P.encode_control(P.WELCOME, tid=self.tid, shm=shm, run=self.run_id)])
            log.info("student %s connected (%d now)", st.name, self._nstudents)
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
                self._counters["foreign_acks"] += 1  # for an earlier teacher incarnation
                return
            self._ack(st, h["seqs"], bool(h["commit"]))
        elif kind == P.ACKED:
            for k in h["keys"]:
                st.uncommitted[k] = None
        elif kind == P.HEARTBEAT:
            pass
        elif kind == P.BYE:
            self._drop_student(ident, "bye")
        else:
            raise ProtocolError("kind", f"students do not send kind {kind}")

    def _commit(self, keys: list[str]) -> None:
        if self._journal is not None:
            self._journal.append_committed(keys)
        with self._lock:
            self._counters["committed"] += len(keys)
            self._lost_open.difference_update(keys)

    def _ack(self, st: _Student, seqs: list[int], commit: bool) -> None:
        keys = []
        for seq in seqs:
            e = st.inflight.pop(seq, None)
            if e is None:
                # A late ack for a sample of this student's earlier session (it said HELLO again):
                # if the sample waits for redelivery, take it out (it is consumed); if another
                # student holds it now, ignore (that student skips it, its job knows the key).
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
            if commit:
                self._commit(keys)
            else:
                st.uncommitted.update(dict.fromkeys(keys))

    def _release(self, e: _Entry) -> None:
        if e.shm is not None and self._ring is not None:
            self._ring.free(e.shm[0])
            e.shm = None
        freed_spool = 0
        if e.spool_path is not None and not self.spool_cfg.keep:
            remove_spool_file(e.spool_path)
            freed_spool = e.spool_size
        with self._cond:
            self._held_bytes -= e.nbytes
            self._spool_bytes -= freed_spool
            self._cond.notify_all()

    def _drop_student(self, ident: bytes, why: str, *, lose: bool = True) -> None:
        st = self._students.pop(ident, None)
        if st is None:
            return
        self._nstudents = len(self._students)
        self._last_student_seen = time.monotonic()
        back = sorted(st.inflight.values(), key=lambda e: e.sample.seq, reverse=True)
        self._pending.extendleft(back)  # descending seqs: they end up first, in order
        if back:
            self._counters["redelivered"] += len(back)
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
                self._counters["lost"] += len(lost)
        (log.warning if back or lost else log.info)(
            "student %s gone (%s): %d samples to redeliver, %d acked but not checkpointed (lost: to regenerate)",
            st.name,
            why,
            len(back),
            len(lost),
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
            p, size = self._replay[0]
            if not p.exists():
                self._replay.popleft()
                with self._cond:
                    self._spool_bytes -= size
                    self._cond.notify_all()
                continue
            with self._lock:
                if self._held_bytes > 0 and self._held_bytes + size > self.cfg.max_buffer_bytes:
                    return False
            self._replay.popleft()
            try:
                s = read_spool_file(p, lock=False)
            except Exception as e:  # a corrupt file is counted and set aside for inspection
                self._rejected["spool_file"] += 1
                bad = p.with_name(p.name + ".corrupt")
                try:
                    p.rename(bad)  # no longer counts as spooled: distill-teacher generates it again
                except OSError:
                    bad = p
                log.error("cannot replay spool file %s (kept as %s): %s", p, bad, e)
                with self._cond:
                    self._spool_bytes -= size
                    self._cond.notify_all()
                continue
            with self._lock:
                self._seq += 1
                s.seq = self._seq
                s.teacher = self.tid
                self._held_bytes += s.nbytes
                self._counters["replayed"] += 1
            self._pending.append(_Entry(s, s.nbytes, spool_path=p, spool_size=size))
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
            off, offsets, stamp = e.shm
            header, _ = P.sample_header(
                e.sample, with_crc=with_crc, shm=(str(self._ring.path), offsets, off, stamp)
            )
            frames = [P.pack(header)]
        else:
            frames = P.encode_sample(e.sample, with_crc=with_crc)
        if not self._send(st.ident, frames, sample=True):
            return False
        st.credit_samples -= 1
        st.credit_bytes -= e.nbytes
        st.inflight_bytes += e.nbytes
        st.inflight[s.seq] = e
        st.drain_sent = False  # DRAIN again once idle again
        self._idle.clear()
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
        e.shm = (slot.offset, slot.offsets, slot.stamp)
        e.sample.tensors = dict(slot.tensors)  # the original tensors can be freed now
        self._counters["shm_samples"] += 1

    def _check_done(self) -> None:
        with self._lock:
            closed = self._input_closed and not self._inbox and not self._spooled_paths
            end_requested = self._end_requested
        if not closed or self._pending or self._replay:
            self._idle.clear()
            return
        for ident, st in list(self._students.items()):
            if not st.drain_sent:
                st.drain_sent = self._send(ident, [P.encode_control(P.DRAIN, tid=self.tid)])
        if any(st.inflight for st in self._students.values()):
            self._idle.clear()
            return
        self._idle.set()
        if self.auto_end:
            if any(st.uncommitted for st in self._students.values()):
                return  # students commit at their drain checkpoint (they got DRAIN)
            with self._lock:
                if self._lost_open:
                    return  # the producer has keys to generate again (take_lost)
        elif not end_requested:
            return
        for ident, st in list(self._students.items()):
            if not st.end_sent:
                st.end_sent = self._send(ident, [P.encode_control(P.END, tid=self.tid)])
        self._done.set()


def _stored_run_id(journal: Path | None) -> str | None:
    """The run id kept beside a journal (`<journal>.run`), made at the first start."""
    if journal is None:
        return None
    p = journal.with_name(journal.name + ".run")
    if p.exists():
        rid = p.read_text().strip()
        if rid:
            return rid
    rid = f"run-{secrets.token_hex(6)}"
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(rid + "\n")
    os.replace(tmp, p)
    return rid


def curve_server(ctx: zmq.Context, sock: zmq.Socket, curve):
    """Make `sock` a CURVE server that accepts only the students whose public keys are in
    `curve.authorized_keys`. Returns the running authenticator (stop it on close)."""
    import zmq.auth
    from zmq.auth.thread import ThreadAuthenticator

    if not curve.authorized_keys or not Path(curve.authorized_keys).is_dir():
        raise ValueError(
            f"authorized_keys must be a folder of student public keys, got {curve.authorized_keys!r}"
        )
    public, secret = zmq.auth.load_certificate(curve.secret_key)
    if secret is None:
        raise ValueError(f"{curve.secret_key!r} holds no secret key (use the .key_secret file)")
    auth = ThreadAuthenticator(ctx, log=logging.getLogger("distill.transport.auth"))
    auth.start()
    auth.configure_curve(domain="*", location=str(curve.authorized_keys))
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True
    return auth

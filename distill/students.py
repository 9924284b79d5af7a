"""The teacher's table of student sessions: credit granted and taken, samples in flight at each,
keys acked but not yet committed, and the round-robin choice of the next student to send to.
Owned by the Publisher's I/O thread (distill/publisher.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from distill.protocol import Sample, student_of


@dataclass
class Entry:
    """A sample the publisher holds until it is acknowledged."""

    sample: Sample
    nbytes: int
    spool_path: Path | None = None  # set when the sample came from (or went to) the spool
    spool_size: int = 0
    shm: tuple[int, list[int], int] | None = None  # (slot offset, per-tensor offsets, stamp) once in the ring


@dataclass
class Student:
    """One student session (from HELLO to BYE / heartbeat timeout)."""

    ident: bytes
    name: str
    credit_samples: int
    credit_bytes: int
    ready: bool = False  # CREDIT received
    shm_ok: bool = False
    last_seen: float = field(default_factory=time.monotonic)
    inflight: dict[int, Entry] = field(default_factory=dict)  # seq -> entry
    inflight_bytes: int = 0
    uncommitted: dict[str, None] = field(default_factory=dict)  # acked keys no checkpoint covers yet
    drain_sent: bool = False
    end_sent: bool = False
    # The student this session is one connection of (`transport.connections`); read on every turn
    # of the I/O loop (FlowClock), so worked out once.
    student: str = field(init=False)

    def __post_init__(self) -> None:
        self.student = student_of(self.name)

    def can_take(self, nbytes: int) -> bool:
        """Credit for one more sample of `nbytes` (a sample larger than the byte credit still goes
        to a student with nothing in flight)."""
        return self.ready and self.credit_samples > 0 and (self.credit_bytes >= nbytes or not self.inflight)

    def sent(self, e: Entry) -> None:
        """`e` went out to this student: it takes credit and is in flight until acked."""
        self.credit_samples -= 1
        self.credit_bytes -= e.nbytes
        self.inflight_bytes += e.nbytes
        self.inflight[e.sample.seq] = e
        self.drain_sent = False  # DRAIN again once idle again

    def acked(self, seq: int) -> Entry | None:
        """The student acked `seq`: its credit returns. None when it is not in flight here."""
        e = self.inflight.pop(seq, None)
        if e is not None:
            self.credit_samples += 1
            self.credit_bytes += e.nbytes
            self.inflight_bytes -= e.nbytes
        return e


class StudentTable:
    """The connected student sessions, by ZeroMQ identity."""

    def __init__(self):
        self._by_ident: dict[bytes, Student] = {}
        self._rr = 0
        self.count = 0  # len(), readable from any thread
        self.peak = 0  # the most sessions at once
        self.last_seen = time.monotonic()  # last time a student joined or left (connect_timeout_s)
        self.joined = 0  # sessions opened so far

    def __len__(self) -> int:
        return len(self._by_ident)

    def get(self, ident: bytes) -> Student | None:
        return self._by_ident.get(ident)

    def items(self) -> list[tuple[bytes, Student]]:
        return list(self._by_ident.items())

    def values(self) -> list[Student]:
        return list(self._by_ident.values())

    def add(self, st: Student) -> None:
        self._by_ident[st.ident] = st
        self.joined += 1
        self._changed()

    def pop(self, ident: bytes) -> Student | None:
        st = self._by_ident.pop(ident, None)
        if st is not None:
            self._changed()
        return st

    def _changed(self) -> None:
        self.count = len(self._by_ident)
        self.peak = max(self.peak, self.count)
        self.last_seen = time.monotonic()

    def pick(self, nbytes: int) -> Student | None:
        """The next student (round robin) with credit for a sample of `nbytes`, or None."""
        studs = [s for s in self._by_ident.values() if s.ready]
        n = len(studs)
        for i in range(n):
            st = studs[(self._rr + i) % n]
            if st.can_take(nbytes):
                self._rr = (self._rr + i + 1) % n
                return st
        return None

    def has_credit(self) -> bool:
        return any(s.ready and s.credit_samples > 0 for s in self._by_ident.values())


class FlowClock:
    """Who waited on whom, in seconds (the teacher's side of the sizing figures; owned by the
    Publisher's I/O thread, read by `Publisher.stats`). `tick` is called once per I/O loop turn,
    after dispatch; the state it sees holds until the next turn (every change of it, a sample
    submitted or read ahead, an ack, a student joining or leaving, wakes the loop).

    flow_s            time with a student connected (CREDIT received) and samples somewhere:
                      the producer not done, or samples waiting or in flight
    student_s         the same, summed over the connected students (mean students = student_s / flow_s;
                      a student's several connections, `transport.connections`, count once)
    student_idle_s    student-seconds a connected student had nothing in flight on any of its
                      connections (it had acked everything it was sent, its credit was unused)
                      while the producer was not done: students waiting on the teacher
    no_credit_s       seconds with samples ready to send and no student with credit for them: the
                      teacher waiting on students
    """

    __slots__ = ("flow_s", "student_s", "student_idle_s", "no_credit_s", "_last", "_state")

    def __init__(self):
        self.flow_s = self.student_s = self.student_idle_s = self.no_credit_s = 0.0
        self._last = time.monotonic()
        self._state = (0, 0, False)  # (students, idle students, samples ready but no credit)

    def tick(self, now: float, table: StudentTable, producing: bool, waiting: bool) -> None:
        """Account the time since the last tick to the state seen then; note the state now.
        `producing`: the producer may still submit (or spool files wait to be replayed); `waiting`:
        samples are ready to send (after dispatch: none of them found a student with credit)."""
        dt, (n, idle, stuck) = now - self._last, self._state
        if n:
            self.flow_s += dt
            self.student_s += n * dt
            self.student_idle_s += idle * dt
            if stuck:
                self.no_credit_s += dt
        self._last = now
        studs = [s for s in table.values() if s.ready]
        if not studs or not (producing or waiting or any(s.inflight for s in studs)):
            self._state = (0, 0, False)  # no student, or nothing left anywhere: no flow
            return
        if not (producing or waiting):  # the last samples are trained: nothing more would come
            self._state = (len({s.student for s in studs}), 0, False)
            return
        busy = {s.student for s in studs if s.inflight}
        students = {s.student for s in studs}
        self._state = (len(students), len(students - busy), waiting)

    def snapshot(self) -> dict:
        return {
            "flow_s": self.flow_s,
            "student_s": self.student_s,
            "student_idle_s": self.student_idle_s,
            "no_credit_s": self.no_credit_s,
        }

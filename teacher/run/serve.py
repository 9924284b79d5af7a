"""SERVE phase of `distill-teacher` (see teacher/cli.py): this process's own Publisher replays the
spool until every key is committed in the journal, then sends END. Keys lost while serving, or
missing (neither committed nor spooled nor held by anyone), send the run back to GENERATE."""

from __future__ import annotations

import logging
import os
import time

from distill.journal import JournalTail, lock_holder
from distill.spool import list_spool, remove_spool_file, spool_name
from teacher.engine import shutdown_bound_s
from teacher.errors import ServeFailed
from teacher.run.results import ServeResult
from teacher.run.state import Run, Stop, say
from teacher.sizing import delta, shares

log = logging.getLogger("distill.teacher")


def serve(r: Run, stop: Stop, rnd: int) -> ServeResult:
    """Replay the spool to students until every required key is committed.

    Returns what it did: its `outcome` ("done" | "lost" | "gone" | "signal") and `lost_keys` (to
    generate again).
    """
    from distill.transport import Publisher, TransportError

    transport = r.transport.model_copy(update={"teacher_id": f"{r.base_tid}-serve{rnd}"})
    res = r.begin(ServeResult(round=rnd))
    t_phase = time.monotonic()
    if not _wait_for_engine_publisher(r, stop):  # before reading the journal: it may still change
        res.outcome, res.seconds = "signal", round(time.monotonic() - t_phase, 3)
        return res
    tail = JournalTail(r.cfg.journal)
    tail.poll()
    committed0 = len(tail.committed & r.required)
    if not r.spool.keep:
        _remove_committed_spool_files(r, tail.committed)
    # Only this run's spool files: a spool folder shared with another dataset keeps its files.
    todo = r.required - tail.committed
    pub = Publisher(transport, r.spool, journal=r.cfg.journal, auto_end=False, replay_keys=todo)
    pub.expect_students(r.engine_students)
    try:
        pub.start()
    except Exception as e:
        raise ServeFailed(f"cannot start the serve Publisher on {transport.bind}: {e}") from e
    r.pub.live("serve", pub.stats)
    watch = _Watch(r, pub, tail, res, committed0)
    try:
        pub.close_input()
        while watch.outcome is None:
            time.sleep(0.2)
            if stop.requested:
                watch.outcome = "signal"
                break
            try:
                pub.check()  # a failed I/O thread serves nobody: say so now, not after student_wait_s
            except TransportError as e:
                watch.outcome = "failed"
                raise ServeFailed(f"serving stopped: {e}") from None
            watch.step(time.monotonic())
        if watch.outcome == "done":
            send_end(pub, transport, stop)
    except KeyboardInterrupt:
        watch.outcome = "signal"
        raise
    finally:
        st = pub.stats()
        res.note_flow(st, r.phase_shares(st))
        pub.close()
        r.pub.closed(pub.stats())  # after close: what it spooled at close is counted
        tail.poll()
        res.served = len(tail.committed & r.required) - committed0
        res.seconds = round(time.monotonic() - t_phase, 3)
        res.outcome = watch.outcome or "gone"
    res.lost_keys = watch.lost
    return res


def _wait_for_engine_publisher(r: Run, stop: Stop) -> bool:
    """The engine phase's Publisher (in one of this teacher's vLLM processes) may still hold the
    journal: vLLM's shutdown returned, but the process has not exited yet (killed at the shutdown
    bound, or orphaned while it spools what students did not ack). Wait while it lives, with a line
    every `progress_every_s`, at most `shutdown_bound_s(drain_timeout_s)` (the time vLLM gives its
    engine to shut down); the serve Publisher takes the lock only once it is free (never two
    writers). A holder that is not this teacher's gets the Publisher's usual 10 s wait. Returns
    False on a stop signal; raises ServeFailed when the bound passes."""
    bound = shutdown_bound_s(r.cfg.drain_timeout_s)
    t0 = time.monotonic()
    last_print = t0 - r.cfg.progress_every_s
    while (pid := lock_holder(r.cfg.journal)) is not None and _ours(pid):
        now = time.monotonic()
        if stop.requested:
            return False
        if now - t0 > bound:
            raise ServeFailed(
                f"the engine's publisher (pid {pid}) still holds the journal {r.cfg.journal} after "
                f"{bound:.0f}s (teacher.drain_timeout_s + {bound - r.cfg.drain_timeout_s:.0f}s): stop that process"
            )
        if now - last_print >= r.cfg.progress_every_s:
            last_print = now
            say(
                f"serving: waiting for the engine's publisher (pid {pid}) to release the journal: it "
                f"spools what students did not ack ({now - t0:.0f}s, at most {bound:.0f}s)"
            )
        time.sleep(0.1)
    return True


def _ours(pid: int) -> bool:
    """Whether `pid` is one of this teacher's engine processes: a descendant, or one that carries
    this teacher's pid in its environment (reparented once vLLM's engine core was killed)."""
    import psutil

    from teacher.reaper import MARK

    me = os.getpid()
    if pid == me:
        return False
    try:
        p = psutil.Process(pid)
        if any(a.pid == me for a in p.parents()):
            return True
        return p.environ().get(MARK) == str(me)
    except (psutil.Error, OSError):
        return False


def _remove_committed_spool_files(r: Run, committed: set[str]) -> None:
    """Spool files of committed keys (a crash between the commit and the unlink) are delivered:
    remove them rather than replay them (students would only skip them)."""
    names = r.spooled_names()
    for k in committed & r.required:
        f = r.spool_dir / spool_name(k)
        if f.name in names:
            remove_spool_file(f)


class _Watch:
    """One look every 0.2 s at the journal and the Publisher: progress line, lost and missing keys,
    and the outcome (None while serving goes on)."""

    def __init__(self, r: Run, pub, tail: JournalTail, result: ServeResult, committed0: int):
        self.r, self.pub, self.tail, self.result = r, pub, tail, result
        self.required = r.required
        self.grace = max(5.0, 2 * pub.cfg.heartbeat_timeout_s)
        now = time.monotonic()
        self.last_progress = now
        self.last_print = now - r.cfg.progress_every_s  # a first line at once
        self.last_rate = (now, committed0)
        self.last_marks = None
        self.last_stats: dict | None = None
        self.idle_missing_since = None
        self.lost: set[str] = set()
        self.outcome: str | None = None

    def step(self, now: float) -> None:
        self.tail.poll()
        committed = self.tail.committed & self.required
        st = self.pub.stats()
        students = int(st.get("students", 0))
        self.result.students_max = max(self.result.students_max, students)
        self._take_lost(committed)
        self._note_progress(now, committed, st, students)
        if now - self.last_print >= self.r.cfg.progress_every_s:
            self._print(now, committed, st, students)
        if len(committed) == len(self.required):
            self.outcome = "done"
            return
        idle = not (st.get("pending", 0) or st.get("inflight", 0) or st.get("spool_files", 0))
        if self.lost and idle:
            self.outcome = "lost"
            return
        if not (idle and not st.get("uncommitted", 0)):
            self.idle_missing_since = None  # something moves: missing keys may still come
        elif self._missing_too_long(now, committed):
            self.outcome = "lost"
            return
        if self.r.cfg.student_wait_s and now - self.last_progress > self.r.cfg.student_wait_s:
            self.outcome = "gone"

    def _take_lost(self, committed: set[str]) -> None:
        for k in self.pub.take_lost():
            self.result.lost += 1
            if k in self.required and k not in committed:
                self.lost.add(k)
        self.lost -= committed

    def _note_progress(self, now: float, committed: set[str], st: dict, students: int) -> None:
        """Progress: a commit, an ack, a sample sent, or one more student."""
        marks = (len(committed), st.get("acked", 0), st.get("sent", 0), st.get("committed", 0), students)
        if marks != self.last_marks:
            last = self.last_marks
            if last is None or marks[:4] != last[:4] or students > last[4]:
                self.last_progress = now
            self.last_marks = marks

    def _missing_too_long(self, now: float, committed: set[str]) -> bool:
        """Nothing waits, nothing is held, yet keys are neither committed nor spooled: after a grace
        period (students of the engine's Publisher may still commit) they are generated again."""
        names = self.r.spooled_names()
        missing = {k for k in self.required - committed if spool_name(k) not in names}
        if not missing:
            self.idle_missing_since = None
            return False
        self.idle_missing_since = self.idle_missing_since or now
        if now - self.idle_missing_since <= self.grace:
            return False
        log.warning(
            "%d samples are neither committed nor spooled nor held by a student; generating them again",
            len(missing),
        )
        self.lost |= missing
        return True

    def _print(self, now: float, committed: set[str], st: dict, students: int) -> None:
        t_prev, c_prev = self.last_rate
        rate = (len(committed) - c_prev) / max(now - t_prev, 1e-9)
        self.last_rate = (now, len(committed))
        self.last_print = now
        d = delta(st, self.last_stats)
        busy = d["replay_read_s"] / max(now - t_prev, 1e-9) / self.r.spool.readers
        self.last_stats = st
        idle_s = now - self.last_progress
        tail = ""
        if d["flow_s"] > 0:  # since the last line: who waited on whom (teacher/sizing.py)
            f = shares(d, self.r.spool.readers, self.r.generated, self.r.generate_s)
            if f["ratio"] is not None:
                tail += f", teacher busy {100 * f['teacher_busy']:.0f}%"
            tail += f", students waited {100 * f['student_wait']:.0f}%"
            if f["ratio"] is not None:
                tail += f", students at {100 * f['ratio']:.0f}% of the teacher's rate"
        tail += f", ring full {st['shm_full']}x" if st.get("shm_full") else ""
        tail += f", no progress for {idle_s:.0f}s" if idle_s > 10 else ""
        if students == 0:
            tail += _no_student_hint(self.r.cfg)
        say(
            f"serving: committed {len(committed)}/{len(self.required)}, "
            f"in spool {len(list_spool(self.r.spool_dir))}, in flight {st.get('inflight', 0)}, "
            f"students {students}, {rate:.1f} samples/s, read ahead {st.get('read_ahead_ready', 0)}, "
            f"readers busy {100 * busy:.0f}%{tail}"
        )


def _no_student_hint(cfg) -> str:
    """The end of a progress line while no student is connected: how long it waits, how to stop."""
    wait = f"exit 3 after {cfg.student_wait_s:.0f}s without any (teacher.student_wait_s)"
    hint = f"; no student connected: {wait if cfg.student_wait_s else 'waiting for one'}; Ctrl-C or SIGTERM stops now (exit 130, the spool is kept)"
    if cfg.connector_mode == "spool":
        hint += "; to generate only, run with --set teacher.after_generation=exit"
    return hint


def end_grace_s(transport) -> float:
    """How long after END the teacher waits for a student whose session ended in silence: six
    heartbeat timeouts (at least 30 s), never longer than the student itself waits for a teacher."""
    return min(transport.teacher_wait_s, max(30.0, 6 * transport.heartbeat_timeout_s))


def send_end(pub, transport, stop: Stop) -> None:
    """END goes out once nothing is waiting or in flight; then it must reach the students: each
    confirms it by leaving (BYE). Students of the engine's Publisher (closed moments ago) reconnect
    within a few heartbeats (RESET -> HELLO) and get END on arrival; a student whose session ended
    in silence (its link down, its process frozen), or one the engine's Publisher was serving
    (`Publisher.expect_students`) that has not come yet, is waited for `end_grace_s(transport)`."""
    pub.end()
    end_wait = max(10.0, 2 * transport.heartbeat_timeout_s)
    if pub.wait_done(timeout=end_wait):
        linger, grace = max(3.0, 4 * transport.heartbeat_interval_s), end_grace_s(transport)
        missing = pub.wait_end_delivered(linger, grace, lambda: stop.requested)
        if missing and not stop.requested:
            log.warning(
                "END may not have reached %s (silent past heartbeat_timeout_s and not back within "
                "%.0fs): they stop after their transport.teacher_wait_s",
                ", ".join(missing),
                grace,
            )
        return
    st = pub.stats()
    log.warning(
        "every sample is committed, but END was not sent within %.0fs (%d samples still wait, "
        "%d in flight): students may wait for a teacher until their transport.teacher_wait_s",
        end_wait,
        st.get("spool_files", 0) + st.get("pending", 0),
        st.get("inflight", 0),
    )

"""Sizing done by the system: `distill-teacher` says how busy it was, how long students waited and
which split to run (teacher/sizing.py; the Publisher's flow clock, distill/students.py `FlowClock`).

The process tests run the real `distill-teacher` serve phase (no vLLM: every row already in the
spool, as tests/system/test_teacher_cli.py's `_spooled_run`) with its spool reader throttled to a known
time per sample (the one injected change, as `_FAILING_SEND` there), and one student that
"trains" each sample for a known time. The figures the teacher quotes are checked against rates
measured here: the student's own busy time per sample, and the reader's throttle.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_teacher_cli import ROOT, _spooled_run, _summary

from distill.config import TransportConfig
from distill.transport import Subscriber
from teacher.sizing import Flow, recommend, sizing
from testkit.tiny import build_tiny_model

TOL = 0.25  # quoted rates and ratio within 25% of the ones measured here (a shared 2-core box)

# The real distill-teacher with its spool reader slowed to DISTILL_TEST_READ_S per file: a teacher
# whose rate is known.
_SLOW_READER = """
import os, sys, time
from distill.spooler import Spooler
real, pause = Spooler._read, float(os.environ["DISTILL_TEST_READ_S"])
def slow(self, p, size):
    time.sleep(pause)
    return real(self, p, size)
Spooler._read = slow
from teacher.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("sizing") / "tiny")


class _TimedStudent(threading.Thread):
    """A Subscriber that trains each sample for `train_s` (a sleep) and acks it; records its busy
    time (sample in hand to ack sent) and whether END came."""

    def __init__(self, endpoint: str, train_s: float):
        super().__init__(daemon=True)
        # A window of a few samples (as a few micro-batches): the teacher waits once it is full.
        self.cfg = TransportConfig(connect=[endpoint], shm="off", credit_samples=8)
        self.train_s = train_s
        self.keys: list[str] = []
        self.busy_s = 0.0
        self.finished = False
        self.error: BaseException | None = None
        self.halt = threading.Event()

    def run(self) -> None:
        try:
            with Subscriber(self.cfg) as sub:
                while not self.halt.is_set():
                    s = sub.get(timeout=0.2)
                    if s is None:
                        if sub.finished:
                            break
                        continue
                    t = time.monotonic()
                    self.keys.append(s.key)
                    time.sleep(self.train_s)
                    sub.ack(s)
                    self.busy_s += time.monotonic() - t
                self.finished = sub.finished
        except BaseException as e:  # surfaced by the test
            self.error = e

    @property
    def rate(self) -> float:
        """Samples/s this student trains when it never waits (measured here)."""
        return len(self.keys) / self.busy_s


def _serve(tmp_path: Path, model: Path, n: int, read_s: float, train_s: float):
    """Serve `n` spooled rows with the reader throttled to `read_s` per file to one student taking
    `train_s` per sample; returns (the teacher's process, its summary, the student)."""
    keys, cfg, ep = _spooled_run(tmp_path, model, n, 13, student_wait_s=60, progress_every_s=1)
    student = _TimedStudent(ep, train_s)
    student.start()
    try:
        r = subprocess.run(
            [sys.executable, "-c", _SLOW_READER, "--config", str(cfg), "--set", "spool.readers=1"],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
            env={**os.environ, "DISTILL_TEST_READ_S": str(read_s)},
        )  # fmt: skip
        student.join(timeout=30)  # END ends it (bounded)
    finally:
        student.halt.set()
        student.join(timeout=10)
    assert r.returncode == 0, r.stderr[-3000:]
    assert student.error is None and student.finished
    assert sorted(student.keys) == sorted(keys), "every sample trained once"
    return r, _summary(cfg), student


def _near(got: float, want: float) -> bool:
    return abs(got - want) <= TOL * want


@pytest.mark.slow
def test_students_three_times_slower_say_add_two_student_gpus(model, tmp_path):
    read_s, train_s = 0.02, 0.06  # teacher 50 samples/s, student ~16.7: it takes a third
    r, s, student = _serve(tmp_path, model, 90, read_s, train_s)
    z = s["sizing"]
    print(z, f"student measured {student.rate:.2f}/s", sep="\n")
    assert z["verdict"] == "add_students", z
    assert z["teacher"] == "spool readers" and z["samples"] == 90
    # The rates the teacher quotes are the ones measured: the student's own, the reader's throttle.
    assert _near(z["students_rate"], student.rate), (z["students_rate"], student.rate)
    assert 0.75 / read_s <= z["teacher_rate"] <= 1.0 / read_s, z["teacher_rate"]
    assert _near(z["ratio"], student.rate * read_s), (z["ratio"], student.rate * read_s)
    assert z["ratio"] == pytest.approx(z["students_rate"] / z["teacher_rate"], rel=0.01)
    assert z["student_wait"] < 0.1 and z["teacher_waited"] > 0.5  # the teacher waited on the student
    assert _near(z["teacher_busy"], z["ratio"])
    assert "add 2 student GPUs per teacher (3 per teacher" in z["recommendation"]
    line = [x for x in r.stderr.splitlines() if x.startswith("distill-teacher: sizing: ")]
    assert line == [f"distill-teacher: sizing: {z['recommendation']}"], r.stderr[-3000:]
    assert any("teacher busy" in x and "students waited" in x for x in r.stderr.splitlines())
    serve = s["phases"][-1]
    assert serve["phase"] == "serve" and serve["student_wait"] == z["student_wait"]


@pytest.mark.slow
def test_slower_teacher_says_students_wait_and_add_teachers(model, tmp_path):
    read_s, train_s = 0.06, 0.02  # teacher ~16.7 samples/s, the student could take ~50
    r, s, student = _serve(tmp_path, model, 60, read_s, train_s)
    z = s["sizing"]
    print(z, f"student measured {student.rate:.2f}/s", sep="\n")
    assert z["verdict"] == "add_teachers", z
    assert _near(z["students_rate"], student.rate), (z["students_rate"], student.rate)
    assert 0.75 / read_s <= z["teacher_rate"] <= 1.0 / read_s, z["teacher_rate"]
    assert _near(z["ratio"], student.rate * read_s), (z["ratio"], student.rate * read_s)
    # The student waited about 1 - (its rate / the teacher's) of the time.
    assert _near(z["student_wait"], 1 - 1 / (student.rate * read_s)), z["student_wait"]
    assert z["teacher_waited"] < 0.1 and z["teacher_busy"] > 0.85
    assert f"the students waited {z['student_wait']:.0%} of the time" in z["recommendation"]
    assert "3 teachers for this student" in z["recommendation"]
    assert f"distill-teacher: sizing: {z['recommendation']}" in r.stderr


def _figures(acked, flow_s, idle_share, teacher_rate, students=1.0):
    f = Flow()
    f.totals.update(
        flow_s=flow_s, student_s=students * flow_s, student_idle_s=idle_share * students * flow_s,
        acked=acked, replayed=acked, replay_read_s=acked / teacher_rate,
    )  # fmt: skip
    return sizing(f, readers=1)


def test_recommendation_wording_and_rounding():
    z = _figures(acked=310, flow_s=10, idle_share=0, teacher_rate=100)  # students take 31%
    assert (z["verdict"], z["ratio"], z["teacher_busy"]) == ("add_students", 0.31, 0.31)
    assert "took 31% of the teacher's rate" in z["recommendation"]
    assert "add 2 student GPUs per teacher (3 per teacher would take 93% of it)" in z["recommendation"]
    z = _figures(acked=400, flow_s=10, idle_share=0.5, teacher_rate=40, students=4)  # 4 take 2x
    assert z["verdict"] == "add_teachers" and z["ratio"] == 2.0
    assert (
        "2 student GPUs per teacher would do, or add teacher GPUs, 2 teachers for these 4 students"
        in (z["recommendation"])
    )
    assert _figures(acked=100, flow_s=10, idle_share=0.0, teacher_rate=10.5)["verdict"] == "balanced"
    z = _figures(acked=5, flow_s=1, idle_share=0, teacher_rate=100)
    assert z["verdict"] == "too_short" and "too little flow" in z["recommendation"]
    # vLLM's rate is the teacher's when this invocation generated
    f = Flow()
    f.totals.update(flow_s=10, student_s=10, acked=100, replayed=100, replay_read_s=1.0)
    z = sizing(f, readers=1, generated=200, generate_s=4.0)
    assert (z["teacher"], z["teacher_rate"], z["ratio"]) == ("vllm", 50.0, 0.2)
    assert recommend(z) == (z["verdict"], z["recommendation"])


def test_generate_phase_counters_travel_through_flow_files(tmp_path):
    """The connector (in vLLM's worker) writes its Publisher's counters; distill-teacher sums and
    removes every file, ignores a torn one, and finds none the second time."""
    from teacher.sizing import FLOW_KEYS, take_flow, write_flow

    journal = str(tmp_path / "journal.txt")
    assert take_flow(journal) is None
    write_flow(journal, {"flow_s": 2.5, "acked": 30, "student_s": 5.0, "other": 1}, ["s1-r0", "s1-r1"])
    (tmp_path / "journal.txt.flow-999999.json").write_text(
        '{"flow_s": 1.5, "acked": 10, "student_names": ["s1-r1", "s2-r0"]}'
    )
    (tmp_path / "journal.txt.flow-888888.json").write_text('{"flow_s": ')  # torn
    got = take_flow(journal)
    assert set(got) == {*FLOW_KEYS, "student_names"}
    assert (got["flow_s"], got["acked"], got["student_s"]) == (4.0, 40.0, 5.0)
    # the students the engine's connectors were serving: the serve phase's Publisher expects them
    assert got["student_names"] == ["s1-r0", "s1-r1", "s2-r0"]
    assert not list(tmp_path.glob("journal.txt.flow-*")) and take_flow(journal) is None

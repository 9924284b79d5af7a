"""teacher/reaper.py without vLLM: a process the dead teacher started but the reaper never saw as
its descendant (born between two looks, or reparented before the first one) is found through the
teacher's pid that distill-teacher puts in its environment before vLLM starts (reaper.MARK), and
killed with the rest. Real processes; the "teacher" here is a small Python stand-in that does
what teacher/engine.py does before vLLM (mark, start the reaper), then starts an orphan."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]

TEACHER = """
import os, subprocess, sys, time
from teacher import reaper
os.environ["DISTILL_TEACHER_PID"] = str(os.getpid())  # reaper.MARK, as teacher/engine.py sets it
reaper.start(sys.argv[1])
orphan = "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True); open(sys.argv[1], 'w').write(str(p.pid))"
subprocess.run([sys.executable, "-c", orphan, sys.argv[2]], check=True)  # its parent exits at once
time.sleep(600)
"""


def _ancestors(proc: psutil.Process) -> list[int] | None:
    """The pids above `proc`, or None when one of them exited while they were read (look again)."""
    try:
        return [p.pid for p in proc.parents()]
    except psutil.NoSuchProcess:
        return None


def test_an_orphan_the_reaper_never_saw_dies_with_the_teacher(tmp_path):
    from teacher.reaper import MARK

    assert MARK == "DISTILL_TEACHER_PID"  # what the stand-in sets
    journal, pidfile = tmp_path / "journal.txt", tmp_path / "orphan.pid"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("DISTILL_TEACHER_PID", None)
    teacher = subprocess.Popen([sys.executable, "-c", TEACHER, str(journal), str(pidfile)], cwd=ROOT, env=env)
    orphan = None
    try:
        assert wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), timeout=60)
        orphan = psutil.Process(int(pidfile.read_text()))
        # once its parent has exited it is no descendant of the teacher
        assert wait_until(lambda: (a := _ancestors(orphan)) is not None and teacher.pid not in a, timeout=10)
        time.sleep(0.6)  # a couple of the reaper's looks: it still sees nothing of the orphan
        (reaper,) = [c for c in psutil.Process(teacher.pid).children() if "teacher.reaper" in c.cmdline()]
        teacher.send_signal(signal.SIGKILL)
        teacher.wait(timeout=10)
        killed_at = time.monotonic()
        gone = wait_until(
            lambda: not orphan.is_running() or orphan.status() == psutil.STATUS_ZOMBIE, timeout=20
        )
        assert gone, "the orphan outlived the teacher's reaper"
        # The reaper itself ends soon after (a killed orphan stays a zombie where init does not
        # reap, as in this container: waiting for it to vanish would take the whole timeout).
        assert wait_until(lambda: not reaper.is_running() or reaper.status() == psutil.STATUS_ZOMBIE, 20)
        took = time.monotonic() - killed_at
        assert took < 8, f"the reaper took {took:.1f} s after the teacher's death"
        assert wait_until(lambda: not (tmp_path / "journal.txt.engine.json").exists(), timeout=10)
    finally:
        if teacher.poll() is None:
            teacher.kill()
        if orphan is not None and orphan.is_running():
            orphan.kill()

"""teacher/reaper.py's clean() with an engine process that ends by itself during the grace but is
not reaped at once (its parent died, and init reaps late or never: a container's PID 1 often never
does). Such a zombie has ended: it is not killed, not reported as killed, and the /dev/shm files are
removed without waiting for its new parent to reap it (psutil.wait_procs counts a zombie that is
not our child as running and waited the whole 10 s after the kill). No vLLM, real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import psutil
from waiting import wait_until

# A parent that starts a short-lived child and never reaps it: the child becomes a zombie.
PARENT = (
    "import subprocess, sys, time\n"
    "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(0.3)'])\n"
    "print(c.pid, flush=True)\n"
    "time.sleep(120)\n"
)


def test_a_process_that_ends_in_the_grace_is_not_killed_and_shm_goes_at_once():
    from teacher import reaper

    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    shm = Path(reaper.SHM_DIR) / f"psm_reapertest{os.getpid()}"
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        shm.write_bytes(b"x" * 4096)
        data = {"procs": [(child.pid, child.create_time())], "shm": [shm.stat().st_ino]}
        result = {}
        t = threading.Thread(target=lambda: result.update(out=reaper.clean(data, grace_s=5.0)))
        t.start()
        assert wait_until(lambda: not t.is_alive(), timeout=30), "clean() did not return within 30 s"
        killed, removed, _ = result["out"]
        assert child.status() == psutil.STATUS_ZOMBIE  # ended by itself, its parent never reaped it
        assert killed == [], f"a process that ended by itself was reported killed: {killed}"
        assert removed == [shm.name] and not shm.exists()
    finally:
        parent.kill()
        parent.wait(timeout=10)
        shm.unlink(missing_ok=True)

"""teacher/reaper.py's clean() with an engine process that ends by itself during the grace but is
not reaped at once (its parent died, and init reaps late or never: a container's PID 1 often never
does). Such a zombie has ended: it is not killed, not reported as killed, and the /dev/shm files are
removed without waiting for its new parent to reap it (psutil.wait_procs counts a zombie that is
not our child as running and waited the whole 10 s after the kill). And one that goes on starting
up during the grace: the segment it maps by then goes with it. No vLLM, real processes."""

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


# An engine process still starting up: after the reaper's last look it makes a segment, maps it and
# runs on.
LATE = (
    "import mmap, os, sys, time\n"
    "fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)\n"
    "os.ftruncate(fd, 4096)\n"
    "m = mmap.mmap(fd, 4096)\n"
    "print('mapped', flush=True)\n"
    "time.sleep(120)\n"
)


def test_a_segment_made_after_it_was_noted_goes_with_the_process_that_maps_it():
    """Seen in a chaos run (the teacher SIGKILLed while vLLM's engine core was still starting):
    a psm_ segment made after the reaper's last look stayed in /dev/shm."""
    from teacher import reaper

    shm = Path(reaper.SHM_DIR) / f"psm_reaperlate{os.getpid()}"
    late = subprocess.Popen([sys.executable, "-c", LATE, str(shm)], stdout=subprocess.PIPE, text=True)
    try:
        p = psutil.Process(late.pid)
        data = {"procs": [(p.pid, p.create_time())], "shm": []}  # noted before it made the segment
        assert late.stdout.readline().strip() == "mapped"
        killed, removed, _ = reaper.clean(data, grace_s=1.0)
        assert killed == [late.pid]
        assert removed == [shm.name] and not shm.exists(), (removed, shm.exists())
    finally:
        late.kill()
        late.wait(timeout=10)
        shm.unlink(missing_ok=True)

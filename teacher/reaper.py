"""vLLM's engine processes die with `distill-teacher`, and what they leave in /dev/shm goes too.

vLLM 0.32's engine core (and its worker) do not notice that the process that started them died:
after a SIGKILL of `distill-teacher` they run on (killed during vLLM's start-up, for good), holding
the GPU's memory, the teacher's tcp port (the engine phase's Publisher lives in the worker) and
Python shared-memory segments (`psm_*`, `sem.mp-*` in /dev/shm, 418 MB on the CPU build). A restart
would then find its GPU memory taken and its endpoint in use.

The reaper: `distill-teacher` starts `python -m teacher.reaper <teacher pid> <record>` right before
vLLM. While the teacher lives it notes, every `POLL_S`, the teacher's descendants (pid and start
time) and the /dev/shm files they map (by inode), in `<journal>.engine.json` (atomic rewrite). When
its parent is gone (any exit, SIGKILL included) it adds the processes that carry the teacher's pid
in their environment (`MARK`, set before vLLM starts: born after the last look, or already
reparented), gives them all `GRACE_S` to end by themselves, kills the ones still running (same pid and start time), removes the noted /dev/shm
files, deletes the record and exits. Where the reaper died with the teacher (a whole process tree
or group killed at once), the next `distill-teacher` on the same journal does the same from the
record at its start (`clean_leftovers`, after taking `<journal>.lock`: the earlier teacher is dead
then). One log line says what was cleaned.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

log = logging.getLogger("distill.teacher")

POLL_S = 0.25
GRACE_S = 2.0  # after the teacher's death, before killing what it left running
# Set in distill-teacher's environment before vLLM starts: every engine process inherits it, so a
# process born after the reaper's last look (or reparented once the teacher died) is still found.
MARK = "DISTILL_TEACHER_PID"
SHM_DIR = "/dev/shm"
SHM_PREFIXES = ("psm_", "sem.")  # Python multiprocessing: SharedMemory segments, named semaphores


def record_path(journal: str | os.PathLike) -> Path:
    j = Path(os.path.abspath(journal))
    return j.with_name(j.name + ".engine.json")


def mapped_shm(pid: int) -> set[int]:
    """Inode numbers of the files in /dev/shm that process `pid` maps (a named semaphore shows
    there under the temporary name it was created with, so names do not identify it; inodes do)."""
    out = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith(SHM_DIR + "/"):
                    out.add(int(parts[4]))
    except (OSError, ValueError):
        pass
    return out


def shm_files(inodes) -> list[os.DirEntry]:
    """The multiprocessing files (`psm_*`, `sem.*`) in /dev/shm with one of these inode numbers."""
    want = set(inodes)
    try:
        with os.scandir(SHM_DIR) as it:
            return [e for e in it if e.name.startswith(SHM_PREFIXES) and e.inode() in want]
    except OSError:
        return []


def marked(teacher: int, skip_pid: int | None = None) -> dict[int, float]:
    """{pid: start time} of the running processes whose environment names `teacher` in MARK
    (started after it: never an older process that happens to carry the value)."""
    try:
        born = psutil.Process(teacher).create_time()
    except psutil.Error:
        born = 0.0  # the teacher is gone: its pid and start time are not needed to match its mark
    out = {}
    for p in psutil.process_iter(["pid"]):
        if p.pid in (skip_pid, os.getpid()):
            continue
        with contextlib.suppress(psutil.Error):
            if p.environ().get(MARK) == str(teacher) and p.create_time() >= born:
                out[p.pid] = p.create_time()
    return out


def _write(record: Path, data: dict) -> None:
    tmp = record.with_name(record.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, record)


def _ended(p: psutil.Process) -> bool:
    """Gone, its pid reused, or a zombie: a process whose teacher died is reaped by init (or a
    container's PID 1, which may never do it), not by us, so its zombie counts as ended."""
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


def wait_ended(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Those of `procs` still running after up to `timeout` seconds (polled every 50 ms).
    psutil.wait_procs counts a zombie that is not our child as running and waits the whole timeout
    for its parent to reap it: the /dev/shm files would wait with it."""
    deadline = time.monotonic() + timeout
    left = [p for p in procs if not _ended(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if not _ended(p)]
    return left


def clean(data: dict, skip_pid: int | None = None, grace_s: float = 0.0) -> tuple[list[int], list[str], int]:
    """Kill the recorded processes still running (same pid and start time) after `grace_s` (time
    to end by themselves: Python's resource tracker ends on its own once its clients are gone),
    then remove the recorded shared-memory files and those the killed processes mapped at the end.
    Returns (pids killed, files removed, bytes)."""
    victims = []
    for pid, created in data.get("procs", []):
        if pid == skip_pid:
            continue
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            if abs(p.create_time() - created) < 0.01 and p.status() != psutil.STATUS_ZOMBIE:
                victims.append(p)
    if victims and grace_s > 0:
        victims = wait_ended(victims, grace_s)
    # An engine still starting up makes segments after they were noted (during the grace too):
    # stopped first, what each maps then is all it will ever have made, and goes with it.
    shm = set(data.get("shm", []))
    for p in victims:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGSTOP)
    for p in victims:
        shm |= mapped_shm(p.pid)
    for p in victims:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGKILL)
    wait_ended(victims, 10)
    removed, freed = [], 0
    for entry in shm_files(shm):
        with contextlib.suppress(OSError):
            size = entry.stat(follow_symlinks=False).st_size
            os.unlink(entry.path)
            removed.append(entry.name)
            freed += size
    return [p.pid for p in victims], removed, freed


def _say_cleaned(what: str, pids: list[int], removed: list[str], freed: int) -> str:
    parts = []
    if pids:
        parts.append(f"killed its engine processes still running (pids {', '.join(map(str, pids))})")
    if removed:
        parts.append(
            f"removed {len(removed)} shared-memory files it left in {SHM_DIR} ({freed / 1e6:.0f} MB)"
        )
    return f"{what}: {' and '.join(parts)}"


def clean_leftovers(journal: str | os.PathLike) -> str | None:
    """At the start of `distill-teacher` (holding `<journal>.lock`): what an earlier teacher on this
    journal left running or in /dev/shm, cleaned from its record. Returns the log line, or None
    when there was nothing."""
    record = record_path(journal)
    try:
        data = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    if isinstance(data.get("teacher"), int) and not psutil.pid_exists(data["teacher"]):
        extra = marked(data["teacher"])  # processes the dead reaper never saw
        data["procs"] = sorted({**dict(map(tuple, data.get("procs", []))), **extra}.items())
    pids, removed, freed = clean(data)
    with contextlib.suppress(OSError):
        record.unlink()
    if not pids and not removed:
        return None
    line = _say_cleaned(
        f"the earlier teacher on this journal (pid {data.get('teacher')}) is gone", pids, removed, freed
    )
    log.warning(line)
    return line


def start(journal: str | os.PathLike) -> subprocess.Popen | None:
    """Start the reaper for this process (call right before vLLM starts its engine processes)."""
    record = record_path(journal)
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "teacher.reaper", str(os.getpid()), str(record)],
            stdin=subprocess.DEVNULL,
            close_fds=True,
        )
    except OSError as e:  # never stop a run for it: the next start cleans from the record
        log.warning("could not start the engine reaper (%s): a restart cleans what a crash leaves", e)
        return None


def watch(teacher: int, record: Path) -> int:
    me = os.getpid()
    procs: dict[int, float] = {}
    shm: set[int] = set()
    written = None
    while os.getppid() == teacher:
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(teacher).children(recursive=True):
                if p.pid == me:
                    continue
                with contextlib.suppress(psutil.Error):
                    procs.setdefault(p.pid, p.create_time())
                    shm |= mapped_shm(p.pid)
        data = {"teacher": teacher, "procs": sorted(procs.items()), "shm": sorted(shm)}
        if data != written and procs:
            with contextlib.suppress(OSError):
                _write(record, data)
                written = data
        time.sleep(POLL_S)
    # The teacher is gone (a normal exit leaves nothing to kill: its engine shut down before it).
    # Its processes born since the last look carry its mark in their environment.
    for pid, created in marked(teacher, skip_pid=me).items():
        procs.setdefault(pid, created)
    for pid, created in procs.items():  # what each maps now (segments made since the last look)
        with contextlib.suppress(psutil.Error):
            if abs(psutil.Process(pid).create_time() - created) < 0.01:  # not a reused pid
                shm |= mapped_shm(pid)
    data = {"procs": sorted(procs.items()), "shm": sorted(shm)}
    pids, removed, freed = clean(data, skip_pid=me, grace_s=GRACE_S)
    with contextlib.suppress(OSError):
        record.unlink()
    if pids or removed:
        print(
            f"distill-teacher: {_say_cleaned(f'teacher pid {teacher} is gone', pids, removed, freed)}",
            file=sys.stderr,
            flush=True,
        )
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: outlive the teacher
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(watch(int(sys.argv[1]), Path(sys.argv[2])))

"""Sampling the student's rank process with py-spy while it trains (`gpu_e2e.py --spy`), and what
the samples say: where the training loop's thread spends its time (the Trainer step it is in, and
how much of it is waiting for the collate threads or for samples) and how busy the student's other
threads are (the subscriber, which checks every sample's digest; the collate and digest pools).

py-spy samples without stopping the process (`--nonblocking`), 100 times a second, every thread,
idle ones included (`--idle`), raw stacks: one line per distinct stack, `frame;frame;... count`,
outermost first, each frame `function (file:line)`.
"""

from __future__ import annotations

import collections
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

RATE = 100  # samples a second
# Leaf frames (function names) that are a thread blocked, not working.
WAITS = {"wait", "poll", "select", "get", "acquire", "recv", "sleep", "_worker", "join", "thread"}
LOOP = "Trainer.run"


def py_spy() -> str | None:
    """The py-spy executable: on PATH, or beside this interpreter (a virtual environment's bin)."""
    found = shutil.which("py-spy")
    if found:
        return found
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else None


def rank_pid(root: int) -> int | None:
    """The student rank under `accelerate launch` (pid `root`): the process running student.py
    that is not the launcher itself."""
    import psutil

    try:
        procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.Error:
        return None
    for p in procs:
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "student.py" in cmd and "accelerate" not in cmd:
            return p.pid
    return None


class Spy:
    """py-spy recording one process until it exits (or `finish` stops it)."""

    def __init__(self, exe: str, pid: int, out: Path):
        self.out, self.pid = out, pid
        self.log = open(out.with_suffix(".log"), "wb")
        cmd = [exe, "record", "-p", str(pid), "-r", str(RATE), "--threads", "--idle", "--nonblocking"]
        cmd += ["-f", "raw", "-o", str(out), "-d", "3600"]
        self.p = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def finish(self, grace: float = 20.0) -> dict:
        """Wait for py-spy to write its file (it stops when the process exits), then summarise."""
        deadline = time.monotonic() + grace
        while self.p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        if self.p.poll() is None:  # the target is still alive: py-spy writes its file on SIGINT
            self.p.send_signal(signal.SIGINT)
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
        self.log.close()
        if not self.out.exists() or self.out.stat().st_size == 0:
            tail = self.out.with_suffix(".log").read_text(errors="replace").strip().splitlines()[-1:]
            return {"error": f"py-spy wrote no samples ({tail[0] if tail else 'no output'})"}
        return summarize(self.out)


def _frames(line: str) -> tuple[str, list[str], int] | None:
    """(thread name, function names outermost first, count) of one raw line."""
    stack, _, n = line.rstrip("\n").rpartition(" ")
    if not stack or not n.isdigit():
        return None
    raw = stack.split(";")
    return _thread_name(raw), [f.split(" (")[0] for f in raw], int(n)


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _thread_name(frames: list[str]) -> str:
    """The thread's name from py-spy's `thread (tid): name` frame, its number pools dropped
    (`distill-collate_3` -> `distill-collate`); `thread` when it has none (a native thread)."""
    for f in frames[:3]:
        if f.startswith("thread ("):
            name = f.split("): ", 1)[1] if "): " in f else "thread"
            head, _, tail = name.rpartition("_")
            return head if tail.isdigit() and head else name
    return "thread"


def summarize(raw: Path, top: int = 6) -> dict:
    """The training loop's time by Trainer step and by wait, and the other threads' busy shares.

    loop_s: seconds of samples inside Trainer.run; loop_share: the share of those by the Trainer
    method they were in (fill, forward_backward, optimizer_step, ...); loop_waits: the share spent
    blocked waiting for the collate threads (a Future) or for samples (the delivery queue);
    loop_top: the most frequent innermost frames. threads: per thread name (pools counted
    together), `samples`, `busy` (the share of its samples not blocked) and its top working frames.
    """
    loop: collections.Counter = collections.Counter()
    waits: collections.Counter = collections.Counter()
    leaves: collections.Counter = collections.Counter()
    threads: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    totals: collections.Counter = collections.Counter()
    busy: collections.Counter = collections.Counter()
    n_loop = 0
    with open(raw, errors="replace") as f:
        for line in f:
            parsed = _frames(line)
            if parsed is None:
                continue
            name, frames, n = parsed
            waiting = _leaf(frames[-1]) in WAITS
            if LOOP in frames:
                i = frames.index(LOOP)
                inner = frames[i + 1 :]
                loop[inner[0] if inner else LOOP] += n
                n_loop += n
                leaves[" <- ".join(reversed(inner[-3:])) or LOOP] += n
                if waiting and any(f.endswith("Future.result") or f == "_result_or_cancel" for f in inner):
                    waits["collate threads"] += n
                elif waiting and any(f.endswith("Deliveries.next") or f.endswith("Queue.get") for f in inner):
                    waits["samples"] += n
                elif waiting:
                    waits["other"] += n
                continue
            if name == "MainThread":
                continue  # start-up and the end, outside the loop
            totals[name] += n
            if not waiting:
                busy[name] += n
                threads[name][" <- ".join(reversed(frames[-2:]))] += n
    if not n_loop:
        return {"error": f"no samples inside {LOOP} in {raw.name}"}
    share = {k: round(v / n_loop, 3) for k, v in loop.most_common()}
    return {
        "rate_hz": RATE,
        "loop_s": round(n_loop / RATE, 2),
        "loop_share": share,
        "loop_waits": {k: round(v / n_loop, 3) for k, v in waits.most_common()},
        "loop_top": [[k, round(v / n_loop, 3)] for k, v in leaves.most_common(top)],
        "threads": {
            name: {
                "samples": totals[name],
                "busy": round(busy[name] / totals[name], 3),
                "top": [[k, round(v / totals[name], 3)] for k, v in threads[name].most_common(3)],
            }
            for name in sorted(totals, key=lambda k: -busy[k])
            if name.startswith("distill-") or busy[name]
        },
    }


def main(argv: list[str] | None = None) -> int:
    """`python benchmarks/benchlib/spy.py RAW`: the summary of a raw py-spy file, as JSON."""
    import json

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not os.path.exists(argv[0]):
        print("usage: spy.py RAW_PY_SPY_FILE", file=sys.stderr)
        return 2
    print(json.dumps(summarize(Path(argv[0])), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The benchmarks' processes: `Proc` (a process tree with a log file, stopped as a whole), the
environment of child processes, free ports, the accelerate launcher, `run_child` (gpu_e2e.py run
again as a child: the bare loop, the student probe), signals as `Interrupted`, the commit stamp."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
E2E_SCRIPT = REPO / "benchmarks" / "gpu_e2e.py"  # run_child runs it again as a child


def log(*a):
    print(f"[gpu_e2e {time.strftime('%H:%M:%S')}]", *a, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_launcher(mixed_precision: str) -> list[str]:
    """`accelerate launch` with one process on this host (the command before the script)."""
    return [
        *(sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1"),
        *("--mixed_precision", mixed_precision, "--dynamo_backend", "no"),
        *("--main_process_port", str(free_port())),
    ]


def child_env(tiny: bool) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    if tiny:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("VLLM_HOST_IP", "127.0.0.1")
    else:
        env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    return env


def tree_pids(pid: int) -> list[int]:
    try:
        import psutil

        p = psutil.Process(pid)
        return [pid] + [c.pid for c in p.children(recursive=True)]
    except Exception:
        return [pid]


class Proc:
    """A child in its own session; stopped with its whole process tree."""

    def __init__(self, name: str, cmd: list[str], log_path: Path, env: dict):
        self.name, self.log_path = name, log_path
        self.f = open(log_path, "wb")
        self.t_start = time.time()
        self.p = subprocess.Popen(
            cmd, stdout=self.f, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
        )
        self.t_end: float | None = None
        self.killed = False
        self._pids: set[int] = {self.p.pid}

    def poll(self):
        rc = self.p.poll()
        if rc is None:
            self._pids.update(tree_pids(self.p.pid))  # remember grandchildren (own sessions too)
        elif self.t_end is None:
            self.t_end = time.time()
        return rc

    def stop(self, first=signal.SIGINT, grace: float = 20.0) -> None:
        """`first` to the tree, then SIGKILL to whatever is left after `grace` seconds."""
        if self.poll() is None:
            self.killed = True
            self._signal(first)
            deadline = time.monotonic() + grace
            while self.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
        self._signal(signal.SIGKILL)  # leftovers (engine core, ranks), also after a clean exit
        try:
            self.p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.poll()
        self.f.close()

    def _signal(self, sig) -> None:
        pids = set(self._pids)
        if self.p.poll() is None:
            pids.update(tree_pids(self.p.pid))
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            os.killpg(self.p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class Interrupted(Exception):
    pass


def on_signal(signum, frame):
    raise Interrupted(signal.Signals(signum).name)


def run_child(
    args, kind: str, extra: list[str], env: dict, timeout: float, log_path: Path, launcher=None
) -> dict:
    out = log_path.with_suffix(".json")
    out.unlink(missing_ok=True)
    cmd = (launcher or [sys.executable]) + [str(E2E_SCRIPT), "--child", kind, "--child-out", str(out)] + extra
    p = Proc(kind, cmd, log_path, env)
    deadline = time.monotonic() + timeout
    while p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    timed_out = p.poll() is None
    p.stop(signal.SIGTERM, grace=5)
    if out.exists():
        return json.loads(out.read_text())
    tail = log_path.read_text(errors="replace")[-1500:] if log_path.exists() else ""
    return {
        "error": f"{kind} child {'timed out' if timed_out else f'exit {p.p.returncode}'}",
        "log_tail": tail,
    }


def git_commit() -> str | None:
    stamp = REPO / "COMMIT"  # a snapshot (git archive) carries its commit here
    if stamp.exists():
        return stamp.read_text().strip()
    try:
        return (
            subprocess.run(
                ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or None
        )
    except Exception:
        return None

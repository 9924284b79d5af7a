"""The e2e phase of benchmarks/gpu_e2e.py: distill-teacher and the Accelerate student together on
one GPU (`run_e2e`), and the student alone on the GPU, served from a spool (`run_alone`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

from benchlib.e2e_results import STEP_LINE, read_results
from benchlib.procs import REPO, Proc, accelerate_launcher, child_env, free_port, log
from benchlib.runfile import apply_sets, use_port, variant_label
from benchlib.spy import Spy, rank_pid
from benchlib.student_probe import write_synthetic_spool

ENGINE_READY = re.compile(rb"init engine \(profile")


BAR_START = re.compile(rb"\| *0/\d+ \[[^\]\r\n]*sample/s")


def run_e2e(args, work: Path, cfg_path: Path, cfg: dict, res: dict) -> None:
    env = child_env(args.tiny)
    student_env = dict(env)
    if args.tiny:
        student_env["OMP_NUM_THREADS"] = "1"
    student_cmd = [
        *accelerate_launcher(cfg["student"].get("mixed_precision", "no")),
        str(REPO / "student.py"),
        "--config",
        str(cfg_path),
    ]
    teacher_cmd = [sys.executable, "-m", "teacher.cli", "--config", str(cfg_path)]
    t0 = time.time()
    student = Proc("student", student_cmd, work / "student.log", student_env)
    teacher = Proc("teacher", teacher_cmd, work / "teacher.log", env)
    res["cmd_student"] = " ".join(student_cmd[1:])
    res["cmd_teacher"] = " ".join(teacher_cmd[1:])
    log(f"teacher pid {teacher.p.pid}, student pid {student.p.pid}; logs {work}/teacher.log student.log")
    spy = None  # --spy: py-spy on the student's rank once it runs
    t_gen = t_bar = None
    pos = 0
    ended_well_at = None
    reason = "both exited"
    deadline = time.monotonic() + args.timeout
    last_note = 0.0
    try:
        while True:
            if t_gen is None:
                with open(teacher.log_path, "rb") as f:
                    f.seek(max(0, pos - 64))
                    chunk = f.read()
                    pos = f.tell()
                if t_bar is None and BAR_START.search(chunk):
                    t_bar = time.time()
                if ENGINE_READY.search(chunk):
                    t_gen = time.time()
                    log(f"teacher engine ready after {t_gen - t0:.1f}s")
            rt, rs = teacher.poll(), student.poll()
            if rt is not None and rs is not None:
                break
            if args.spy and spy is None and rs is None:
                pid = rank_pid(student.p.pid)
                if pid is not None:
                    spy = Spy(args.spy_exe, pid, work / "spy_student.txt")
            t_ok = rt in (0, 4)  # 4: the teacher finished with bad rows skipped
            t_bad = rt is not None and not t_ok
            s_bad = rs not in (None, 0)
            if t_bad or s_bad:
                reason = f"{'teacher' if t_bad else 'student'} failed (exit {rt if t_bad else rs})"
                log(reason + ": stopping the other side")
                time.sleep(2.0)
                break
            if (t_ok or rs == 0) and ended_well_at is None:
                ended_well_at = time.monotonic()
                log(
                    f"{'teacher' if t_ok else 'student'} exited {rt if t_ok else 0}; the other gets {args.grace_s:.0f}s"
                )
            if ended_well_at is not None and time.monotonic() - ended_well_at > args.grace_s:
                reason = f"{'student' if t_ok else 'teacher'} still running {args.grace_s:.0f}s after the other ended"
                log(reason + ": stopping it")
                break
            if time.monotonic() > deadline:
                reason = f"timeout after {args.timeout:.0f}s"
                log(reason)
                break
            if time.monotonic() - last_note > 15:
                last_note = time.monotonic()
                log(f"{time.time() - t0:5.0f}s  {progress_note(work)}")
            time.sleep(0.2)
    finally:
        teacher.stop(signal.SIGINT, grace=20)
        student.stop(signal.SIGTERM, grace=10)
    if args.spy:
        res["spy"] = spy.finish() if spy is not None else {"error": "the student's rank was never seen"}
    res["e2e_end_reason"] = reason
    res["teacher_rc"] = teacher.p.returncode
    res["t_teacher_exit"] = teacher.t_end
    res["student_rc"] = student.p.returncode
    res["teacher_killed"] = teacher.killed
    res["student_killed"] = student.killed
    res["teacher_proc_s"] = round((teacher.t_end or time.time()) - teacher.t_start, 2)
    res["student_proc_s"] = round((student.t_end or time.time()) - student.t_start, 2)
    res["t_launch"] = t0
    res["t_teacher_generating"] = t_gen or t_bar
    res["t_teacher_generating_from"] = (
        "vLLM engine ready line" if t_gen else ("progress bar" if t_bar else None)
    )


ALONE_KEYS = (
    "student_tok_s",
    "student_samples_s",
    "student_train_s",
    "student_steps",
    "student_wait_s",
    "student_wait_after_first_step_s",
    "samples_expected",
    "samples_trained",
    "samples_twice",
    "samples_missing",
    "samples_sent",
    "samples_replayed_from_spool",
    "teacher_rc",
    "student_rc",
    "e2e_end_reason",
    "student_first_step_after_launch_s",
    "student_loss_first_last",
    "spy",
)


def run_alone(args, work: Path, cfg: dict, spool: str, expected: list[str], res: dict) -> Path | None:
    """The student with the GPU to itself, fed by the real stream: distill-teacher first generates
    into its spool with nobody connected (`after_generation: exit`; with --alone-synthetic the
    spool is written directly: random states over the dataset's own token ids, no vLLM), then a
    second distill-teacher (no engine: everything is spooled) serves the spool to `accelerate
    launch student.py`. Once per --alone-set variant, each on hard links to the same spool files
    (a serve removes what it served). Returns the folder holding the first variant's student
    metrics.json (None when it did not finish)."""
    import yaml

    src_dir = work / "alone_src"
    shutil.rmtree(src_dir, ignore_errors=True)
    src_dir.mkdir(parents=True)
    src_spool = spool + "_alone_src"
    shutil.rmtree(src_spool, ignore_errors=True)
    base = json.loads(json.dumps(cfg))
    base["teacher"]["journal"] = str(src_dir / "journal.txt")
    base["spool"]["dir"] = src_spool
    env = child_env(args.tiny)
    t = time.monotonic()
    if args.alone_synthetic:
        (src_dir / "run.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        n = write_synthetic_spool(src_dir / "run.yaml", Path(src_spool), len(expected))
        rc = 0 if n == len(expected) else 1
        res["alone_spool_from"] = "synthetic (random bf16 states over the dataset's token ids; no vLLM)"
    else:
        gcfg = json.loads(json.dumps(base))
        gcfg["teacher"]["after_generation"] = "exit"
        gcfg["transport"]["connect_timeout_s"] = 0  # nobody will connect: spool at once
        use_port(gcfg, free_port())
        (src_dir / "generate.yaml").write_text(yaml.safe_dump(gcfg, sort_keys=False))
        gen = Proc("teacher-generate", [sys.executable, "-m", "teacher.cli", "--config", str(src_dir / "generate.yaml")],
                   src_dir / "teacher_generate.log", env)  # fmt: skip
        deadline = time.monotonic() + args.timeout
        try:
            while gen.poll() is None and time.monotonic() < deadline:
                time.sleep(0.5)
        finally:
            gen.stop(signal.SIGINT, grace=20)
        rc = gen.p.returncode
        res["alone_spool_from"] = "distill-teacher (vLLM) with nobody connected"
    res["alone_generate_rc"] = rc
    res["alone_generate_s"] = round(time.monotonic() - t, 1)
    files = sorted(Path(src_spool).rglob("*.safetensors"))
    res["alone_spooled_files"] = len(files)
    res["alone_spooled_bytes"] = sum(f.stat().st_size for f in files)
    log(f"alone: {len(files)} samples spooled in {res['alone_generate_s']}s (exit {rc})")
    if rc != 0:
        return None
    runs = []
    first = None
    for i, variant in enumerate(args.alone_set or [""]):
        if i and time.monotonic() > args.deadline - 90:
            log(f"alone: variant {variant!r} skipped (budget)")
            break
        aw = work / ("alone" if i == 0 else f"alone_{i}")
        shutil.rmtree(aw, ignore_errors=True)
        aw.mkdir(parents=True)
        aspool = f"{spool}_alone{i}"
        shutil.rmtree(aspool, ignore_errors=True)
        for f in files:  # the serve removes files on ack: each variant gets its own links
            dst = Path(aspool) / f.relative_to(src_spool)
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.link(f, dst)
        for j in src_dir.glob("journal.txt*"):  # the generating run's id, no commits
            if j.is_file() and not j.name.endswith((".lock", ".summary.json")):  # (not .verify/)
                shutil.copy(j, aw / j.name)
        acfg = json.loads(json.dumps(base))
        acfg["teacher"]["journal"] = str(aw / "journal.txt")
        acfg["student"]["output_dir"] = str(aw / "student")
        acfg["spool"]["dir"] = aspool
        use_port(acfg, free_port())
        apply_sets(acfg, [variant])
        (aw / "run.yaml").write_text(yaml.safe_dump(acfg, sort_keys=False))
        sub: dict = {"spool_dir": aspool}
        run_e2e(args, aw, aw / "run.yaml", acfg, sub)
        read_results(args, aw, sub, expected)
        shutil.rmtree(aspool, ignore_errors=True)
        figures = {k: sub.get(k) for k in ALONE_KEYS}
        figures.update(ring_full(aw / "teacher.log"))
        runs.append({"variant": variant_label(variant, args.set), **figures})
        log(
            f"alone [{runs[-1]['variant']}]: student {figures['student_tok_s']} tok/s, trained {figures['samples_trained']}"
        )
        if i == 0:
            res["alone"] = figures
            res["student_alone_tok_s"] = sub.get("student_tok_s")
            if (aw / "student" / "metrics.json").exists():
                first = aw / "student"
    res["alone_runs"] = runs
    shutil.rmtree(src_spool, ignore_errors=True)
    return first


def ring_full(teacher_log: Path) -> dict:
    """Whether the serving teacher's shared-memory ring ran out of room: its one warning, and the
    largest count of same-host sends in frames its serve lines showed ("ring full Nx")."""
    text = teacher_log.read_text(errors="replace") if teacher_log.exists() else ""
    counts = [int(n) for n in re.findall(r"ring full (\d+)x", text)]
    return {
        "teacher_ring_full_said": "shared-memory ring full (" in text,
        "teacher_ring_full_sends_seen": max(counts, default=0),
    }


def progress_note(work: Path) -> str:
    j = work / "journal.txt"
    n = 0
    if j.exists():
        n = sum(1 for line in j.read_text(errors="replace").splitlines() if line and not line.startswith("!"))
    last = ""
    sl = work / "student.log"
    if sl.exists():
        m = list(STEP_LINE.finditer(sl.read_bytes()[-4000:].decode(errors="replace")))
        if m:
            last = f"; student step {m[-1].group('step')}"
    return f"journal {n} keys{last}"

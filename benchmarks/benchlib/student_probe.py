"""The student loop under timers (benchmarks/gpu_e2e.py --profile, a child launched by
accelerate): a synthetic spool, the real student loop with timers around each phase and a
torch.profiler window; and the loop probe (the real loop from memory per variant)."""

from __future__ import annotations

import collections
import json
import os
import shutil
import sys
import time
from pathlib import Path

from benchlib.bare_loop import token_lengths
from benchlib.procs import accelerate_launcher, free_port, log, run_child
from benchlib.runfile import apply_sets, use_port, variant_label


def write_synthetic_spool(cfg_path: Path, spool: Path, n: int) -> int:
    """n spool files shaped like the teacher's samples (random bf16 states, the dataset's ids)."""
    import torch

    from distill.config import load_run_file
    from distill.protocol import Sample
    from distill.spool import write_sample
    from teacher.config import model_config

    run = load_run_file(str(cfg_path), {})
    layers = list(run.teacher["layer_ids"])
    hidden = model_config(run.teacher["model"])["hidden_size"]
    dtype = torch.float32 if run.teacher.get("dtype") == "float32" else torch.bfloat16
    ids = token_lengths(cfg_path)
    if spool.exists():
        shutil.rmtree(spool)
    max_t = max(len(v) for v in ids.values())
    g = torch.Generator().manual_seed(0)
    base = torch.randn(max_t, len(layers), hidden, generator=g).to(dtype)
    for k, v in list(ids.items())[:n]:
        write_sample(
            spool,
            Sample(
                key=k,
                tensors={
                    "hidden_states": base[: len(v)].clone(),
                    "token_ids": torch.tensor(v, dtype=torch.int64),
                },
                layers=layers,
                meta={"prompt_tokens": len(v)},
            ),
        )
    return min(n, len(ids))


def profile_stream_config(cfg: dict, work: Path, n: int, spool: Path) -> dict:
    """run.yaml for `--profile-source stream`: a distill-teacher whose dataset is the n rows the
    synthetic spool holds (so it has nothing to generate and starts no engine) serves that spool to
    the profiled student over the run's transport (shared memory on the same host)."""
    pcfg = json.loads(json.dumps(cfg))
    rows = [line for line in Path(cfg["teacher"]["dataset"]).read_text().splitlines() if line.strip()][:n]
    serve = work / "profile_serve"
    shutil.rmtree(serve, ignore_errors=True)
    serve.mkdir(parents=True)
    (serve / "data.jsonl").write_text("\n".join(rows) + "\n")
    pcfg["teacher"].update(dataset=str(serve / "data.jsonl"), journal=str(serve / "journal.txt"))
    pcfg["spool"]["dir"] = str(spool)
    use_port(pcfg, free_port())
    return pcfg


def child_loop_probe(args) -> None:
    """student.train.training_function over a spool read into memory before the loop starts: what
    is timed is the loop and the GPU, not a source (a live stream hands over shared-memory views,
    as cheap as this)."""
    import logging

    import student.train as st
    from student.sources import SpoolSource

    class MemorySource(SpoolSource):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            if self._it is not None:
                self._it = iter(list(self._it))  # every file read now

    st.SpoolSource = MemorySource
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    cfg, run = st.load_student_config(args.config, [])
    keep = st.training_function(cfg, run)  # noqa: F841 (held until os._exit, as student.train.main)
    m = json.loads((Path(cfg.output_dir) / "metrics.json").read_text())
    steps = m.get("steps", [])
    res = {"probe_steps": len(steps), "probe_samples": m.get("summary", {}).get("samples")}
    if len(steps) > 1:
        dt_s = steps[-1]["time"] - steps[0]["time"]
        res["probe_loop_tok_s"] = round(sum(x["tokens"] for x in steps[1:]) / max(dt_s, 1e-9), 1)
        res["probe_loop_s"] = round(dt_s, 3)
    Path(args.child_out).write_text(json.dumps(res))
    sys.stdout.flush()
    os._exit(0)


def run_probe(args, work: Path, cfg: dict, spool: str, env: dict, res: dict, deadline: float) -> None:
    """The loop probe: one synthetic spool, the real loop from memory per variant, then the bare
    loop over the first variant's batches."""
    import yaml

    pspool = Path(spool + "_probe")
    cfg_path = work / "run.yaml"
    res["probe_synthetic_samples"] = write_synthetic_spool(cfg_path, pspool, args.profile_samples)
    variants = args.probe_set or [""]
    out: list[dict] = []
    for i, v in enumerate(variants):
        if time.monotonic() > deadline - 60:
            break
        pcfg = json.loads(json.dumps(cfg))
        pcfg["student"].update(mode="spool", spool_dir=str(pspool), output_dir=str(work / f"probe_{i}"))
        apply_sets(pcfg, [v], prefix="student.")
        ppath = work / f"probe_{i}.yaml"
        ppath.write_text(yaml.safe_dump(pcfg, sort_keys=False))
        launcher = accelerate_launcher(pcfg["student"]["mixed_precision"])
        left = min(300.0, deadline - time.monotonic())
        r = run_child(
            args, "loop-probe", ["--config", str(ppath)], env, left, work / f"probe_{i}.log", launcher
        )
        r["variant"] = variant_label(v, args.set)
        out.append(r)
        log(f"probe {r['variant']}: {r.get('probe_loop_tok_s')} tok/s")
    res["probe"] = out
    first = work / "probe_0" / "metrics.json"
    if first.exists() and time.monotonic() < deadline - 60:
        bare = run_child(
            args,
            "bare",
            [
                "--config",
                str(work / "probe_0.yaml"),
                "--metrics",
                str(first),
                "--bare-max-s",
                str(args.bare_max_s),
            ],
            env,
            min(300.0, deadline - time.monotonic()),
            work / "probe_bare.log",
        )
        res["probe_bare_loop_tok_s"] = bare.get("bare_loop_tok_s")
        res["probe_bare"] = {k: v for k, v in bare.items() if k.startswith("bare_") or k == "error"}
        for r in out:
            if r.get("probe_loop_tok_s") and bare.get("bare_loop_tok_s"):
                r["vs_bare"] = round(r["probe_loop_tok_s"] / bare["bare_loop_tok_s"], 4)
    shutil.rmtree(pspool, ignore_errors=True)


def child_profile_student(args) -> None:
    """Runs student.train.training_function with timers around its phases (patched in)."""
    import logging

    import torch
    from accelerate import Accelerator

    import student.data as sdata
    import student.loop as sloop
    import student.train as st
    from student.recipes.distill import Distill

    cuda = torch.cuda.is_available()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    times = collections.defaultdict(float)
    counts = collections.Counter()
    marks = {"first": None, "last": None}
    prof_box = {"prof": None, "iters": 0}

    def timed(name, fn, sync_before=True, on_call=None):
        def wrapper(*a, **kw):
            if on_call:
                on_call()
            if sync_before:
                sync()
            t = time.perf_counter()
            if marks["first"] is None:
                marks["first"] = t
            try:
                return fn(*a, **kw)
            finally:
                sync()
                times[name] += time.perf_counter() - t
                counts[name] += 1
                marks["last"] = time.perf_counter()

        wrapper.__wrapped__ = fn
        return wrapper

    def step_profiler():
        prof_box["iters"] += 1
        if prof_box["prof"] is not None:
            prof_box["prof"].step()

    patched = []
    for mod, name, label, extra in (
        (sloop, "next_micro_batch", "fill (source.get + batching)", step_profiler),
        (sloop, "check_sample", "check_sample", None),
        (sloop, "collate", "collate (host)", None),
        (Distill, "loss", "forward + loss", None),
    ):
        fn = getattr(mod, name, None)
        if fn is not None:
            setattr(mod, name, timed(label, fn, on_call=extra))
            patched.append(name)
    if hasattr(sdata.Batch, "to"):
        sdata.Batch.to = timed("host-to-device copy", sdata.Batch.to)
        patched.append("Batch.to")
    Accelerator.backward = timed("backward", Accelerator.backward)
    Accelerator.reduce = timed("reduce (collective + .cpu())", Accelerator.reduce)
    Accelerator.clip_grad_norm_ = timed("clip_grad_norm", Accelerator.clip_grad_norm_)
    try:
        from accelerate.optimizer import AcceleratedOptimizer

        AcceleratedOptimizer.step = timed("optimizer.step", AcceleratedOptimizer.step)
        AcceleratedOptimizer.zero_grad = timed("zero_grad", AcceleratedOptimizer.zero_grad)
    except Exception:
        pass
    patched += ["Accelerator.backward", "Accelerator.reduce", "clip_grad_norm_", "optimizer.step"]

    prof = None
    try:
        from torch.profiler import ProfilerActivity, profile, schedule

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        prof = profile(activities=acts, schedule=schedule(wait=6, warmup=1, active=4, repeat=1))
        prof.__enter__()
        prof_box["prof"] = prof
    except Exception as e:  # the timers still work
        print(f"profile-student: no torch.profiler: {e}", flush=True)

    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    cfg, run = st.load_student_config(args.config, [])
    t0 = time.perf_counter()
    keep = st.training_function(cfg, run)  # noqa: F841 (held until os._exit, as student.train.main)
    t_end = time.perf_counter()
    tables = {}
    if prof is not None:
        try:
            prof.__exit__(None, None, None)
            ka = prof.key_averages()
            sort_dev = "self_cuda_time_total" if cuda else "self_cpu_time_total"
            tables["by_device_time"] = ka.table(sort_by=sort_dev, row_limit=30, max_name_column_width=60)
            tables["by_cpu_time"] = ka.table(
                sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60
            )
        except Exception as e:
            tables["error"] = repr(e)
    loop_s = (marks["last"] or t_end) - (marks["first"] or t0)
    m = json.loads((Path(cfg.output_dir) / "metrics.json").read_text())
    steps = m.get("steps", [])
    tok = sum(s["tokens"] for s in steps)
    accounted = sum(times.values())
    n_steps = max(len(steps), 1)
    res = {
        "profile_steps": len(steps),
        "profile_samples": m.get("summary", {}).get("samples"),
        "profile_tokens": tok,
        "profile_loop_s": round(loop_s, 3),
        "profile_tok_s_with_sync_timers": round(tok / max(loop_s, 1e-9), 1),
        "profile_ms_per_step": {
            k: round(1000 * v / n_steps, 2) for k, v in sorted(times.items(), key=lambda x: -x[1])
        },
        "profile_share": {
            k: round(v / max(loop_s, 1e-9), 3) for k, v in sorted(times.items(), key=lambda x: -x[1])
        },
        "profile_unaccounted_ms_per_step": round(1000 * (loop_s - accounted) / n_steps, 2),
        "profile_calls": dict(counts),
        "profile_patched": patched,
        "profile_iterations": prof_box["iters"],
        "profile_setup_s": round((marks["first"] or t0) - t0, 2),
    }
    Path(args.child_out).write_text(json.dumps({"result": res, "tables": tables}, indent=1))
    sys.stdout.flush()
    os._exit(0)

"""The student loop under torch.profiler with no synchronising timers (`gpu_e2e.py --profile
--profile-trace`): where the GPU waits for the host.

The real loop runs unchanged except that its phases (the Trainer methods) are marked with
`record_function` (host-side ranges, no synchronisation) and the profiler steps once per fill. From
the Chrome trace of a window of iterations, `summarize`:

* `gpu_busy`: the share of the window in which some kernel, copy or memset runs on the GPU;
* per phase (`phases`): its host time per iteration and the share of it during which the GPU was
  busy (a phase the GPU idles through is one the step waits on);
* `runtime`: the CUDA runtime / driver calls by total host time (a synchronisation, a pinned or
  device allocation shows here);
* `gaps`: the longest GPU idle stretches and the phase the loop's thread was in at their middle.
"""

from __future__ import annotations

import bisect
import collections
import gzip
import json
from pathlib import Path

PHASES = ("fill", "agree_flags", "agree_keys", "forward_backward", "optimizer_step", "settle")
MARK = "loop."  # record_function names: loop.<phase>
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
RUNTIME_CATS = {"cuda_runtime", "cuda_driver"}


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _covered(busy: list[tuple[float, float]], starts: list[float], a: float, b: float) -> float:
    """Microseconds of [a, b] inside the sorted disjoint intervals `busy` (`starts`: their starts)."""
    total = 0.0
    i = max(bisect.bisect_right(starts, a) - 1, 0)
    while i < len(busy) and busy[i][0] < b:
        lo, hi = max(a, busy[i][0]), min(b, busy[i][1])
        if hi > lo:
            total += hi - lo
        i += 1
    return total


def summarize(events: list[dict], top: int = 8) -> dict:
    """What a Chrome trace of the loop says (see the module doc). Times in the trace: microseconds."""
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]
    # host ranges only: the profiler also draws each range on the GPU's timeline (gpu_user_annotation)
    host = [e for e in spans if e.get("cat") != "gpu_user_annotation"]
    steps = [e for e in host if str(e.get("name", "")).startswith("ProfilerStep#")]
    marks = [e for e in host if str(e.get("name", "")).startswith(MARK)]
    if not marks:
        return {"error": "no loop phases in the trace"}
    t0 = min(e["ts"] for e in (steps or marks))
    t1 = max(e["ts"] + e["dur"] for e in (steps or marks))
    window = max(t1 - t0, 1e-9)
    gpu = _union([(e["ts"], e["ts"] + e["dur"]) for e in spans if e.get("cat") in GPU_CATS])
    gpu = [(max(a, t0), min(b, t1)) for a, b in gpu if b > t0 and a < t1]
    starts = [a for a, _ in gpu]
    busy = sum(b - a for a, b in gpu)
    iters = max(len(steps), 1)
    phases: dict[str, dict] = {}
    per = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for e in marks:
        name = e["name"][len(MARK) :]
        a, b = e["ts"], e["ts"] + e["dur"]
        per[name][0] += e["dur"]
        per[name][1] += _covered(gpu, starts, a, b)
        per[name][2] += 1
    for name, (host_us, cov, n) in sorted(per.items(), key=lambda x: -x[1][0]):
        phases[name] = {
            "ms_per_iter": round(host_us / 1000 / iters, 2),
            "share_of_window": round(host_us / window, 3),
            "gpu_busy_during": round(cov / max(host_us, 1e-9), 3),
            "calls": n,
        }
    runtime = collections.Counter()
    calls = collections.Counter()
    for e in spans:
        if e.get("cat") in RUNTIME_CATS and t0 <= e["ts"] <= t1:
            runtime[e["name"]] += e["dur"]
            calls[e["name"]] += 1
    idle = [(a, b) for (_, a), (b, _) in zip(gpu, gpu[1:], strict=False)]
    if gpu:
        idle = [(t0, gpu[0][0]), *idle, (gpu[-1][1], t1)]
    idle = sorted((g for g in idle if g[1] > g[0]), key=lambda g: g[0] - g[1])[:top]
    marks_sorted = sorted(marks, key=lambda e: e["ts"])

    def phase_at(t: float) -> str:
        inside = [e["name"][len(MARK) :] for e in marks_sorted if e["ts"] <= t <= e["ts"] + e["dur"]]
        return inside[-1] if inside else "between phases"

    return {
        "window_ms": round(window / 1000, 2),
        "iterations": len(steps),
        "ms_per_iter": round(window / 1000 / iters, 2),
        "gpu_busy": round(busy / window, 3),
        "gpu_idle_ms_per_iter": round((window - busy) / 1000 / iters, 2),
        "phases": phases,
        "runtime": {
            k: {"ms_per_iter": round(v / 1000 / iters, 3), "calls": calls[k]}
            for k, v in runtime.most_common(top)
        },
        "gaps": [{"ms": round((b - a) / 1000, 3), "phase": phase_at((a + b) / 2)} for a, b in idle],
    }


def load(path: Path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def child_trace_student(args) -> None:
    """student.train.training_function with its phases marked and a profiler window of
    iterations `wait`..`wait + active`; writes {"result": {...}, "trace": path} to args.child_out."""
    import logging
    import os
    import sys

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    import student.loop as sloop
    import student.train as st

    cuda = torch.cuda.is_available()
    box = {"prof": None, "iters": 0}

    def marked(name, fn):
        def wrapper(*a, **kw):
            with record_function(MARK + name):
                return fn(*a, **kw)

        wrapper.__wrapped__ = fn
        return wrapper

    for name in PHASES:
        fn = getattr(sloop.Trainer, name, None)
        if fn is not None:
            setattr(sloop.Trainer, name, marked(name, fn))
    fill = sloop.Trainer.fill

    def stepping_fill(self, *a, **kw):  # one profiler step per iteration, before its fill
        box["iters"] += 1
        if box["prof"] is not None:
            box["prof"].step()
        return fill(self, *a, **kw)

    sloop.Trainer.fill = stepping_fill
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(
        activities=acts, schedule=schedule(wait=args.trace_wait, warmup=2, active=args.trace_active, repeat=1)
    )
    prof.__enter__()
    box["prof"] = prof
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    cfg, run = st.load_student_config(args.config, [])
    keep = st.training_function(cfg, run)  # noqa: F841 (held until os._exit, as student.train.main)
    prof.__exit__(None, None, None)
    out = Path(args.child_out)
    trace = out.with_name("trace.json.gz")
    res: dict = {"trace_iterations_seen": box["iters"], "trace_gpu": cuda}
    metrics = Path(cfg.output_dir) / "metrics.json"
    if metrics.exists():  # the run itself: samples trained and its steps' rate
        m = json.loads(metrics.read_text())
        steps = m.get("steps", [])
        res["trace_samples"] = m.get("summary", {}).get("samples")
        if len(steps) > 1:
            dt = max(steps[-1]["time"] - steps[0]["time"], 1e-9)
            res["trace_loop_tok_s"] = round(sum(x["tokens"] for x in steps[1:]) / dt, 1)
    try:
        raw = out.with_name("trace.json")
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(trace, "wb") as dst:
            dst.write(src.read())
        raw.unlink()
        res.update(summarize(load(trace)))
    except Exception as e:  # noqa: BLE001 (the run's own result still stands)
        res["error"] = f"trace: {e!r}"
    out.write_text(json.dumps({"result": res, "trace": str(trace)}, indent=1))
    sys.stdout.flush()
    os._exit(0)

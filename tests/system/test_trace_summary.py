"""benchmarks/benchlib/trace.py's summary of a torch.profiler Chrome trace (no processes): how busy
the GPU is in the window and during each loop phase, the runtime calls and the longest idle gaps."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("trace_bench", ROOT / "benchmarks" / "benchlib" / "trace.py")
trace = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trace)


def x(name: str, ts: float, dur: float, cat: str = "cpu_op") -> dict:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat}


def test_busy_share_per_phase_runtime_calls_and_gaps():
    # Two iterations of 100 us: fill 0-30 (GPU idle but for 10 us), forward_backward 30-100 (GPU
    # busy 35-95, two overlapping kernels); then the same shifted by 100.
    ev = []
    for k in range(2):
        o = 100 * k
        ev += [
            x(f"ProfilerStep#{k}", o, 100, "user_annotation"),
            x("loop.fill", o, 30, "user_annotation"),
            x("loop.forward_backward", o + 30, 70, "user_annotation"),
            x("loop.forward_backward", o + 35, 60, "gpu_user_annotation"),  # its GPU copy: not a phase
            x("gemm", o + 35, 40, "kernel"),
            x("gemm2", o + 60, 35, "kernel"),  # overlaps the first: counted once
            x("Memcpy HtoD", o + 10, 10, "gpu_memcpy"),
            x("cudaLaunchKernel", o + 31, 2, "cuda_runtime"),
            x("cudaStreamSynchronize", o + 90, 8, "cuda_runtime"),
        ]
    ev.append({"ph": "i", "name": "marker", "ts": 5})  # not a span: ignored
    s = trace.summarize(ev, top=3)
    assert s["iterations"] == 2 and s["window_ms"] == 0.2 and s["ms_per_iter"] == 0.1
    assert s["gpu_busy"] == 0.7  # (10 + 60) of each 100
    assert s["gpu_idle_ms_per_iter"] == 0.03
    assert s["phases"]["fill"] == {
        "ms_per_iter": 0.03,
        "share_of_window": 0.3,
        "gpu_busy_during": 0.333,
        "calls": 2,
    }
    assert s["phases"]["forward_backward"]["gpu_busy_during"] == round(60 / 70, 3)
    assert s["phases"]["forward_backward"]["calls"] == 2
    assert list(s["runtime"]) == ["cudaStreamSynchronize", "cudaLaunchKernel"]
    assert s["runtime"]["cudaStreamSynchronize"] == {"ms_per_iter": 0.008, "calls": 2}
    # the longest idle stretches: 20-35, 95-110, 120-135 (before them 0-10 and 195-200); the loop's
    # thread is in fill at the middle of each
    assert s["gaps"] == [{"ms": 0.015, "phase": "fill"}] * 3


def test_a_trace_without_the_loops_marks_says_so():
    assert trace.summarize([x("gemm", 0, 5, "kernel")]) == {"error": "no loop phases in the trace"}

"""benchmarks/soak.py's verdicts from a time series (no processes): what counts as the steady
window (after warm-up, while the teacher generates), `flat`, and RSS's slope per sample."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("soak_bench", ROOT / "benchmarks" / "soak.py")
soak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(soak)

MB = 1 << 20


def series(rss, fds=None, phase=None, samples=1000):
    """One process "p" looked at len(rss) times while `samples` get committed evenly."""
    n = len(rss)
    pts = []
    for i, r in enumerate(rss):
        pts.append(
            {
                "t": float(i),
                "committed": int(samples * i / n),
                "phase": phase[i] if phase else "generate",
                "procs": {
                    "p": {
                        "pid": 1,
                        "rss": r,
                        "fds": fds[i] if fds else 10,
                        "threads": 4,
                        "shm_files": 1,
                        "shm_bytes": 0,
                    }
                },
            }
        )
    return pts


def test_warmup_growth_is_not_counted_and_flat_holds():
    rss = [100 * MB, 300 * MB] + [400 * MB] * 18  # start-up growth falls in the first 15%
    rec = soak.summarize(series(rss), 1000, 0.15)["p"]
    assert rec["flat"] and rec["rss"]["start"] == 400 * MB and rec["rss_per_sample"] == 0


def test_steady_growth_beyond_ten_percent_is_not_flat_and_has_a_slope():
    rss = [400 * MB + i * MB * 5 for i in range(20)]  # +5 MB per look = +100 MB per 1000 samples
    rec = soak.summarize(series(rss), 1000, 0.15)["p"]
    assert not rec["flat"]
    assert abs(rec["rss_per_sample"] - 100 * MB / 1000) < 1


def test_a_count_may_move_by_two_and_the_serve_phase_is_left_out():
    fds = [10] * 10 + [12] + [10] * 5 + [40] * 4  # a momentary +2; then the serve phase
    phase = ["generate"] * 16 + ["serve"] * 4
    rec = soak.summarize(series([400 * MB] * 20, fds=fds, phase=phase), 1000, 0.15)["p"]
    assert rec["flat"] and rec["fds"]["max"] == 12
    assert rec["last"]["fds"] == 40  # still reported as the process's last look
    fds[12] = 14  # beyond 10% + 2
    assert not soak.summarize(series([400 * MB] * 20, fds=fds, phase=phase), 1000, 0.15)["p"]["flat"]

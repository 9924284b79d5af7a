"""benchmarks/gpu_e2e.py's command line on a CPU (`--tiny`: tiny assets, no engine started).

It refuses a `--set` / `--alone-set` it cannot use in one line, before the phases that spend GPU
time: a malformed item (a shell that passed the two characters '' instead of an empty argument) at
once with exit 2, a value the teacher or the student would refuse once run.yaml exists (~5 s).
`--profile --profile-source stream` profiles the student loop receiving a served spool as a stream
(a distill-teacher without an engine), the path a student runs, not its own spool reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow  # CLI runs

ROOT = Path(__file__).resolve().parents[2]
BENCH = [sys.executable, str(ROOT / "benchmarks" / "gpu_e2e.py"), "--tiny"]


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*BENCH, "--work-dir", str(tmp_path / "work"), "--spool-dir", str(tmp_path / "spool"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_malformed_override_exits_2_in_one_line_before_any_work(tmp_path):
    p = _run(tmp_path, "--alone", "--alone-set", "''", "--alone-set", "student.batch_layout=padded")
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "\"''\" is not section.key=value" in lines[0], p.stderr
    assert not (tmp_path / "work").exists()  # nothing built
    p = _run(tmp_path, "--set", "batch_layout=packed")  # no section
    assert p.returncode == 2 and "'batch_layout=packed' is not section.key=value" in p.stderr


def test_a_variant_the_student_would_refuse_is_named_before_the_alone_phase(tmp_path):
    p = _run(
        tmp_path,
        "--skip-e2e",
        "--skip-bare",
        "--alone",
        "--alone-set",
        "",
        "--alone-set",
        "student.batch_layout=zigzag",
    )
    assert p.returncode == 1, p.stderr[-2000:]
    said = [line for line in p.stderr.splitlines() if line.startswith("gpu_e2e: ")]
    assert said == [
        "gpu_e2e: --alone-set 'student.batch_layout=zigzag': invalid config: 'student.batch_layout': "
        "Input should be 'packed' or 'padded' (got 'zigzag')"
    ], p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    res = json.loads(next(x for x in p.stdout.splitlines() if x.startswith("RESULT_JSON "))[12:])
    assert res["status"].startswith("config: --alone-set 'student.batch_layout=zigzag'")
    assert "alone_runs" not in res and "alone_generate_rc" not in res  # no phase ran
    p = _run(tmp_path, "--skip-e2e", "--skip-bare", "--set", "student.lr=abc")  # the base run.yaml
    assert p.returncode == 1 and "gpu_e2e: run.yaml with --set: invalid config: 'student.lr'" in p.stderr


def test_the_profile_over_a_served_stream_trains_every_synthetic_sample(tmp_path):
    p = _run(tmp_path, "--skip-e2e", "--skip-bare", "--profile", "--profile-source", "stream")
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(next(x for x in p.stdout.splitlines() if x.startswith("RESULT_JSON "))[12:])
    assert res["status"] == "ok" and res["profile_source"] == "stream"
    assert res["profile_samples"] == res["profile_synthetic_samples"] == 24, res
    assert res["profile_ms_per_step"]["fill (source.get + batching)"] > 0
    served = (tmp_path / "work" / "profile_teacher.log").read_text()
    assert "committed 24/24" in served and "0 samples, 0 tokens" in served  # served, nothing generated
    run = yaml.safe_load((tmp_path / "work" / "profile.yaml").read_text())
    assert run["student"].get("mode", "stream") == "stream" and "spool_dir" not in run["student"]


def test_the_trace_marks_the_loops_phases_without_timers(tmp_path):
    args = ("--skip-e2e", "--skip-bare", "--profile", "--profile-source", "stream", "--profile-trace")
    p = _run(tmp_path, *args, "--trace-wait", "0", "--trace-active", "3")
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(next(x for x in p.stdout.splitlines() if x.startswith("RESULT_JSON "))[12:])
    assert res["status"] == "ok", res["status"]
    tr = res["trace"]
    assert tr["trace_samples"] == res["profile_synthetic_samples"] == 24, tr
    assert tr["iterations"] >= 1 and tr["trace_gpu"] is False and tr["gpu_busy"] == 0.0
    assert tr["phases"]["forward_backward"]["ms_per_iter"] > 0 and tr["phases"]["fill"]["calls"] >= 1
    assert (tmp_path / "work" / "trace.json.gz").stat().st_size > 0


def test_spy_without_py_spy_exits_2_in_one_line(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from benchlib.spy import py_spy
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    if py_spy() is not None:
        pytest.skip("py-spy is installed here: the refusal cannot be seen")
    p = _run(tmp_path, "--spy")
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "gpu_e2e: --spy needs py-spy (`pip install py-spy`): not on PATH"
    ]
    assert not (tmp_path / "work").exists()  # nothing built


def test_an_alone_variant_is_named_with_the_runs_own_sets():
    """'' is "defaults" only when no --set changed the run; a variant names the sets under it."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from benchlib.runfile import variant_label
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert variant_label("", []) == "defaults"
    assert variant_label("student.collate_threads=1", []) == "student.collate_threads=1"
    sets = ["student.batch_layout=padded", "transport.shm=off"]
    assert variant_label("", sets) == "--set student.batch_layout=padded,transport.shm=off"
    assert variant_label("student.collate_threads=1", sets) == (
        "student.collate_threads=1 (over --set student.batch_layout=padded,transport.shm=off)"
    )

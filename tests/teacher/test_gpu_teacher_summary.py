"""benchmarks/gpu_teacher.py's summary over several calls: mode records of the same --commit in one
--out-dir are merged (a table over calls), a record of another commit is left out and said."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path


def _gpu_teacher():
    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("gpu_teacher", root / "benchmarks" / "gpu_teacher.py")
    gt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gt)
    return gt


def test_the_summary_merges_modes_of_its_commit_and_leaves_out_others(tmp_path, capsys):
    gt = _gpu_teacher()
    records = {
        "A.json": {"mode": "A", "name": "A", "commit": "abc", "generate_tok_s_median": 100.0},
        "C.json": {"mode": "C", "name": "C", "commit": "abc", "e2e_tok_s_median": 98.0},
        "C8.json": {"mode": "C8", "name": "C8", "commit": "old", "e2e_tok_s_median": 50.0},
        "D.json": {"mode": "D", "name": "D", "e2e_tok_s_median": 40.0},  # before records had one
        "D_4.json": {"mode": "D:4", "name": "D", "receivers": 4, "commit": "abc"},
    }
    for n, r in records.items():
        (tmp_path / n).write_text(json.dumps(r))
    (tmp_path / "summary.json").write_text("{}")
    got = gt.collect_results(str(tmp_path), "abc")
    assert sorted(got) == ["A", "C", "D:4"]
    err = capsys.readouterr()
    said = err.out + err.err
    assert "C8.json left out of the summary: commit old, not abc" in said
    assert "D.json left out of the summary: commit None, not abc" in said
    # Without --commit every record is taken, as before.
    assert sorted(gt.collect_results(str(tmp_path), None)) == ["A", "C", "C8", "D", "D:4"]


def test_a_mode_is_given_the_time_of_the_last_one_like_it_else_the_longest():
    """--total-budget-s: a mode of a kind and layer set that already ran (its graphs compiled and
    cached) is expected to take 15% over that one's time; a new kind or layer set the longest
    mode's time (it compiles); never under 60 s."""
    gt = _gpu_teacher()
    walls = [("A", 99.0), ("B", 99.3), ("C", 66.7), ("C8", 85.5), ("D", 60.2), ("C_fp8", 61.4)]
    assert round(gt.time_needed("C_loss_mask", walls), 1) == round(1.15 * 61.4, 1)  # like C_fp8
    assert round(gt.time_needed("C8n", walls), 1) == round(1.15 * 85.5, 1)  # C8's layers
    assert gt.time_needed("B8", walls) == 99.3  # vLLM's file path with 8 layers: not run yet
    assert gt.time_needed("A", []) == 60.0
    assert gt.time_needed("D:4@1", [("C", 40.0)]) == 60.0

"""A distill-teacher run's totals come from its phases' results (teacher/run/results.py,
teacher/run/state.py): each phase counts into its own result; the run derives the summary's
figures from them, the running phase included (the metrics endpoint reads them live)."""

from __future__ import annotations

from distill.config import SpoolConfig, TransportConfig
from teacher.config import TeacherConfig
from teacher.run.results import GenerateResult, ServeResult
from teacher.run.state import Run


def _run(tmp_path) -> Run:
    cfg = TeacherConfig(
        model=str(tmp_path),
        dataset=str(tmp_path / "rows.jsonl"),
        journal=str(tmp_path / "j.txt"),
        layer_ids=[1],
    )
    return Run(cfg, TransportConfig(), SpoolConfig(dir=str(tmp_path / "spool")), ["a", "b", "c"], "cmd")


def test_totals_are_the_sum_of_the_phases_and_a_key_generated_twice_counts_once_as_regenerated(tmp_path):
    r = _run(tmp_path)
    g0 = r.begin(GenerateResult(round=0, todo=3, seen=r.generated_keys()))
    for k in ("a", "b", "b"):  # "b" lost and generated again in the same phase
        g0.count_output(k, 10, 4)
    g0.too_long.add("c")
    g0.engine_s, g0.lost = 2.0, 1
    assert (r.generated, r.tokens, r.nbytes, r.regenerated, r.lost) == (3, 30, 120, 1, 1)  # live
    s = r.begin(ServeResult(round=0, lost=2, students_max=3, outcome="lost", lost_keys={"a"}))
    s.note_flow(
        {"flow_s": 4.0, "acked": 2},
        dict.fromkeys(("flow_s", "teacher_busy", "student_wait", "teacher_waited"), 0.5),
    )
    g1 = r.begin(GenerateResult(round=1, todo=1, seen=r.generated_keys()))
    g1.count_output("a", 10, 4)  # generated in round 0 already
    g1.engine_s = 1.0
    assert (r.generated, r.regenerated, r.lost, r.students_max, r.generate_s) == (4, 2, 3, 3, 3.0)
    assert r.too_long == {"c"} and r.required == {"a", "b"} and r.skipped == 1
    assert r.flow.totals["flow_s"] == 4.0 and r.flow.totals["acked"] == 2.0
    recs = r.summary(0, r.state())["phases"]
    assert [p["phase"] for p in recs] == ["generate", "serve", "generate"]
    assert recs[0] == {"phase": "generate", "round": 0, "todo": 3, "samples": 3, "lost": 1}
    assert recs[1]["outcome"] == "lost" and recs[1]["student_wait"] == 0.5 and recs[1]["lost"] == 2


def test_the_live_probe_takes_every_nth_submitted_sample_over_the_whole_run(tmp_path):
    from teacher.verify import Verifier

    v = Verifier(str(tmp_path), tmp_path / "verify", "float32", tol=None, every=3)
    v._thread = object()  # no checking thread: only the choice is under test
    picked = [k for k in map(str, range(8)) if v.offer(k, [1, 2])]
    assert picked == ["0", "3", "6"] and sorted(v._expected) == picked

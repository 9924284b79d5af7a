"""Sizing: how busy the teacher was, how long students waited, and the split to run next time.

Inputs are the Publishers' flow clocks (distill/students.py `FlowClock`, in `Publisher.stats()`),
their acks and the spool readers' counters, summed over the phases of one `distill-teacher`
invocation (`Flow`): the serve phases' Publisher in this process, and the generate phase's in
vLLM's worker, whose connector writes its final counters to `<journal>.flow-<pid>.json` at
shutdown (`write_flow`; read and removed by `take_flow`) - and vLLM's generation rate when this
invocation generated. The figures (teacher/README.md, "Sizing"):

    flow_s          seconds with a student connected and samples left somewhere
    students        mean connected students over flow_s (student ranks, one GPU each)
    student_wait    student_idle_s / student_s: the share of the students' connected time they had
                    nothing in flight while the teacher had more to produce (waiting on the teacher)
    teacher_waited  no_credit_s / flow_s: the share of flow time samples were ready to send and no
                    student had credit for them (the teacher waiting on students)
    students_took   acked / flow_s: samples/s the students trained
    students_rate   students_took / (1 - student_wait): what they would train never waiting
    teacher_rate    vLLM's samples / generate_s when this invocation generated; else the spool
                    readers' replayed / (replay_read_s / spool.readers)
    teacher_busy    min(1, students_took / teacher_rate): the share of the teacher's rate used
    ratio           students_rate / teacher_rate
"""

from __future__ import annotations

import json
import os
from pathlib import Path

MIN_SAMPLES = 20  # fewer acked samples, or less flow time, and the figures are noise
MIN_FLOW_S = 2.0
BALANCED = (0.9, 1.1)  # ratio within this band: the split fits

FLOW_KEYS = ("flow_s", "student_s", "student_idle_s", "no_credit_s", "acked", "replayed", "replay_read_s")


class Flow:
    """The flow counters of the serve phases so far (each phase's Publisher starts from zero)."""

    def __init__(self):
        self.totals = dict.fromkeys(FLOW_KEYS, 0.0)

    def add(self, stats: dict) -> None:
        for k in FLOW_KEYS:
            self.totals[k] += float(stats.get(k, 0) or 0)


def write_flow(journal: str, stats: dict, students=()) -> Path:
    """The generate phase's flow counters, from the connector's Publisher at its shutdown, and the
    students it was serving (`Publisher.student_names`: the next Publisher expects them)."""
    path = Path(f"{journal}.flow-{os.getpid()}.json")
    tmp = path.with_name(path.name + ".tmp")
    rec: dict = {k: float(stats.get(k, 0) or 0) for k in FLOW_KEYS}
    rec["student_names"] = sorted(students)
    tmp.write_text(json.dumps(rec))
    os.replace(tmp, path)
    return path


def take_flow(journal: str) -> dict | None:
    """The counters every connector of the last engine wrote (summed), with `student_names` (the
    union of theirs), the files removed; None when there are none. Called before an engine starts
    too, to drop a crashed run's files."""
    files = sorted(Path(journal).parent.glob(Path(journal).name + ".flow-*.json"))
    if not files:
        return None
    total: dict = dict.fromkeys(FLOW_KEYS, 0.0)
    names: set[str] = set()
    for f in files:
        try:
            got = json.loads(f.read_text())
            for k in FLOW_KEYS:
                total[k] += float(got.get(k, 0) or 0)
            names.update(str(n) for n in got.get("student_names", ()))
        except (OSError, ValueError, AttributeError, TypeError):
            pass  # a torn file: those counters are missing from the figures, nothing else
        f.unlink(missing_ok=True)
    total["student_names"] = sorted(names)
    return total


def delta(now: dict, before: dict | None) -> dict:
    """The flow counters between two `Publisher.stats()` (for the progress line)."""
    before = before or {}
    return {k: float(now.get(k, 0) or 0) - float(before.get(k, 0) or 0) for k in FLOW_KEYS}


def shares(f: dict, readers: int, generated: int = 0, generate_s: float = 0.0) -> dict:
    """teacher_busy, student_wait, teacher_waited, the rates and their ratio from flow counters
    (`Flow.totals` or a `delta`), plus `teacher`: what the teacher's rate is of (vLLM's when this
    invocation generated at least MIN_SAMPLES samples, else the spool readers')."""
    if generated >= MIN_SAMPLES and generate_s > 0:
        return {**_figures(f, generated / generate_s), "teacher": "vllm"}
    read_busy_s = f["replay_read_s"] / max(readers, 1)
    teacher_rate = f["replayed"] / read_busy_s if read_busy_s > 0 else 0.0
    return {**_figures(f, teacher_rate), "teacher": "spool readers"}


def _figures(f: dict, teacher_rate: float) -> dict:
    flow_s = f["flow_s"]
    if flow_s <= 0:
        return {
            "flow_s": 0.0, "students": 0.0, "students_took": 0.0, "students_rate": 0.0,
            "teacher_rate": round(teacher_rate, 3), "teacher_busy": 0.0, "student_wait": 0.0,
            "teacher_waited": 0.0, "ratio": None,
        }  # fmt: skip
    student_wait = f["student_idle_s"] / f["student_s"] if f["student_s"] > 0 else 0.0
    took = f["acked"] / flow_s
    rate = took / max(1.0 - student_wait, 1e-3)
    return {
        "flow_s": round(flow_s, 3),
        "students": round(f["student_s"] / flow_s, 2),
        "students_took": round(took, 3),
        "students_rate": round(rate, 3),
        "teacher_rate": round(teacher_rate, 3),
        "teacher_busy": round(min(1.0, took / teacher_rate), 3) if teacher_rate > 0 else None,
        "student_wait": round(student_wait, 3),
        "teacher_waited": round(f["no_credit_s"] / flow_s, 3),
        "ratio": round(rate / teacher_rate, 3) if teacher_rate > 0 else None,
    }


def sizing(flow: Flow, readers: int, generated: int = 0, generate_s: float = 0.0) -> dict:
    """The summary's `sizing` record: the figures, `teacher` (what the teacher's rate is of),
    `verdict` (add_students, add_teachers, balanced, too_short) and `recommendation` (one line)."""
    f = flow.totals
    out = shares(f, readers, generated, generate_s)
    out["samples"] = int(f["acked"])
    verdict, line = recommend(out)
    out["verdict"], out["recommendation"] = verdict, line
    return out


def recommend(s: dict) -> tuple[str, str]:
    """(verdict, one line) from `_figures`' record (with `samples`)."""
    ratio, n = s["ratio"], max(1, round(s["students"]))
    if ratio is None or s["samples"] < MIN_SAMPLES or s["flow_s"] < MIN_FLOW_S:
        return "too_short", (
            f"too little flow to size the split ({s['samples']} samples trained in {s['flow_s']:.1f}s "
            f"with a student connected; at least {MIN_SAMPLES} samples and {MIN_FLOW_S:.0f}s needed)"
        )
    who = f"{n} student{'s' if n > 1 else ''}"
    rates = (
        f"students {s['students_rate']:.1f} samples/s, teacher {s['teacher_rate']:.1f} samples/s "
        f"({s['teacher']}); teacher busy {s['teacher_busy']:.0%}, students waited {s['student_wait']:.0%}"
    )
    if ratio < BALANCED[0]:
        total = max(n + 1, round(n / ratio))
        return "add_students", (
            f"the {who} took {ratio:.0%} of the teacher's rate ({rates}): add {total - n} student "
            f"GPU{'s' if total - n > 1 else ''} per teacher ({total} per teacher would take "
            f"{min(1.0, ratio * total / n):.0%} of it)"
        )
    if ratio > BALANCED[1]:
        fewer = max(1, round(n / ratio))
        teachers = max(2, round(ratio))
        alt = f"{fewer} student GPU{'s' if fewer > 1 else ''} per teacher would do, or " if fewer < n else ""
        return "add_teachers", (
            f"the students waited {s['student_wait']:.0%} of the time: the teacher is the bottleneck "
            f"(the {who} could take {ratio:.1f}x its rate; {rates}): {alt}add teacher GPUs, "
            f"{teachers} teachers for {'this student' if n == 1 else f'these {n} students'}"
        )
    return (
        "balanced",
        f"the {who} kept pace with the teacher ({ratio:.0%} of its rate; {rates}): the split fits",
    )

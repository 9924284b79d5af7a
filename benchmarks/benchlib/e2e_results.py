"""What the e2e phase's processes left: the teacher's and the student's logs, metrics.json, and
the counts of samples trained, twice and missing (`read_results`)."""

from __future__ import annotations

import ast
import collections
import json
import re
from pathlib import Path

STEP_LINE = re.compile(
    r"(?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*?step (?P<step>\d+) loss=.*?\| (?P<sps>[\d.]+) samples/s "
    r"(?P<tps>[\d.]+) tokens/s \| waiting for teacher (?P<wait>[\d.]+)s/step"
)


TEACHER_SUMMARY = re.compile(
    r"distill-teacher: (?P<n>\d+) samples, (?P<tok>\d+) tokens, (?P<gb>[\d.]+) GB (?:generated )?in (?P<gen>[\d.]+)s "
    r"\((?P<tps>\d+) tok/s"
)


def parse_teacher(text: str) -> dict:
    out: dict = {}
    found = list(TEACHER_SUMMARY.finditer(text))
    m = found[-1] if found else None
    if m:
        out.update(
            teacher_samples=int(m["n"]),
            teacher_tokens=int(m["tok"]),
            teacher_gb=float(m["gb"]),
            teacher_gen_s=float(m["gen"]),
            teacher_tok_s=float(m["tps"]),
            teacher_samples_s=round(int(m["n"]) / max(float(m["gen"]), 1e-9), 1),
        )
        line = text[m.start() : text.find("\n", m.start()) if "\n" in text[m.start() :] else len(text)]
        out["teacher_summary_line"] = line.strip()[:600]
        t = re.search(r"after ([\d.]+)s", line)
        if t:
            out["teacher_total_s"] = float(t.group(1))
            out["teacher_wait_s"] = round(float(t.group(1)) - float(m["gen"]), 2)
        for name in ("acked", "spooled", "committed", "lost", "replayed", "already done", "too long"):
            mm = re.search(rf"{name} (\d+)", line)
            if mm:
                out[f"teacher_line_{name.replace(' ', '_')}"] = int(mm.group(1))
    # Other closing lines of the teacher (exit reasons, counts), verbatim.
    tail = [ln.strip() for ln in text.splitlines() if ln.startswith("distill-teacher:")]
    if tail:
        out["teacher_closing_lines"] = [ln[:600] for ln in tail[-6:]]
    # Publisher counters ("publisher closed: {...}" from the connector; the cli's serve phase may
    # log its own): summed, and kept per line.
    pubs = []
    for mm in re.finditer(r"publisher[^\n{]*?(?:closed|stats|summary)[^\n{]*?(\{[^\n]*\})", text):
        try:
            d = ast.literal_eval(mm.group(1))
            if isinstance(d, dict):
                pubs.append(d)
        except (ValueError, SyntaxError):
            continue
    if pubs:
        out["teacher_publisher_stats"] = pubs
        tot = collections.Counter()
        for d in pubs:
            for k, v in d.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    tot[k] += v
        out["teacher_publisher_totals"] = dict(tot)
    return out


def parse_student_log(text: str) -> dict:
    import datetime as dt

    rows = []
    for m in STEP_LINE.finditer(text):
        ts = dt.datetime.strptime(m["ts"], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        rows.append((ts, int(m["step"]), float(m["sps"]), float(m["tps"]), float(m["wait"])))
    if not rows:
        return {}
    tps = sorted(r[3] for r in rows[1:]) or [rows[0][3]]
    return {
        "log_steps": rows[-1][1],
        "log_first_step_time": rows[0][0],
        "log_student_tok_s_median": tps[len(tps) // 2],
        "log_student_wait_s": round(sum(r[4] for r in rows), 2),
    }


def read_results(args, work: Path, res: dict, expected_keys: list[str]) -> None:
    tlog = (work / "teacher.log").read_text(errors="replace") if (work / "teacher.log").exists() else ""
    slog = (work / "student.log").read_text(errors="replace") if (work / "student.log").exists() else ""
    res.update(parse_teacher(tlog))
    summ_path = work / "journal.txt.summary.json"  # distill-teacher's summary (newer teachers)
    if summ_path.exists():
        ts = json.loads(summ_path.read_text())
        res["teacher_summary"] = ts
        if ts.get("generate_s"):
            res["teacher_gen_s"] = ts["generate_s"]
            res["teacher_tok_s"] = ts.get("tokens_per_s")
            res["teacher_samples_s"] = round(ts.get("samples", 0) / ts["generate_s"], 1)
        if ts.get("wall_s") is not None and ts.get("generate_s") is not None:
            res["teacher_total_s"] = ts["wall_s"]
            res["teacher_wait_s"] = round(ts["wall_s"] - ts["generate_s"], 2)
        phases = ts.get("phases") or []
        res["teacher_phases"] = phases
        res["samples_committed_in_serve_phase"] = sum(
            ph.get("served", 0) for ph in phases if ph.get("phase") == "serve"
        )
        res["samples_generated"] = ts.get("samples")
        res["samples_regenerated"] = ts.get("regenerated")
        res["samples_lost_records"] = ts.get("lost")
    res.update(parse_student_log(slog))
    res["samples_expected"] = len(expected_keys)
    mpath = work / "student" / "metrics.json"
    if mpath.exists():
        m = json.loads(mpath.read_text())
        trained = [e[0] for e in m.get("trained", [])]
        counts = collections.Counter(trained)
        res["samples_trained"] = len(counts)
        res["samples_twice"] = sum(1 for c in counts.values() if c > 1)
        res["samples_missing"] = len(set(expected_keys) - set(counts))
        res["samples_unexpected"] = len(set(counts) - set(expected_keys))
        res["trained_source"] = "metrics.json"
        summ = m.get("summary", {})
        steps = m.get("steps", [])
        res["student_steps"] = len(steps)
        res["student_tokens"] = summ.get("tokens")
        res["student_wait_s"] = round(float(summ.get("wait_s", 0.0)), 2)
        # the part of it after the first step (before it the teacher was still starting up)
        res["student_wait_after_first_step_s"] = round(sum(float(s.get("wait_s", 0.0)) for s in steps[1:]), 2)
        res["student_loss_first_last"] = [summ.get("loss_first"), summ.get("loss_last")]
        res["student_source_stats"] = summ.get("source_stats")
        if len(steps) > 1:
            dt_s = steps[-1]["time"] - steps[0]["time"]
            tok = sum(s["tokens"] for s in steps[1:])
            smp = sum(s["samples"] for s in steps[1:])
            res["student_train_s"] = round(dt_s, 2)
            res["student_tok_s"] = round(tok / max(dt_s, 1e-9), 1)
            res["student_samples_s"] = round(smp / max(dt_s, 1e-9), 1)
        if steps:
            res["t_first_step"] = steps[0]["time"]
            res["t_last_step"] = steps[-1]["time"]
    else:
        res["trained_source"] = "journal (no metrics.json: the student did not finish)"
        j = work / "journal.txt"
        lines = j.read_text(errors="replace").splitlines() if j.exists() else []
        committed = [ln for ln in lines if ln and not ln.startswith("!")]
        counts = collections.Counter(committed)
        res["samples_trained"] = len(counts)  # acked (old journal) / committed (new) keys
        res["samples_twice"] = None
        res["samples_missing"] = len(set(expected_keys) - set(counts))
        res["journal_lost_records"] = sum(1 for ln in lines if ln.startswith("!lost"))
        if "log_student_tok_s_median" in res:
            res["student_tok_s"] = res["log_student_tok_s_median"]
            res["student_tok_s_from"] = "median of the per-step log lines"
        if "log_student_wait_s" in res:
            res["student_wait_s"] = res["log_student_wait_s"]
        if "log_first_step_time" in res:
            res["t_first_step"] = res["log_first_step_time"]
    sp = Path(res.get("spool_dir", ""))
    if sp.is_dir():
        files = list(sp.rglob("*.safetensors"))
        res["spool_files_left"] = len(files)
        res["spool_bytes_left"] = sum(f.stat().st_size for f in files if f.exists())
    tg, tf = res.get("t_teacher_generating"), res.get("t_first_step")
    # The teacher's time after generation (drain, serve phase, shutdown) = waiting for students:
    # exit - engine ready - generate time (the same for old and new teachers).
    if tg and res.get("t_teacher_exit") and res.get("teacher_gen_s") is not None:
        res["teacher_wait_s"] = round(res["t_teacher_exit"] - tg - float(res["teacher_gen_s"]), 2)
        res["teacher_wait_s_from"] = "teacher exit - engine ready - generate time"
    if tf and tg:
        res["time_to_first_step_s"] = round(tf - tg, 2)
    if tf and res.get("t_launch"):
        res["student_first_step_after_launch_s"] = round(tf - res["t_launch"], 2)
    tot = res.get("teacher_publisher_totals") or {}
    if tot:
        res["samples_sent"] = tot.get("sent")
        res["samples_spooled"] = tot.get("spooled")
        res["samples_replayed_from_spool"] = tot.get("replayed")
        res["samples_redelivered"] = tot.get("redelivered")
        if tot.get("sent") is not None:
            res["samples_streamed_from_memory"] = (
                tot.get("sent", 0) - tot.get("replayed", 0) - tot.get("redelivered", 0)
            )

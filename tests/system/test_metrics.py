"""Metrics for operators and the operations fixes around them.

- The Prometheus endpoints (`teacher.metrics_port`, `student.metrics_port` + rank), scraped with
  prometheus_client's own parser while a real run goes on (the real `distill-teacher` serve phase:
  every row in the spool, written by `testkit.synthetic_teacher`; two student ranks under a real
  `accelerate launch`) and at its end, compared with the summaries the processes write.
- A port in use: one line, exit 2 (teacher and student).
- The student's own exit code and reason in metrics.json (`accelerate launch` always exits 1).
- `connector_mode: spool` with `after_generation: serve` and nobody to serve: the progress line
  says how long it waits and how to stop.
- A full checkpoint disk (a real small tmpfs in a mount namespace of its own): one line naming
  the folder and the disk, no half checkpoint left to be taken for a good one.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import faults
import pytest
import zmq
from faults import wait_until
from scrape import one, scrape

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
ACCELERATE = str(Path(PY).with_name("accelerate"))
LAYERS = faults.TINY_LAYERS
N = 40

pytestmark = pytest.mark.slow

# student.py whose ranks, once `Trainer.finish` wrote metrics.json, wait for a release file before
# they exit: the test scrapes their endpoints at the very end (the one change to the student).
_HELD_STUDENT = """
import os, sys, time
from student import loop
real = loop.Trainer.finish
def finish(self):
    real(self)
    open(os.environ["DISTILL_TEST_HELD"] + str(self.rank), "w").close()
    deadline = time.monotonic() + 120
    while not os.path.exists(os.environ["DISTILL_TEST_RELEASE"]) and time.monotonic() < deadline:
        time.sleep(0.05)
loop.Trainer.finish = finish
from student.train import main
main(sys.argv[1:])
"""


@pytest.fixture(scope="module")
def spooled(tmp_path_factory, tiny_teacher):
    """N rows and their samples (the tiny teacher's layers 2 and 4) in a spool folder."""
    from testkit.tiny import write_tiny_dataset

    d = tmp_path_factory.mktemp("metrics")
    data = write_tiny_dataset(d / "data.jsonl", N, seed=5)
    spool = d / "spool"
    r = subprocess.run(
        [PY, "-m", "testkit.synthetic_teacher", "--model", str(tiny_teacher), "--data", str(data),
         "--layers", ",".join(map(str, LAYERS)), "--spool", str(spool)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    keys = [json.loads(x)["id"] for x in data.read_text().splitlines()]
    return {"data": data, "spool": spool, "keys": keys, "teacher": tiny_teacher}


def _run_file(tmp: Path, spooled, port: int, teacher: dict | None = None, **student) -> Path:
    spool = tmp / "spool"
    if not spool.exists():
        shutil.copytree(spooled["spool"], spool)
    return faults.write_run_file(
        tmp / "run.yaml",
        teacher={
            "model": str(spooled["teacher"]), "dataset": str(spooled["data"]), "layer_ids": LAYERS,
            "journal": str(tmp / "journal.txt"), "progress_every_s": 1, "student_wait_s": 60, **(teacher or {}),
        },
        transport={
            "bind": [f"tcp://127.0.0.1:{port}"], "connect": [f"tcp://127.0.0.1:{port}"],
            "credit_samples": 8, "heartbeat_timeout_s": 3, "shm_dir": str(tmp), "teacher_wait_s": 60,
        },
        spool={"dir": str(spool)},
        student=faults.tiny_student(spooled["teacher"], tmp / "out", **student),
    )  # fmt: skip


def _env(**extra: str) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **extra}


def _launch(run: Path, script: str, nproc: int = 2) -> list[str]:
    return [
        ACCELERATE, "launch", "--multi_gpu", "--num_processes", str(nproc),
        "--main_process_port", str(faults.free_port()), script, "--config", str(run),
    ]  # fmt: skip


def test_endpoints_scraped_during_and_at_the_end_match_the_summaries(spooled, tmp_path, procs):
    """distill-teacher (serve phase) and two student ranks with metrics ports: the endpoints answer
    in Prometheus' format while samples flow, counters are counters (`_total`) and gauges gauges,
    and what the last scrapes show is what the teacher's summary.json and the students'
    metrics.json say (committed, sent, acked, bytes; per rank: trained, received, acked, bytes)."""
    tport, sport = faults.free_port(), faults.free_port()
    while sport + 1 == tport:
        sport = faults.free_port()
    ep = f"tcp://127.0.0.1:{faults.free_port()}"
    run = _run_file(tmp_path, spooled, int(ep.rsplit(":", 1)[1]), {"metrics_port": tport}, metrics_port=sport)
    held, release = tmp_path / "held-", tmp_path / "release"
    script = tmp_path / "held_student.py"
    script.write_text(_HELD_STUDENT)
    teacher = procs.start("teacher", [PY, "-m", "teacher.cli", "--config", str(run)], _env())
    env = _env(DISTILL_TEST_HELD=str(held), DISTILL_TEST_RELEASE=str(release))
    students = procs.start("students", _launch(run, str(script)), env)
    tlog, slog = teacher.log, students.log

    def alive():
        assert teacher.poll() in (None, 0), tlog.read_text()[-3000:]
        assert students.poll() is None, slog.read_text()[-3000:]

    # During the run: every endpoint answers and counts.
    seen, peak = {}, [0.0]

    def flowing() -> bool:
        seen["t"], seen[0], seen[1] = scrape(tport), scrape(sport), scrape(sport + 1)
        if seen["t"]:  # a rank may end its share (and close) before both trained at one scrape:
            peak[0] = max(peak[0], one(seen["t"], "distill_students_connected"))  # so, the peak
        if not all(seen.values()):
            return False
        return one(seen["t"], "distill_samples_acked_total") > 0 and all(
            one(seen[r], "distill_samples_trained_total", rank=r) > 0 for r in (0, 1)
        )

    wait_until(flowing, 180, "samples trained on both ranks, seen on every endpoint", check=alive)
    # A stranger's garbage reaches the teacher: counted by reason on its endpoint.
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.connect(ep)
    raw.send_multipart([b"\xc1\xc1\xc1"])

    def garbage():
        return (scrape(tport) or {}).get("distill_rejected_frames_total", {}).get((("reason", "garbage"),))

    wait_until(garbage, 60, "the garbage counted on the teacher's endpoint", check=alive)
    raw.close(0)
    t = seen["t"]
    types = t["__type__"]
    for name in ("distill_samples_committed_total", "distill_bytes_sent_total", "distill_student_wait_seconds_total",
                 "distill_samples_sent_total", "distill_rejected_frames_total"):  # fmt: skip
        assert types[name] == "counter", (name, types.get(name))
    for name in ("distill_samples_in_spool", "distill_credit_window", "distill_students_connected"):
        assert types[name] == "gauge", (name, types.get(name))
    assert one(t, "distill_teacher_phase", phase="serve") == 1 and one(t, "distill_dataset_samples") == N
    assert peak[0] == 2  # distill_students_connected: both ranks at some scrape, never more
    for r in (0, 1):
        s = seen[r]
        assert s["__type__"]["distill_samples_trained_total"] == "counter"
        assert s["__type__"]["distill_credit_window"] == "gauge"
        assert one(s, "distill_credit_window", rank=r) == 8  # transport.credit_samples x 1 teacher
        assert one(s, "distill_samples_received_total", rank=r) >= one(
            s, "distill_samples_trained_total", rank=r
        )

    # The end: every key committed (the teacher lingers a few seconds after END).
    last = {}

    def all_committed() -> bool:
        m = scrape(tport)
        if m is not None:
            last["t"] = m
        return m is not None and one(m, "distill_samples_committed_total") == N

    wait_until(all_committed, 120, "every key committed, on the teacher's endpoint", check=alive)
    held_both = lambda: all(Path(f"{held}{r}").exists() for r in (0, 1))  # noqa: E731
    wait_until(held_both, 60, "both ranks at the end, metrics.json written", check=alive)
    ends = {r: scrape(sport + r) for r in (0, 1)}
    met = json.loads((tmp_path / "out" / "metrics.json").read_text())
    release.write_text("")
    assert students.popen.wait(timeout=60) == 0, slog.read_text()[-3000:]
    assert teacher.popen.wait(timeout=60) == 0, tlog.read_text()[-3000:]

    summary = json.loads((tmp_path / "journal.txt.summary.json").read_text())
    t = last["t"]
    assert summary["committed"] == one(t, "distill_samples_committed_total") == N
    assert summary["spooled"] == one(t, "distill_samples_in_spool") == 0
    tr = summary["transport"]
    for k, name in (("sent", "distill_samples_sent_total"), ("acked", "distill_samples_acked_total"),
                    ("bytes_sent", "distill_bytes_sent_total"), ("replayed", "distill_samples_replayed_total")):  # fmt: skip
        assert tr[k] == one(t, name), (k, tr[k], one(t, name))
    assert tr["acked"] >= N and tr["bytes_sent"] > 0
    assert (
        tr["rejected_by_reason"]
        == {"garbage": 1}
        == {dict(k)["reason"]: v for k, v in t["distill_rejected_frames_total"].items()}
    )
    assert abs(tr["student_idle_s"] - one(t, "distill_student_wait_seconds_total")) < 1.0
    assert met["exit_code"] == 0 and met["exit_reason"] == "done"
    for r in (0, 1):
        st, m = met["summary"]["source_stats"][r], ends[r]
        trained = sum(1 for _, rank, _ in met["trained"] if rank == r)
        assert one(m, "distill_samples_trained_total", rank=r) == trained > 0
        for k in ("received", "acked", "bytes_received"):
            assert (
                one(m, f"distill_{'samples_' if k != 'bytes_received' else ''}{k}_total", rank=r) == st[k]
            ), k
    assert sum(one(ends[r], "distill_samples_trained_total", rank=r) for r in (0, 1)) == N
    # The shipped Grafana dashboard asks only for metrics these endpoints export.
    board = (ROOT / "configs" / "grafana-distill.json").read_text()
    exported = set(t["__type__"]) | set(ends[0]["__type__"])
    asked = set(re.findall(r"distill_[a-z_]+", board)) - {"distill_stream"}
    assert asked and asked <= exported, asked - exported
    print(
        f"teacher end scrape: sent {tr['sent']}, bytes {tr['bytes_sent']}, student wait {tr['student_idle_s']}s"
    )


def _listening() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("0.0.0.0", 0))
    s.listen()
    return s, s.getsockname()[1]


def test_a_metrics_port_in_use_is_one_line_and_exit_2(spooled, tmp_path):
    busy, port = _listening()
    with busy:
        run = _run_file(tmp_path, spooled, faults.free_port(), {"metrics_port": port}, metrics_port=port)
        r = subprocess.run([PY, "-m", "teacher.cli", "--config", str(run)], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)  # fmt: skip
        assert r.returncode == 2, r.stderr[-3000:]
        err = [x for x in r.stderr.splitlines() if x.startswith("distill-teacher: error:")]
        assert len(err) == 1 and f"teacher.metrics_port: port {port} cannot serve metrics" in err[0], r.stderr
        assert "Traceback" not in r.stderr and not (tmp_path / "journal.txt.summary.json").exists()
        r = subprocess.run([PY, "student.py", "--config", str(run)], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)  # fmt: skip
        assert r.returncode == 2, r.stderr[-3000:]
        err = [x for x in r.stderr.splitlines() if x.startswith("student error:")]
        assert len(err) == 1 and f"student.metrics_port (+ rank 0): port {port} cannot" in err[0], r.stderr
        assert "Traceback" not in r.stderr


def test_student_writes_its_exit_code_and_reason_in_metrics_json(spooled, tmp_path):
    """No teacher: the student exits 3 and says why in metrics.json, where scripts that only see
    `accelerate launch`'s exit 1 read it."""
    run = _run_file(tmp_path, spooled, faults.free_port())
    r = subprocess.run(
        [PY, "student.py", "--config", str(run), "--set", "transport.teacher_wait_s=2"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 3, r.stderr[-3000:]
    m = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert (m["exit_code"], m["exit_reason"]) == (3, "teacher_gone"), m
    line = [x for x in r.stderr.splitlines() if x.startswith("student stopped: ")]
    assert line == [f"student stopped: {m['exit_message']}"]
    assert m["summary"]["samples"] == 0


def test_spool_mode_serving_nobody_says_how_long_and_how_to_stop(spooled, tmp_path):
    """connector_mode: spool, after_generation: serve, every row spooled, no student: a warning at
    the start, and every progress line says how long it waits and how to stop."""
    run = _run_file(tmp_path, spooled, faults.free_port(), {"connector_mode": "spool", "student_wait_s": 3})
    r = subprocess.run([PY, "-m", "teacher.cli", "--config", str(run)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode == 3, r.stderr[-3000:]
    assert "teacher.connector_mode is spool and teacher.after_generation is serve" in r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("distill-teacher: serving: ")]
    assert lines, r.stderr[-3000:]
    for x in lines:
        assert "no student connected: exit 3 after 3s without any (teacher.student_wait_s)" in x, x
        assert "Ctrl-C or SIGTERM stops now" in x and "--set teacher.after_generation=exit" in x, x


def _students_on_a_small_disk(spooled, tmp_path, procs, folder: Path, size: str, after: str, **student):
    """Two ranks reading the spool offline with `folder` on a real tmpfs of `size` (a mount
    namespace of its own); `after` runs there once they stopped. Returns (the output, the ranks'
    `student error:` lines: one per rank, all the same, nothing else from the ranks: no
    traceback, nobody blamed as lost)."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare to mount a small tmpfs in a mount namespace of its own")
    folder.mkdir()
    run = _run_file(tmp_path, spooled, faults.free_port(), mode="spool", **student)
    launch = shlex.join(_launch(run, "student.py"))
    script = (
        f"mount -t tmpfs -o size={size} tmpfs {folder} || exit 90; {launch}; echo RC=$?; "
        f"ls -a {folder}; echo LISTED; {after}; echo DONE"
    )
    p = procs.start("students", ["unshare", "-m", "--propagation", "private", "sh", "-c", script], _env())
    assert p.popen.wait(timeout=300) == 0, p.tail()
    out = p.log.read_text()
    assert "RC=1" in out, out[-4000:]  # accelerate launch: 1 whatever the ranks said
    lines = [x for x in out.splitlines() if x.startswith("student error: ")]
    assert len(lines) == 2 and lines[0] == lines[1], out[-4000:]  # every rank, the same line
    ranks = out.split(" failed (exitcode: ")[0]  # what the ranks printed (then torchrun's own report)
    assert "Traceback" not in ranks and "lost rank" not in ranks, ranks[-4000:]
    assert "No space left on device" in lines[0], lines[0]
    return out, lines


def test_a_full_output_disk_is_one_line_and_leaves_no_half_model(spooled, tmp_path, procs):
    """student.output_dir on a real 200 kB tmpfs, no checkpoints: the final student does not fit.
    Every rank stops with the same one line naming the folder and the disk; no half-written
    `model/` is left to be loaded as a good one."""
    out_dir = tmp_path / "out"
    out, lines = _students_on_a_small_disk(spooled, tmp_path, procs, out_dir, "200k", "true")
    assert f"cannot write the final student to {out_dir}/model (student.output_dir {out_dir} (" in lines[0]
    assert "no checkpoint (checkpoint_every is 0)" in lines[0], lines[0]
    left = out.split("LISTED")[0].split("RC=1", 1)[1].split()
    assert "model" not in left, left


def test_a_full_checkpoint_disk_is_one_line_and_leaves_no_half_checkpoint(spooled, tmp_path, procs):
    """student.checkpoint_dir on a real 3 MB tmpfs, a checkpoint every step: the first checkpoints fit, a later one
    does not. Every rank stops with the same one line naming the folder and the full disk (no
    traceback, nobody blamed as lost), metrics.json says checkpoint_disk_full, and every step
    folder left is complete (the failed one was written under a temporary name and removed)."""
    ckpt = tmp_path / "ckpt"
    out, lines = _students_on_a_small_disk(
        spooled, tmp_path, procs, ckpt, "3m", f"ls {ckpt}/step_*/.complete",
        checkpoint_every=1, checkpoint_keep=0, checkpoint_dir=str(ckpt),
    )  # fmt: skip
    assert f"cannot write checkpoint {ckpt}/step_" in lines[0], lines[0]
    assert f"student.checkpoint_dir {ckpt} (" in lines[0] and "MB free)" in lines[0], lines[0]
    left = out.split("LISTED")[0].split("RC=1", 1)[1].split()
    steps = [n for n in left if n.startswith("step_")]
    assert steps and not [n for n in left if n.endswith(".partial")], left
    complete = out.split("LISTED", 1)[1].split("DONE")[0].split()
    assert sorted(complete) == sorted(f"{ckpt}/{n}/.complete" for n in steps), (complete, steps)
    m = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert (m["exit_code"], m["exit_reason"]) == (2, "checkpoint_disk_full"), m
    assert m["exit_message"] == lines[0].removeprefix("student error: ")
    # (the folders themselves vanished with the namespace's tmpfs: their names were listed inside)
    assert f"the newest complete one is {ckpt}/{sorted(steps)[-1]}" in lines[0], (lines[0], steps)


def test_publisher_totals_add_up_phases_and_never_go_down():
    """Each phase's Publisher counts from zero: the run's totals add the finished phases' last
    counters to the live one's, so a counter scraped across the generate -> serve switch (the
    stats file of vLLM's worker, then this process's Publisher) never goes down."""
    from teacher.metrics import PublisherTotals

    p = PublisherTotals()
    gen = {"sent": 10, "bytes_sent": 100, "rejected_by_reason": {"garbage": 1}, "students": 2}
    p.live("generate", lambda: gen)
    assert p.snapshot()[0]["sent"] == 10 and p.phase == "generate"
    p.live("generate", lambda: None)  # the stats file not written yet: the finished phases only
    assert p.snapshot()[0].get("sent", 0) == 0
    p.closed({**gen, "sent": 12, "bytes_sent": 120})  # the connector's last write, at close
    serve = {"sent": 0, "bytes_sent": 0}
    p.live("serve", lambda: serve)
    seen = [p.snapshot()[0]["sent"]]
    serve.update(sent=3, bytes_sent=30, rejected_by_reason={"garbage": 2, "version": 1})
    seen.append(p.snapshot()[0]["sent"])
    p.closed(serve)
    seen.append(p.snapshot()[0]["sent"])
    assert seen == [12, 15, 15]
    s = p.summary()
    assert (s["sent"], s["bytes_sent"], s["rejected"]) == (15, 150, 4)
    assert s["rejected_by_reason"] == {"garbage": 3, "version": 1} and "students" not in s

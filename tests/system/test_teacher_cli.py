"""`distill-teacher` end to end (real vLLM in real processes) and its start-up errors."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import faults
import pytest
import yaml
from scrape import Scraper, one
from waiting import wait_until

from distill.config import TransportConfig
from distill.errors import ConfigError
from distill.spool import list_spool, read_spool_file, spool_name
from distill.transport import Subscriber
from teacher.cli import main
from teacher.config import ConnectorConfig
from testkit.tiny import build_tiny_model, write_tiny_dataset

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "teacher.cli"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("teacher_cli")
    model = build_tiny_model(root / "tiny")
    data = write_tiny_dataset(root / "d.jsonl", 8, seed=7)
    return root, model, data


def _config(root: Path, model: Path, data: Path, **teacher) -> Path:
    port = faults.free_port()
    cfg = {
        "teacher": {
            "model": str(model),
            "dtype": "float32",
            "max_model_len": 512,
            "layer_ids": [1, 2, 4],
            "enforce_eager": True,
            "cpu_kvcache_space_gib": 1,
            "dataset": str(data),
            "journal": str(root / "journal.txt"),
            "window": 3,
            **teacher,
        },
        # No student will connect: spool at once instead of holding samples in memory.
        "transport": {"bind": [f"tcp://127.0.0.1:{port}"], "connect_timeout_s": 0},
        "spool": {"dir": str(root / "spool")},
    }
    p = root / f"run-{port}.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def _run(
    config: Path, *sets: str, timeout: float = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    args = [*CLI, "--config", str(config)]
    for s in sets:
        args += ["--set", s]
    full_env = {**os.environ, **env} if env else None
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=full_env)


# ---------------------------------------------------------------------------------------------
# With vLLM: no student, everything spools; a restart sends nothing twice.
# ---------------------------------------------------------------------------------------------


def _summary(config: Path) -> dict:
    journal = yaml.safe_load(config.read_text())["teacher"]["journal"]
    return json.loads(Path(f"{journal}.summary.json").read_text())


@pytest.mark.vllm
@pytest.mark.slow
def test_no_student_spools_every_sample_and_resume_skips_done(assets, tmp_path):
    """after_generation: exit (generate now, train offline later): every sample lands in the spool."""
    pytest.importorskip("vllm")
    from transformers import AutoTokenizer
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        load_hidden_states,
    )

    _, model, data = assets
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    cfg = _config(tmp_path, model, data, after_generation="exit")
    spool = tmp_path / "spool"

    # With teacher.metrics_port: the endpoint answers while vLLM generates, its counters coming
    # from the engine's Publisher (the connector's stats file), and match the summary's.
    port = faults.free_port()
    scraper = Scraper(port)
    scraper.start()
    r = _run(cfg, "teacher.max_samples=4", f"teacher.metrics_port={port}")
    seen = scraper.stop()
    assert r.returncode == 0, r.stderr[-3000:]
    s = _summary(cfg)
    assert (s["exit_code"], s["samples"], s["spooled"], s["committed"], s["total"]) == (0, 4, 4, 0, 4)
    assert [m for m in seen if one(m, "distill_teacher_phase", phase="generate") == 1], len(seen)
    assert max(one(m, "distill_samples_spooled_total") for m in seen) == 4  # no serve phase here
    assert (s["transport"]["submitted"], s["transport"]["spooled"]) == (4, 4), s["transport"]
    assert s["tokens"] > 0 and [p["phase"] for p in s["phases"]] == ["generate"]
    assert "spooled 4" in r.stderr  # the human line
    files = list_spool(spool)
    assert len(files) == 4
    tok = AutoTokenizer.from_pretrained(model)
    for row in rows[:4]:
        path = spool / spool_name(row["id"])
        d = load_hidden_states(str(path))  # vLLM's own reader (takes the shared flock)
        ids = tok(row["text"])["input_ids"]
        assert d["token_ids"].tolist() == ids
        assert d["hidden_states"].shape == (len(ids), 3, 128)
        s = read_spool_file(path)
        assert s.key == row["id"] and s.layers == [1, 2, 4]
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in files}

    # A student committed row 4 in the meantime (journal), rows 0-3 are in the spool: only row 5 runs.
    (tmp_path / "journal.txt").write_text(rows[4]["id"] + "\n")
    r = _run(cfg, "teacher.max_samples=6")
    assert r.returncode == 0, r.stderr[-3000:]
    s = _summary(cfg)
    assert (s["samples"], s["committed_at_start"], s["spooled"], s["total"]) == (1, 1, 5, 6)
    after = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in list_spool(spool)}
    assert set(after) == set(before) | {spool_name(rows[5]["id"])}
    assert all(after[n] == before[n] for n in before)  # nothing re-sent
    assert not (spool / spool_name(rows[4]["id"])).exists()
    assert not [p for p in spool.iterdir() if p.name.endswith(".tmp")]

    # Everything generated: exits at once, without starting vLLM.
    t = time.monotonic()
    r = _run(cfg, "teacher.max_samples=6")
    assert r.returncode == 0 and "wait in the spool" in r.stderr, r.stderr[-3000:]
    assert "EngineCore" not in r.stderr and time.monotonic() - t < 30
    assert _summary(cfg)["samples"] == 0


# ---------------------------------------------------------------------------------------------
# Serve phase without vLLM: every key already in the spool (a restarted teacher).
# ---------------------------------------------------------------------------------------------


def _spool_rows(spool: Path, keys: list[str]) -> None:
    """Spool files as the engine phase leaves them (synthetic tensors: the serve phase only replays)."""
    import torch

    from distill.protocol import Sample
    from distill.spool import write_sample

    for i, k in enumerate(keys):
        t = 3 + i % 4
        hs = torch.full((t, 3, 128), float(i))
        write_sample(
            spool,
            Sample(key=k, tensors={"hidden_states": hs, "token_ids": torch.arange(t)}, layers=[1, 2, 4]),
        )


def _spooled_run(tmp_path: Path, model: Path, n: int, seed: int, **teacher) -> tuple[list[str], Path, str]:
    """A dataset of `n` rows, every row already in the spool, and a run config for it: (keys,
    config, the teacher's endpoint)."""
    data = write_tiny_dataset(tmp_path / "d.jsonl", n, seed=seed)
    keys = [json.loads(x)["id"] for x in data.read_text().splitlines()]
    _spool_rows(tmp_path / "spool", keys)
    cfg = _config(tmp_path, model, data, **teacher)
    return keys, cfg, yaml.safe_load(cfg.read_text())["transport"]["bind"][0]


@contextlib.contextmanager
def _student(endpoint: str, **kw):
    """A _Student running beside the block; halted and joined after it."""
    st = _Student(endpoint, **kw)
    st.start()
    try:
        yield st
    finally:
        st.halt.set()
        st.join(timeout=10)


class _Student(threading.Thread):
    """A Subscriber in the test process: acks (= commits) every sample, records keys and END."""

    def __init__(
        self, endpoint: str, *, commit_on_ack: bool = True, leave_after: int = 0, delay_s: float = 0.0, **cfg
    ):
        super().__init__(daemon=True)
        self.delay_s = delay_s  # time "training" each sample before the ack
        self.cfg = TransportConfig(connect=[endpoint], shm="off", **cfg)
        self.commit_on_ack = commit_on_ack
        self.leave_after = leave_after  # > 0: leave (BYE) after this many samples, committing nothing
        self.keys: list[str] = []
        self.finished = False
        self.error: BaseException | None = None
        self.halt = threading.Event()

    def run(self) -> None:
        try:
            with Subscriber(self.cfg, commit_on_ack=self.commit_on_ack) as sub:
                while not self.halt.is_set():
                    s = sub.get(timeout=0.2)
                    if s is None:
                        if sub.finished:
                            break
                        continue
                    self.keys.append(s.key)
                    if self.delay_s:
                        time.sleep(self.delay_s)
                    sub.ack(s)
                    if self.leave_after and len(self.keys) >= self.leave_after:
                        time.sleep(1.0)  # the acks reach the teacher before BYE (a transport test's job)
                        break
                self.finished = sub.finished
        except BaseException as e:  # surfaced by the test
            self.error = e


@pytest.mark.slow
def test_restart_with_every_key_spooled_serves_the_spool_and_exits_0(assets, tmp_path):
    _, model, _ = assets
    keys, cfg, ep = _spooled_run(tmp_path, model, 6, 3, student_wait_s=120, progress_every_s=1)
    with _student(ep) as student:
        r = _run(cfg, timeout=180)
        student.join(timeout=30)  # END ends it
    assert r.returncode == 0, r.stderr[-3000:]
    assert "EngineCore" not in r.stderr  # nothing to generate: vLLM never started
    assert student.error is None and student.finished, "the student got END"
    assert sorted(student.keys) == sorted(keys)
    assert set((tmp_path / "journal.txt").read_text().split()) == set(keys)
    assert list_spool(tmp_path / "spool") == []
    s = _summary(cfg)
    assert (s["exit_code"], s["committed"], s["total"], s["samples"], s["spooled"]) == (0, 6, 6, 0, 0)
    assert [p["phase"] for p in s["phases"]] == ["serve"] and s["phases"][0]["served"] == 6
    assert "distill-teacher: serving: committed" in r.stderr  # progress lines


# The engine phase's Publisher still draining when the serve phase starts: a real Publisher in a
# process the teacher started (as vLLM's worker is), holding the journal and two samples a student
# has not acked for HOLD_S (more than the 10 s the serve phase used to wait), then spooling them.
_HOLDER = """
import sys, time, torch
from distill.config import SpoolConfig, TransportConfig
from distill.protocol import Sample
from distill.transport import Publisher
journal, spool, ep, hold, *keys = sys.argv[1:]
cfg = TransportConfig(bind=[ep], connect_timeout_s=600, shm="off")
pub = Publisher(cfg, SpoolConfig(dir=spool), journal=journal, auto_end=False).start()
for k in keys:
    t = torch.zeros((3, 3, 128))
    pub.submit(Sample(key=k, tensors={"hidden_states": t, "token_ids": torch.arange(3)}, layers=[1, 2, 4]))
print("holding", flush=True)
time.sleep(float(hold))  # draining: a student holds these samples and does not ack
pub.close()  # spools them, releases the journal
"""
_DRAINING_ENGINE = """
import subprocess, sys
import teacher.cli as cli
from teacher.run.results import GenerateResult
def generate(r, todo, stop, rnd):  # the engine generated `todo`; its Publisher holds them
    args = [r.cfg.journal, str(r.spool_dir), *sys.argv[2:4], *todo]
    holder = subprocess.Popen([sys.executable, "-c", sys.argv[1], *args], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "holding"
    return GenerateResult(round=rnd, todo=len(todo))
cli.generate = generate
sys.exit(cli.main(sys.argv[4:]))
"""


@pytest.mark.slow
def test_serve_phase_waits_for_the_engines_publisher_while_it_drains(assets, tmp_path):
    """The serve phase starts while the engine's Publisher (a process of this teacher) still holds
    the journal, draining past 10 s: it waits for it, saying so, then serves what it spooled too."""
    _, model, _ = assets
    keys, cfg, ep = _spooled_run(tmp_path, model, 6, 11, student_wait_s=120, progress_every_s=1)
    for k in keys[:2]:  # generated: in the engine's memory, not yet in the spool
        (tmp_path / "spool" / spool_name(k)).unlink()
    hold_s = 12.0
    engine_ep = f"tcp://127.0.0.1:{faults.free_port()}"
    args = [_HOLDER, engine_ep, str(hold_s)]
    with _student(ep) as student:
        t = time.monotonic()
        r = subprocess.run(
            [sys.executable, "-c", _DRAINING_ENGINE, *args, "--config", str(cfg)],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        took = time.monotonic() - t
        student.join(timeout=30)  # END ends it
    assert r.returncode == 0, r.stderr[-3000:]
    assert took > hold_s
    waits = [x for x in r.stderr.splitlines() if "waiting for the engine's publisher" in x]
    assert len(waits) >= hold_s - 3, r.stderr[-3000:]  # one a second (progress_every_s=1)
    assert "at most 95s" in waits[0] and "to release the journal" in waits[0]
    assert student.error is None and student.finished, "the student got END"
    assert sorted(student.keys) == sorted(keys)  # every sample once, the drained ones too
    assert set((tmp_path / "journal.txt").read_text().split()) == set(keys)


@pytest.mark.slow
def test_distill_finish_serves_a_served_teachers_spool_and_sends_end(tmp_path):
    """`distill-finish` (teacher/finish.py) with a `vllm serve` teacher's --kv-transfer-config: what
    the stopped server spooled reaches the student once, then END; refused while the endpoint is
    still in use (the server runs). No vLLM: the spool is the server's leftovers, and its flow file
    (the server's connector writes it at shutdown) names a second student it was serving, which
    never comes: after END it is waited for (at most transport.teacher_wait_s, 5 s here) and named."""
    import zmq

    keys = ["srv-a", "srv-b", "srv-c"]
    _spool_rows(tmp_path / "spool", keys)
    ep = f"tcp://127.0.0.1:{faults.free_port()}"
    extra = {
        "transport": {"bind": [ep]},
        "spool": {"dir": str(tmp_path / "spool")},
        "journal": str(tmp_path / "j.txt"),
    }
    extra["transport"]["teacher_wait_s"] = 5.0  # bounds the wait for the student that never comes
    kv = json.dumps({"kv_connector": "DistillHiddenStatesConnector", "kv_connector_extra_config": extra})
    cmd = [sys.executable, "-m", "teacher.finish", "--kv-transfer-config", kv, "--progress-every-s", "1"]

    ctx = zmq.Context()
    server = ctx.socket(zmq.ROUTER)  # the vllm serve teacher's connector, still running
    server.bind(ep)
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    finally:
        server.close(0)
        ctx.term()
    assert r.returncode == 2, r.stderr[-3000:]
    assert "stop the vllm serve teacher first" in r.stderr

    flow = tmp_path / "j.txt.flow-4242.json"
    flow.write_text(json.dumps({"flow_s": 1.0, "student_names": ["gone-student"]}))
    with _student(ep) as student:
        t0 = time.monotonic()
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
        took = time.monotonic() - t0
        student.join(timeout=30)  # END ends it
    assert r.returncode == 0, r.stderr[-3000:]
    assert "distill-finish: END sent" in r.stderr
    assert student.error is None and student.finished, "the student got END"
    assert sorted(student.keys) == keys  # each once
    missing = [x for x in r.stderr.splitlines() if "END may not have reached" in x]
    assert len(missing) == 1 and "gone-student" in missing[0], r.stderr[-3000:]
    assert took >= 4.0 and not flow.exists()
    assert set((tmp_path / "j.txt").read_text().split()) == set(keys)
    assert list_spool(tmp_path / "spool") == []


@pytest.mark.slow
def test_serve_phase_replays_only_this_runs_spool_files(assets, tmp_path):
    """A spool folder also holding another dataset's samples: the serve phase replays this run's
    keys only (one log line names what it left), ends with END, and leaves the others in place."""
    _, model, _ = assets
    keys, cfg, ep = _spooled_run(tmp_path, model, 3, 13, student_wait_s=120, progress_every_s=1)
    _spool_rows(tmp_path / "spool", ["other-0", "other-1"])  # another dataset's, same folder
    with _student(ep) as student:
        r = _run(cfg, timeout=120)
        student.join(timeout=30)  # END ends it
    assert r.returncode == 0, r.stderr[-3000:]
    assert student.error is None and student.finished, "the student got END"
    assert sorted(student.keys) == sorted(keys)  # nothing of the other dataset
    line = [x for x in r.stderr.splitlines() if "outside this run not replayed" in x]
    assert len(line) == 1 and ": 2 files of keys" in line[0], r.stderr[-3000:]
    assert {p.name for p in list_spool(tmp_path / "spool")} == {spool_name("other-0"), spool_name("other-1")}
    assert "END was not sent" not in r.stderr


@pytest.mark.slow
def test_students_never_come_exit_3_with_the_spool_intact(assets, tmp_path):
    _, model, _ = assets
    _, cfg, _ = _spooled_run(tmp_path, model, 3, 5, student_wait_s=3, progress_every_s=1)
    before = sorted(p.name for p in list_spool(tmp_path / "spool"))
    t = time.monotonic()
    r = _run(cfg, timeout=120)
    assert r.returncode == 3, r.stderr[-3000:]
    assert time.monotonic() - t < 60
    line = [x for x in r.stderr.splitlines() if "no student progress" in x]
    assert len(line) == 1, r.stderr[-3000:]
    assert "3 of 3 samples not trained (3 in the spool" in line[0] and str(tmp_path / "spool") in line[0]
    assert f"distill-teacher --config {cfg}" in line[0]
    assert sorted(p.name for p in list_spool(tmp_path / "spool")) == before
    s = _summary(cfg)
    assert (s["exit_code"], s["spooled"], s["committed"], s["reason"]) == (3, 3, 0, "students gone")


# The real distill-teacher, with one fault injected into its Publisher (the only mock here): the
# I/O thread's third send raises, as a bug or an OSError there would.
_FAILING_SEND = """
import sys
from distill.publisher import Publisher
real, calls = Publisher._send_sample, [0]
def send(self, st, e):
    calls[0] += 1
    if calls[0] == 3:
        raise RuntimeError("injected fault")
    return real(self, st, e)
Publisher._send_sample = send
from teacher.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_publisher_failing_while_serving_exits_1_at_once_and_a_restart_finishes(assets, tmp_path):
    """The serve phase's I/O thread dies: the teacher says so in one line and exits 1 within
    seconds (not after student_wait_s), every uncommitted key still in the spool; the printed
    command, run again without the fault, trains the rest and exits 0."""
    _, model, _ = assets
    keys, cfg, ep = _spooled_run(tmp_path, model, 6, 11, student_wait_s=120, progress_every_s=1)
    t = time.monotonic()
    with _student(ep):
        r = subprocess.run(
            [sys.executable, "-c", _FAILING_SEND, "--config", str(cfg)],
            cwd=ROOT, capture_output=True, text=True, timeout=100,
        )  # fmt: skip
        took = time.monotonic() - t
    assert r.returncode == 1, r.stderr[-3000:]
    assert took < 60, f"{took:.0f}s: the teacher waited for students instead of stopping"
    line = [x for x in r.stderr.splitlines() if "serving stopped" in x]
    assert len(line) == 1, r.stderr[-3000:]
    assert "publisher I/O thread failed: RuntimeError('injected fault')" in line[0]
    assert f"Restart to finish: distill-teacher --config {cfg}" in line[0]
    assert "Traceback" not in r.stderr.split("publisher I/O thread failed")[-1]
    committed = set((tmp_path / "journal.txt").read_text().split()) & set(keys)
    spooled = {k for k in keys if (tmp_path / "spool" / spool_name(k)).exists()}
    assert spooled | committed >= set(keys), "a key is neither committed nor in the spool"
    assert _summary(cfg)["exit_code"] == 1

    with _student(ep) as again:
        r2 = _run(cfg, timeout=180)
        again.join(timeout=30)  # END ends it
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert again.error is None and again.finished
    assert sorted(again.keys) == sorted(set(keys) - committed), "each key left was trained once"
    assert set((tmp_path / "journal.txt").read_text().split()) >= set(keys)
    assert list_spool(tmp_path / "spool") == []
    assert _summary(cfg)["committed"] == 6


# ---------------------------------------------------------------------------------------------
# Start-up errors: clear, one line, before vLLM starts (no vLLM needed).
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, expected",
    [
        ("teacher.model=/nonexistent/model", "teacher.model: '/nonexistent/model' is not a folder"),
        (
            "teacher.layer_ids=[1,5]",
            "teacher.layer_ids: [5] out of range for a model with num_hidden_layers=4",
        ),
        ("teacher.enable_chunked_prefill=true", "enable_chunked_prefill must be false"),
        ("teacher.dataset=/nonexistent.jsonl", "teacher.dataset: '/nonexistent.jsonl' does not exist"),
        ("teacher.layerids=[1]", "unknown key 'teacher.layerids'"),
        ("teacher.max_tokens=0", "'teacher.max_tokens'"),
        ("transport.bind=[nope]", "must start with tcp://"),
    ],
)
def test_config_errors_are_clear(assets, tmp_path, capsys, override, expected):
    _, model, data = assets
    cfg = _config(tmp_path, model, data)
    assert main(["--config", str(cfg), "--set", override]) == 2
    err = capsys.readouterr().err
    assert expected in err, err
    assert err.startswith("distill-teacher: error: ") and "Traceback" not in err


@pytest.mark.slow
def test_unreadable_dataset_and_no_traceback(assets, tmp_path):
    _, model, _ = assets
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "text": "fine"}\nnot json\n')
    cfg = _config(tmp_path, model, bad)
    r = _run(cfg)
    assert r.returncode == 2
    assert f"distill-teacher: bad row: {bad}:2: not valid JSON" in r.stderr
    assert "Traceback" not in r.stderr and "EngineCore" not in r.stderr  # failed before vLLM started


def _bad_rows_dataset(tmp_path) -> Path:
    ds = tmp_path / "bad-rows.jsonl"
    ds.write_text(
        '{"id": "good", "text": "fine"}\n'
        '{"id": "empty", "text": ""}\n'
        '{"id": "null", "text": null}\n'
        "{not json\n"
        '{"id": "type", "text": ["a"]}\n'
        '{"id": "long", "text": "' + " ".join(["word"] * 40) + '"}\n'
    )
    return ds


@pytest.mark.slow
def test_bad_rows_fail_one_line_each_before_vllm(assets, tmp_path):
    _, model, _ = assets
    ds = _bad_rows_dataset(tmp_path)
    r = _run(_config(tmp_path, model, ds, max_model_len=8))
    assert r.returncode == 2, r.stderr[-3000:]
    lines = [x for x in r.stderr.splitlines() if x.startswith("distill-teacher: bad row: ")]
    assert lines == [
        f"distill-teacher: bad row: {ds}:2 ('empty'): field 'text' is empty",
        f"distill-teacher: bad row: {ds}:3 ('null'): field 'text' is null",
        f"distill-teacher: bad row: {ds}:4: not valid JSON (Expecting property name enclosed in double "
        "quotes: line 1 column 2 (char 1))",
        f"distill-teacher: bad row: {ds}:5 ('type'): field 'text' must be a string, got list",
    ]
    assert (
        f"distill-teacher: error: teacher.dataset: {ds}:2 ('empty'): field 'text' is empty (and 3 more "
        in r.stderr
    )
    assert "Traceback" not in r.stderr and "EngineCore" not in r.stderr
    # on_too_long=fail: every row is tokenized before vLLM starts
    r = _run(
        _config(tmp_path, model, ds, max_model_len=8, on_bad_row="skip", on_too_long="fail"),
    )
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"{ds}:6 ('long'): " in r.stderr and "(teacher.on_too_long=fail" in r.stderr
    assert "Traceback" not in r.stderr and "EngineCore" not in r.stderr


@pytest.mark.slow
def test_skipped_rows_exit_6_with_the_skipped_file_and_summary(assets, tmp_path):
    """on_bad_row=skip, on_too_long=skip: the run ends (skipped keys are not waited for), exit 6
    (not 4: a student's "peer rank gone"; no code means two things). "good" is committed already,
    so no row needs vLLM."""
    from student.train import EXIT_PEER_LOST, EXIT_TEACHER_GONE, EXIT_USER_ERROR

    _, model, _ = assets
    ds = _bad_rows_dataset(tmp_path)
    (tmp_path / "journal.txt").write_text("good\n")
    cfg = _config(tmp_path, model, ds, max_model_len=8, on_bad_row="skip", after_generation="exit")
    r = _run(cfg)
    assert r.returncode == 6, r.stderr[-3000:]
    assert r.returncode not in (EXIT_USER_ERROR, EXIT_TEACHER_GONE, EXIT_PEER_LOST)
    assert "EngineCore" not in r.stderr and "Traceback" not in r.stderr
    assert "distill-teacher: skipped row 'long': " in r.stderr
    s = _summary(cfg)
    assert (s["exit_code"], s["skipped"], s["skipped_bad_rows"], s["skipped_too_long"]) == (6, 5, 4, 1)
    assert (s["total"], s["committed"], s["truncated"]) == (1, 1, 0)
    recs = [json.loads(x) for x in Path(s["skipped_file"]).read_text().splitlines()]
    assert s["skipped_file"] == str(tmp_path / "journal.txt.skipped.jsonl")
    assert [(x["key"], x["where"]) for x in recs] == [
        ("empty", f"{ds}:2"),
        ("null", f"{ds}:3"),
        (None, f"{ds}:4"),
        ("type", f"{ds}:5"),
        ("long", None),
    ]
    assert recs[-1]["reason"].endswith("prompt tokens > max_model_len - max_tokens = 7")


def test_missing_config_file(capsys):
    assert main(["--config", "/nonexistent.yaml"]) == 2
    assert "config file '/nonexistent.yaml' not found" in capsys.readouterr().err


def test_connector_extra_config_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.mode"):
        ConnectorConfig.from_extra({"mode": "fast"})
    with pytest.raises(ConfigError, match=r"unknown key 'kv_connector_extra_config\.shared_storage_path'"):
        ConnectorConfig.from_extra({"shared_storage_path": "/tmp"})
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.transport\.credit_samples"):
        ConnectorConfig.from_extra({"transport": {"credit_samples": 0}})
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({"transport": {"bind": ["tcp://127.0.0.1:7001"]}, "spool": {"dir": "x"}}))
    cfg = ConnectorConfig.from_extra({"run_file": str(run), "spool": {"keep": True}})
    assert cfg.transport.bind == ["tcp://127.0.0.1:7001"] and cfg.spool.dir == "x" and cfg.spool.keep


# ---------------------------------------------------------------------------------------------
# With vLLM and a student process: SIGTERM mid-run, restart; every sample arrives exactly once.
# ---------------------------------------------------------------------------------------------

RECEIVER = """
import json, sys
from distill.config import TransportConfig
from distill.transport import Subscriber
cfg = TransportConfig(connect=[sys.argv[1]], heartbeat_timeout_s=30, shm="off")
with Subscriber(cfg) as sub, open(sys.argv[2], "a", buffering=1) as out:
    for s in sub:
        out.write(json.dumps([s.key, int(s.tensors["token_ids"].shape[0]), list(s.layers)]) + "\\n")
        sub.ack(s)
"""


def _receiver(endpoint: str, out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", RECEIVER, endpoint, str(out)], cwd=ROOT)


@pytest.mark.vllm
@pytest.mark.slow
def test_student_process_sigterm_and_restart_deliver_each_sample_once(assets, tmp_path):
    pytest.importorskip("vllm")
    import signal

    _, model, _ = assets
    data = write_tiny_dataset(tmp_path / "d.jsonl", 48, seed=11)
    keys = [json.loads(x)["id"] for x in data.read_text().splitlines()]
    cfg = _config(tmp_path, model, data, window=1)
    ep = yaml.safe_load(cfg.read_text())["transport"]["bind"][0]
    journal = tmp_path / "journal.txt"
    got1, got2 = tmp_path / "got1.jsonl", tmp_path / "got2.jsonl"

    rec = _receiver(ep, got1)
    teacher = subprocess.Popen(
        [*CLI, "--config", str(cfg), "--set", "transport.connect_timeout_s=120"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and teacher.poll() is None:
            if journal.exists() and len(journal.read_text().splitlines()) >= 4:
                break
            time.sleep(0.05)
        teacher.send_signal(signal.SIGTERM)
        out1, _ = teacher.communicate(timeout=120)
    finally:
        if teacher.poll() is None:
            teacher.kill()
        rec.terminate()
        rec.wait(timeout=30)
    assert teacher.returncode in (0, 130), out1[-3000:]
    assert "Traceback" not in out1
    first = [json.loads(x)[0] for x in got1.read_text().splitlines()]
    assert len(first) == len(set(first)) >= 4
    # The generate phase's Publisher lives in vLLM's worker: its flow counters reach the summary
    # (this run's: the receiver trained from that Publisher, the journal shows its commits).
    s = _summary(cfg)
    gen = [p for p in s["phases"] if p["phase"] == "generate"]
    assert gen and gen[0]["flow_s"] > 0, s["phases"]
    assert s["sizing"]["flow_s"] >= gen[0]["flow_s"] and s["sizing"]["samples"] > 0, s["sizing"]

    # Restart: keys acked in the journal are not run again; spooled ones are replayed, the rest run.
    rec = _receiver(ep, got2)
    try:
        r = _run(cfg, "transport.connect_timeout_s=120")
        assert r.returncode == 0, r.stderr[-3000:]
        rec.wait(timeout=60)  # the teacher's END ends the receiver's loop
    finally:
        if rec.poll() is None:
            rec.kill()
    second = [json.loads(x)[0] for x in got2.read_text().splitlines()]
    assert sorted(first + second) == sorted(keys), "every sample exactly once across the two runs"
    assert set(journal.read_text().split()) == set(keys)
    assert list_spool(tmp_path / "spool") == []  # all acked: spool files removed
    assert not list(tmp_path.glob("journal.txt.flow-*")), "the counters' files are removed once read"


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("teacher_*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_validate_and_name_their_command(path, tmp_path):
    from distill.config import load_run_file
    from teacher.config import load_teacher_config

    first = path.read_text().splitlines()[0]
    assert first.startswith("# ") and "distill-teacher --config configs/" + path.name in first
    section = load_run_file(path).teacher
    if not Path(section["model"]).is_dir():
        # A model that is not on this machine (the GPU config's Qwen3-8B): `layer_ids: eagle3` is
        # resolved from its config.json, so a stand-in folder holds Qwen3-8B's num_hidden_layers.
        (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 36}))
        section = {**section, "model": str(tmp_path)}
    cfg = load_teacher_config(section)
    assert cfg.layer_ids and not cfg.enable_chunked_prefill


@pytest.mark.slow
def test_sigterm_while_serving_exits_130_with_the_spool_intact(assets, tmp_path):
    import signal

    _, model, _ = assets
    _, cfg, _ = _spooled_run(tmp_path, model, 3, 6, student_wait_s=120, progress_every_s=1)
    teacher = subprocess.Popen(
        [*CLI, "--config", str(cfg)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        line = ""
        while "serving: committed" not in line:  # the serve phase is up
            line = teacher.stdout.readline()
            assert line or teacher.poll() is None, "teacher exited early"
        teacher.send_signal(signal.SIGTERM)
        out, _ = teacher.communicate(timeout=60)
    finally:
        if teacher.poll() is None:
            teacher.kill()
    assert teacher.returncode == 130, out[-3000:]
    assert len(list_spool(tmp_path / "spool")) == 3
    s = _summary(cfg)
    assert (s["exit_code"], s["interrupted"], s["spooled"]) == (130, True, 3)


# ---------------------------------------------------------------------------------------------
# One teacher per journal for its whole life; a damaged journal (no vLLM: the serve phase only).
# ---------------------------------------------------------------------------------------------

# The real distill-teacher whose serve Publisher starts only once the test says so: the moment
# between the engine's shutdown and the serve phase, when no Publisher holds the journal's lock.
_GAP_BEFORE_SERVE = """
import sys, time
from pathlib import Path
from distill.publisher import Publisher
real, gap, go = Publisher.start, Path(sys.argv[1]), Path(sys.argv[2])
def start(self):
    gap.touch()
    deadline = time.monotonic() + 120
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return real(self)
Publisher.start = start
from teacher.cli import main
sys.exit(main(sys.argv[3:]))
"""


@pytest.mark.slow
def test_a_second_teacher_is_refused_for_the_whole_life_of_the_first(assets, tmp_path):
    """A second `distill-teacher` on the same journal is refused (exit 2, one line naming the first
    one's pid) between the first one's phases, when no Publisher holds the journal's lock, and
    while it serves; it starts nothing and writes no summary. The first one ends as usual."""
    import signal

    _, model, _ = assets
    _, cfg, _ = _spooled_run(tmp_path, model, 3, 12, student_wait_s=120, progress_every_s=1)
    gap, go, log = tmp_path / "gap", tmp_path / "go", tmp_path / "first.log"
    summary = tmp_path / "journal.txt.summary.json"
    with open(log, "w") as out:
        first = subprocess.Popen(
            [sys.executable, "-c", _GAP_BEFORE_SERVE, str(gap), str(go), "--config", str(cfg)],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    try:
        assert wait_until(lambda: gap.exists() or first.poll() is not None, 120), log.read_text()[-3000:]
        assert first.poll() is None, log.read_text()[-3000:]
        for when in ("between phases", "while serving"):
            second = _run(cfg, timeout=90)
            assert second.returncode == 2, (when, second.stderr[-3000:])
            line = [x for x in second.stderr.splitlines() if "is in use by another distill-teacher" in x]
            assert (
                len(line) == 1 and f"(pid {first.pid}, holding '{tmp_path / 'journal.txt.lock'}')" in line[0]
            )
            assert line[0].startswith("distill-teacher: error: teacher.journal: journal "), line
            assert "Traceback" not in second.stderr and "serving" not in second.stderr
            assert not summary.exists(), f"the second teacher wrote a summary ({when})"
            if when == "between phases":
                go.touch()
                assert wait_until(
                    lambda: "serving: committed" in log.read_text() or first.poll() is not None, 60
                )
                assert first.poll() is None, log.read_text()[-3000:]
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(10)
    assert first.returncode == 130, log.read_text()[-3000:]
    s = _summary(cfg)
    assert s["exit_code"] == 130 and s["teacher_id"].endswith(f"-{first.pid}") and s["spooled"] == 3


@pytest.mark.slow
def test_a_torn_journal_line_is_set_aside_and_no_commit_lands_on_it(assets, tmp_path):
    """The journal's last line torn (`row-00001` cut to `row-0000`, no newline), then the same
    command: one log line says so, the torn key counts as not committed (served again, not lost),
    and every commit of the run is a line of its own; exit 0, every key committed once."""
    _, model, _ = assets
    keys, cfg, ep = _spooled_run(tmp_path, model, 5, 13, student_wait_s=30, progress_every_s=1)
    journal = tmp_path / "journal.txt"
    journal.write_text(keys[0] + "\n" + keys[1][:-1])
    with _student(ep) as student:
        r = _run(cfg, timeout=180)
        student.join(timeout=30)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(student.keys) == sorted(keys[1:]), "the torn key is served again, the rest once"
    lines = journal.read_text().splitlines()
    assert sorted(lines) == sorted(keys), lines
    said = [x for x in r.stderr.splitlines() if "torn last line" in x]
    assert len(said) == 1 and f"journal {str(journal)!r} has a torn last line (b'{keys[1][:-1]}'" in said[0]
    (backup,) = tmp_path.glob("journal.txt.damaged-*")
    assert backup.read_text() == keys[0] + "\n" + keys[1][:-1]
    assert "Traceback" not in r.stderr and _summary(cfg)["exit_code"] == 0


@pytest.mark.slow
def test_binary_bytes_in_the_journal_are_set_aside_and_an_unreadable_one_is_one_line(assets, tmp_path):
    """Bytes that are no text appended to the journal, then the same command: no traceback, one
    log line naming the journal and what was set aside, the run finishes (exit 0, summary). A
    journal that cannot be read at all: exit 2, one line naming it, and the summary is written."""
    _, model, _ = assets
    keys, cfg, ep = _spooled_run(tmp_path, model, 4, 14, student_wait_s=30, progress_every_s=1)
    journal = tmp_path / "journal.txt"
    journal.write_bytes(
        keys[0].encode() + b"\n\x89PNG\r\n\x1a\n\x00\xff\xfe" + keys[1].encode() + b"\n\xff\xd8"
    )
    with _student(ep) as student:
        r = _run(cfg, timeout=180)
        student.join(timeout=30)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "UnicodeDecodeError" not in r.stderr
    said = [x for x in r.stderr.splitlines() if "damaged line" in x]
    assert len(said) == 1, r.stderr[-3000:]
    assert (
        f"journal {str(journal)!r} has 2 damaged lines (not UTF-8 text: line 2, 4) and a torn last line"
        in said[0]
    )
    assert sorted(student.keys) == sorted(keys[1:]), "the unreadable record's key is served again"
    assert set(keys) <= set(journal.read_text().splitlines())
    s = _summary(cfg)
    assert (s["exit_code"], s["committed"], s["total"], s["journal_error"]) == (0, 4, 4, None)

    shutil.rmtree(tmp_path / "spool")
    journal.unlink()
    journal.mkdir()  # unreadable as a journal (root reads through permissions)
    r = _run(cfg, timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "EngineCore" not in r.stderr
    line = [x for x in r.stderr.splitlines() if x.startswith("distill-teacher: error: teacher.journal: ")]
    assert len(line) == 1 and f"journal {str(journal)!r}: Is a directory; " in line[0], r.stderr[-3000:]
    s = _summary(cfg)
    assert s["exit_code"] == 2 and "Is a directory" in s["reason"] and "Is a directory" in s["journal_error"]


@pytest.mark.vllm
@pytest.mark.slow
def test_keys_lost_while_serving_are_generated_again(assets, tmp_path):
    """A student acks every spooled sample, then leaves (BYE) before any checkpoint covered them
    (commit_on_ack=False, no commit): the keys are lost. The teacher generates them again with vLLM
    and the next student gets each of them; then END and exit 0."""
    pytest.importorskip("vllm")
    _, model, _ = assets
    keys, cfg, ep = _spooled_run(tmp_path, model, 4, 9, student_wait_s=120)
    a = _Student(ep, commit_on_ack=False, leave_after=4)
    b = _Student(ep)
    a.start()
    teacher = subprocess.Popen(
        [*CLI, "--config", str(cfg), "--set", "transport.connect_timeout_s=120"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        a.join(timeout=120)
        assert sorted(a.keys) == sorted(keys) and a.error is None
        b.start()
        out, _ = teacher.communicate(timeout=400)
        b.join(timeout=30)
    finally:
        _kill_tree(teacher.pid)
        a.halt.set()
        b.halt.set()
        b.join(timeout=10)
    assert teacher.returncode == 0, out[-3000:]
    assert b.error is None and b.finished and sorted(b.keys) == sorted(keys), (b.keys, out[-3000:])
    s = _summary(cfg)
    assert (s["committed"], s["lost"], s["samples"]) == (4, 4, 4), out[-3000:]
    assert [p["phase"] for p in s["phases"]] == ["serve", "generate", "serve"]
    assert s["phases"][0]["outcome"] == "lost"


# ---------------------------------------------------------------------------------------------
# With vLLM: the engine core killed mid-run -> exit 1 with what is missing, no END, no hang.
# ---------------------------------------------------------------------------------------------


def _kill_tree(pid: int) -> None:
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def _engine_core(pid: int):
    import psutil

    for p in psutil.Process(pid).children(recursive=True):
        try:
            if "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline()):
                return p
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


@pytest.mark.vllm
@pytest.mark.slow
def test_spool_filesystem_full_exits_1_naming_it_and_a_restart_with_room_finishes(assets, tmp_path):
    """spool.dir on a real 200 kB tmpfs (a mount namespace of its own), no spool.max_bytes, nobody
    connected: the connector's spool write fails in vLLM's worker and the engine dies. The one
    line says the spool's filesystem is full and what to set; no partial file is left. With the
    tmpfs grown to 64 MB, the same command spools every sample and exits 0."""
    pytest.importorskip("vllm")
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare to mount a small tmpfs in a mount namespace of its own")
    _, model, _ = assets
    data = write_tiny_dataset(tmp_path / "d.jsonl", 12, seed=21)
    cfg = _config(tmp_path, model, data, after_generation="exit")
    spool = tmp_path / "spool"
    spool.mkdir()
    cli = shlex.join([*CLI, "--config", str(cfg)])
    script = (
        f"mount -t tmpfs -o size=200k tmpfs {spool} || exit 90; "
        f"{cli}; echo FIRST_RC=$?; ls -a {spool}; echo LISTED; "
        f"mount -o remount,size=64m {spool} || exit 91; {cli}; echo SECOND_RC=$?; ls {spool}"
    )
    r = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script],
        cwd=ROOT, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "FIRST_RC=1" in r.stdout and "SECOND_RC=0" in r.stdout, out[-4000:]
    died = [x for x in r.stderr.splitlines() if x.startswith("distill-teacher: the vLLM engine died")]
    assert len(died) == 1, out[-4000:]
    assert f"spool.dir {spool} is full" in died[0] and "spool.max_bytes" in died[0], died[0]
    assert f"Restart to finish: distill-teacher --config {cfg}" in died[0]
    first = r.stdout.split("FIRST_RC=1", 1)[1].split("LISTED", 1)[0].split()
    assert not [n for n in first if n.endswith(".tmp")], first  # whole files only
    second = r.stdout.split("SECOND_RC=0", 1)[1].split()
    assert len([n for n in second if n.endswith(".safetensors")]) == 12, second


@pytest.mark.vllm
@pytest.mark.slow
def test_spool_max_bytes_full_and_no_student_exits_1_saying_so_and_more_room_finishes(assets, tmp_path):
    """after_generation: exit, spool.max_bytes far below the dataset, nobody connected: the sender
    waits for room that never comes, yet the run ends by itself with exit 1: at shutdown the
    connector stops waiting after drain_timeout_s and says how many samples it left unplaced (vLLM
    never has to kill its worker), and distill-teacher's line names spool.max_bytes instead of 'run
    again' (which would stop at the same place). The spool stays within the limit (or holds one
    sample). The same command without the limit generates only the missing rows: every row is then
    in the spool once."""
    pytest.importorskip("vllm")
    _, model, _ = assets
    data = write_tiny_dataset(tmp_path / "d.jsonl", 24, seed=23)
    keys = [json.loads(x)["id"] for x in data.read_text().splitlines()]
    cfg = _config(tmp_path, model, data, after_generation="exit")
    spool = tmp_path / "spool"
    limit = 100_000
    r = _run(cfg, f"spool.max_bytes={limit}", timeout=400)
    assert r.returncode == 1, r.stderr[-3000:]
    said = [x for x in r.stderr.splitlines() if f"spool.max_bytes ({limit} bytes) is full" in x]
    assert len(said) == 1, r.stderr[-3000:]
    assert "no student took samples" in said[0] and "Raise spool.max_bytes" in said[0], said[0]
    assert f"distill-teacher --config {cfg}" in said[0], said[0]
    logs = r.stdout + r.stderr  # (vLLM's worker logs to either, by its logging settings)
    left = [x for x in logs.splitlines() if "spool.max_bytes is full and no student takes samples" in x]
    assert len(left) == 1 and "samples queued at shutdown are not placed" in left[0], logs[-3000:]
    assert "still running after grace period" not in logs, logs[-3000:]  # vLLM killed nothing
    files = list_spool(spool)
    first = {read_spool_file(f).key for f in files}
    assert 0 < len(first) < len(keys), first
    # Within the limit, except that an empty spool takes one sample of any size (else a sample
    # larger than the limit would block the teacher for good).
    assert sum(f.stat().st_size for f in files) <= limit or len(files) == 1, [f.stat().st_size for f in files]
    r = _run(cfg, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    s = _summary(cfg)
    assert (s["exit_code"], s["samples"], s["spooled"]) == (0, len(keys) - len(first), len(keys)), s
    spooled = [read_spool_file(f).key for f in list_spool(spool)]
    assert sorted(spooled) == sorted(keys)  # each row once; the first run's files kept as they were


@pytest.mark.vllm
@pytest.mark.slow
def test_engine_killed_mid_run_exits_1_and_never_sends_end(assets, tmp_path):
    pytest.importorskip("vllm")
    _, model, _ = assets
    data = write_tiny_dataset(tmp_path / "d.jsonl", 64, seed=13)
    # 256 generated tokens per row, one request at a time: generation takes far longer than the
    # first three commits, so the engine is killed while it generates (prefill alone finished all
    # 64 rows in 0.6 s under CI, before the kill: the kill then hit the engine's shutdown).
    cfg = _config(tmp_path, model, data, window=1, student_wait_s=60, max_tokens=256)
    # A slow student and small memory and spool limits pace the producer too.
    run = yaml.safe_load(cfg.read_text())
    run["transport"]["max_buffer_bytes"] = 64 << 10
    run["spool"]["max_bytes"] = 64 << 10
    cfg.write_text(yaml.safe_dump(run))
    ep = run["transport"]["bind"][0]
    journal = tmp_path / "journal.txt"
    # One sample in flight at a time, 0.2 s each: a few samples past the commits at most are
    # generated ahead (with the default credit of 32 the whole dataset could be, under load).
    student = _Student(ep, delay_s=0.2, credit_samples=1)
    student.start()
    teacher = subprocess.Popen(
        [*CLI, "--config", str(cfg), "--set", "transport.connect_timeout_s=120"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and teacher.poll() is None:
            if journal.exists() and len(journal.read_text().splitlines()) >= 3:
                if _engine_core(teacher.pid) is not None:
                    break
            time.sleep(0.05)
        core = _engine_core(teacher.pid)
        assert core is not None, "no EngineCore process under distill-teacher"
        core.kill()
        t_kill = time.monotonic()
        out, _ = teacher.communicate(timeout=120)  # bounded: the teacher must not hang
        took = time.monotonic() - t_kill
    finally:
        _kill_tree(teacher.pid)
        time.sleep(1.0)  # an END would have arrived by now
        student.halt.set()
        student.join(timeout=10)
    assert teacher.returncode == 1, out[-3000:]
    assert took < 90, took
    line = [x for x in out.splitlines() if "the vLLM engine died" in x]
    assert len(line) == 1 and "samples not committed" in line[0] and "no END was sent" in line[0], out[-3000:]
    assert not student.finished, "a teacher whose engine died must not send END"
    s = _summary(cfg)
    assert s["exit_code"] == 1 and s["reason"].startswith("engine died")
    assert 3 <= s["committed"] < 64 and s["not_committed"] == 64 - s["committed"]


@pytest.mark.vllm
@pytest.mark.slow
def test_connector_mode_spool_files_carry_teacher_id_and_seq_and_truncate(assets, tmp_path):
    """connector_mode: spool (no sockets in the engine): every sample is a file carrying the
    generate phase's teacher id and a real, distinct seq; on_too_long: truncate cuts long rows."""
    pytest.importorskip("vllm")
    _, model, data = assets
    cfg = _config(
        tmp_path,
        model,
        data,
        after_generation="exit",
        connector_mode="spool",
        max_model_len=16,
        on_too_long="truncate",
    )
    r = _run(cfg, "transport.teacher_id=tspool", "teacher.max_samples=5")
    assert r.returncode == 0, r.stderr[-3000:]
    s = _summary(cfg)
    assert (s["samples"], s["spooled"], s["skipped"]) == (5, 5, 0) and s["truncated"] > 0
    got = [read_spool_file(p) for p in list_spool(tmp_path / "spool")]
    assert len(got) == 5
    assert {x.teacher for x in got} == {"tspool-gen0"}
    assert sorted(x.seq for x in got) == [1, 2, 3, 4, 5]
    assert all(x.layers == [1, 2, 4] and x.tensors["token_ids"].numel() <= 15 for x in got)
    assert max(x.tensors["token_ids"].numel() for x in got) == 15  # truncated rows: exactly the limit


FAULTY = {"flip": "FlipConnector", "mislabel": "MislabelConnector"}


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("fault", ["", "flip", "mislabel"])
def test_live_probe_passes_clean_runs_and_catches_corrupted_samples(assets, tmp_path, fault):
    """teacher.verify_every: every 2nd sample is recomputed with transformers. A clean run (with
    unsorted layer ids) reports 0 mismatches; a flipped value (verify_fail=warn) is counted and the
    run ends 0; layers delivered under the wrong labels (verify_fail=stop) end the run with exit 5."""
    pytest.importorskip("vllm")
    _, model, data = assets
    cfg = _config(
        tmp_path,
        model,
        data,
        after_generation="exit",
        layer_ids=[4, 0, 2],
        verify_every=2,
        verify_fail="stop" if fault == "mislabel" else "warn",
    )
    if fault:  # a connector subclass that corrupts what it sends (tests/fault_connectors.py)
        c = yaml.safe_load(cfg.read_text())
        c["teacher"]["engine_args"] = {
            "kv_transfer_config": {
                "kv_connector": FAULTY[fault],
                "kv_connector_module_path": "fault_connectors",
            }
        }
        cfg.write_text(yaml.safe_dump(c))
    tests_dir = str(Path(__file__).resolve().parents[1])  # tests/fault_connectors.py
    path = os.pathsep.join(p for p in (tests_dir, os.environ.get("PYTHONPATH", "")) if p)
    r = _run(cfg, "teacher.max_samples=4", env={"PYTHONPATH": path})
    s = _summary(cfg)
    v = s["verify"]
    assert (v["every"], v["tolerance"], v["errors"], v["unchecked"]) == (2, 1e-3, 0, 0), v
    if fault == "":
        assert r.returncode == 0, r.stderr[-3000:]
        assert (v["probed"], v["mismatches"]) == (2, 0), v
        assert v["worst"]["rel_err"] < 1e-4
        assert "verify mismatch" not in r.stderr
    elif fault == "flip":
        assert r.returncode == 0, r.stderr[-3000:]
        assert (v["probed"], v["mismatches"]) == (2, 2), v
        assert v["mismatched"][0]["layer"] == 4  # slot 0 = layer 4 holds the flipped value
        assert "distill-teacher: verify mismatch: 'row-00000': worst layer 4: relative error" in r.stderr
    else:
        assert r.returncode == 5, r.stderr[-3000:]
        assert s["exit_code"] == 5 and v["mismatches"] >= 1 and "verify mismatch" in s["reason"]
        assert "distill-teacher: the live probe found" in r.stderr
    assert not list_spool(Path(f"{tmp_path / 'journal.txt'}.verify"))  # copies removed once checked


def _with_fault_connector(cfg: Path, name: str) -> str:
    """Point the run file's engine at tests/fault_connectors.py's `name`; returns the PYTHONPATH
    under which vLLM's worker imports it."""
    c = yaml.safe_load(cfg.read_text())
    c["teacher"]["engine_args"] = {
        "kv_transfer_config": {"kv_connector": name, "kv_connector_module_path": "fault_connectors"}
    }
    cfg.write_text(yaml.safe_dump(c))
    tests_dir = str(Path(__file__).resolve().parents[1])
    return os.pathsep.join(p for p in (tests_dir, os.environ.get("PYTHONPATH", "")) if p)


@pytest.mark.vllm
@pytest.mark.slow
def test_sender_failing_every_placement_ends_the_run_and_a_restart_finishes_it(assets, tmp_path):
    """The connector's sender thread cannot place any sample (tests/fault_connectors.py:
    FailPlaceConnector, as a broken spool disk would): distill-teacher ends by itself with exit 1,
    its one line naming the sender's error (not only vLLM's "engine died"), nothing committed or
    spooled; the same command with the plain connector then finishes the job (every row spooled,
    exit 0)."""
    pytest.importorskip("vllm")
    _, model, data = assets
    cfg = _config(tmp_path, model, data, after_generation="exit")
    plain = cfg.read_text()
    path = _with_fault_connector(cfg, "FailPlaceConnector")
    r = _run(cfg, "teacher.max_samples=4", env={"PYTHONPATH": path}, timeout=300)
    assert r.returncode == 1, r.stderr[-3000:]
    said = [ln for ln in r.stderr.splitlines() if ln.startswith("distill-teacher: the vLLM engine died")]
    assert said and "could not place a sample (OSError" in said[0] and "injected: no space left" in said[0], (
        r.stderr[-3000:]
    )
    s = _summary(cfg)
    assert s["exit_code"] == 1 and "injected: no space left" in s["reason"], s
    assert (s["committed"], s["spooled"], s["missing"]) == (0, 0, 4), s
    assert not list_spool(tmp_path / "spool")
    cfg.write_text(plain)  # the same run with the plain connector
    r = _run(cfg, "teacher.max_samples=4")
    assert r.returncode == 0, r.stderr[-3000:]
    s = _summary(cfg)
    assert (s["spooled"], s["missing"]) == (4, 0), s
    assert len(list_spool(tmp_path / "spool")) == 4


@pytest.mark.vllm
@pytest.mark.slow
def test_sender_failing_after_the_last_engine_step_is_named_and_generated_again(assets, tmp_path):
    """The sender fails to place the last sample only once vLLM shuts the connector down
    (tests/fault_connectors.py: FailLastConnector), when no engine step is left to stop the engine
    with it: distill-teacher names the sender's error and generates that sample again (a new
    engine), so the run ends by itself with every row spooled once. A sender that places none of
    its samples so ends the run with exit 1 (no endless rounds), and a restart finishes it."""
    pytest.importorskip("vllm")
    _, model, data = assets
    cfg = _config(tmp_path, model, data, after_generation="exit")
    path = _with_fault_connector(cfg, "FailLastConnector")
    r = _run(cfg, "teacher.max_samples=4", env={"PYTHONPATH": path, "FAIL_PLACE_FROM": "1"}, timeout=400)
    assert r.returncode == 1, r.stderr[-3000:]
    said = [ln for ln in r.stderr.splitlines() if "could not place" in ln or "placed none" in ln]
    assert len(said) == 2 and "could not place 4 samples after the engine's last step" in said[0], said
    assert "placed none of the 4 samples it was given" in said[1] and "Restart to finish" in said[1], said
    s = _summary(cfg)
    assert (s["exit_code"], s["spooled"], s["missing"]) == (1, 0, 4), s
    assert not list_spool(tmp_path / "spool")

    r = _run(cfg, "teacher.max_samples=4", env={"PYTHONPATH": path}, timeout=400)  # fails the 4th only
    assert r.returncode == 0, r.stderr[-3000:]
    said = [ln for ln in r.stderr.splitlines() if "could not place" in ln]
    assert len(said) == 1 and "could not place 1 samples after the engine's last step" in said[0], said
    assert "injected: the last sample could not be placed" in said[0], said
    assert "generating them again" in said[0], said
    s = _summary(cfg)
    assert (s["exit_code"], s["spooled"], s["missing"]) == (0, 4, 0), s
    assert [p["todo"] for p in s["phases"]] == [4, 1], s["phases"]  # the second engine got the one key
    assert len(list_spool(tmp_path / "spool")) == 4  # one file per key: none twice

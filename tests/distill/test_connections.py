"""A student's several connections to one teacher (transport.connections): samples spread over
them, the credit window split, acks back on the connection each sample came on, every sample
trained once, also when one connection's session is dropped and its samples redelivered on the
others; with CURVE on every connection."""

from __future__ import annotations

import collections
import inspect
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from faults import free_port
from waiting import wait_until

from distill.config import CurveConfig, SpoolConfig, TransportConfig
from distill.journal import Journal
from distill.keygen import make_keys
from distill.protocol import Sample
from distill.sockets import SETTLE_S
from distill.transport import Publisher, Subscriber

ROOT = Path(__file__).resolve().parents[2]


def _sample(i: int) -> Sample:
    return Sample(
        key=f"k{i:03d}",
        tensors={"hidden_states": torch.full((256, 2, 64), float(i)), "token_ids": torch.arange(256) + i},
        layers=[1, 2],
    )


def _cfgs(tmp_path, curve: bool, shm: str = "off", **student_kw) -> tuple[TransportConfig, TransportConfig]:
    ep = f"tcp://127.0.0.1:{free_port()}"
    common = dict(shm=shm, heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0)
    if shm != "off":
        common.update(shm_bytes=64 << 20, shm_dir=str(tmp_path))
    ct = cs = None
    if curve:
        d = tmp_path / "keys"
        make_keys(d, "teacher")
        make_keys(d / "students", "good")
        ct = CurveConfig(secret_key=str(d / "teacher.key_secret"), authorized_keys=str(d / "students"))
        cs = CurveConfig(
            secret_key=str(d / "students" / "good.key_secret"), server_key=str(d / "teacher.key")
        )
    t = TransportConfig(bind=[ep], io_threads=3, curve=ct, **common)
    s = TransportConfig(connect=[ep], curve=cs, **common, **student_kw)
    return t, s


def test_the_credit_window_is_split_among_the_connections():
    cfg = TransportConfig(
        connect=["tcp://a:1", "tcp://b:1"], credit_samples=64, credit_bytes=1 << 30, connections=3
    )
    assert cfg.connection_credit == (21, (1 << 30) // 3)
    assert cfg.credit_window == 21 * 3 * 2
    assert TransportConfig(credit_samples=2, connections=4).connection_credit[0] == 1  # one each at least
    with pytest.raises(ValueError):
        TransportConfig(connections=0)


@pytest.mark.parametrize(
    "curve, shm", [(False, "off"), (True, "off"), (True, "on")], ids=["tcp", "curve", "curve-shm"]
)
def test_samples_spread_over_a_students_connections_each_trained_once(tmp_path, curve, shm):
    """curve-shm: a student on the teacher's host with CURVE, where several connections are the
    default on a big host: the bytes come through the ring on every connection."""
    t_cfg, s_cfg = _cfgs(tmp_path, curve, shm, connections=3, credit_samples=6)
    journal = tmp_path / "journal.txt"
    n = 60
    got: collections.Counter = collections.Counter()
    via: collections.Counter = collections.Counter()
    with Publisher(t_cfg, SpoolConfig(dir=str(tmp_path / "spool")), journal=str(journal)) as pub:
        with Subscriber(s_cfg, name="s", commit_on_ack=False) as sub:
            assert wait_until(lambda: pub.stats()["sessions"] == 3, 15), pub.stats()
            assert pub.stats()["students"] == 1
            assert pub.student_names() == ["s", "s#1", "s#2"]
            for i in range(n):
                pub.submit(_sample(i))
            batch = []
            while sum(got.values()) < n:
                s = sub.get(timeout=20)
                assert s is not None, (pub.stats(), sub.stats())
                assert torch.equal(s.tensors["token_ids"], torch.arange(256) + int(s.key[1:]))
                got[s.key] += 1
                via[s.via] += 1
                batch.append(s)
                if len(batch) == 4:
                    sub.ack(batch)
                    batch = []
            sub.ack(batch)
            sub.commit()
            assert wait_until(lambda: len(Journal.read(journal).committed) == n, 15), pub.stats()
            assert sub.get(timeout=0.3) is None and not sub.finished  # nothing else came
    assert set(got) == {f"k{i:03d}" for i in range(n)} and max(got.values()) == 1
    assert len(via) == 3, via  # every connection carried samples (credit 2 each: none holds all)
    st = pub.stats()
    assert st["acked"] == n
    assert st["shm_samples"] == (n if shm == "on" else 0), st
    # The sizing figures count one student over its three connections (mean students = 1).
    assert st["flow_s"] > 0 and abs(st["student_s"] / st["flow_s"] - 1) < 1e-6, st


def test_a_connection_dropped_by_the_teacher_has_its_samples_redelivered_on_the_others(tmp_path):
    """The student stops heartbeating on its second connection while it holds samples it has not
    acked: the teacher declares that session gone and sends its samples again on the other two,
    where the student keeps each beside the copy it holds. Once the connection speaks again it is
    a new session. Every sample is handed to the consumer once, every one acked, and the stream
    ends by itself (END on every connection)."""
    t_cfg, s_cfg = _cfgs(tmp_path, False, connections=3, credit_samples=9)
    n = 30
    got: collections.Counter = collections.Counter()
    pub = Publisher(t_cfg, SpoolConfig(dir=str(tmp_path / "spool"))).start()
    sub = Subscriber(s_cfg, name="s").start()
    try:
        sessions = sub._sessions
        keepalive = sessions.keepalive
        muted = {"on": True}
        sessions.keepalive = lambda t, now: None if (t.lane == 1 and muted["on"]) else keepalive(t, now)
        for i in range(n):
            pub.submit(_sample(i))
        held = []
        while len(held) < 9:  # the whole window, not acked
            s = sub.get(timeout=20)
            assert s is not None, pub.stats()
            held.append(s)
        assert any(s.via.endswith("#1") for s in held), [s.via for s in held]
        assert wait_until(lambda: pub.stats()["redelivered"] >= 1, 15), pub.stats()
        muted["on"] = False
        for s in held:
            got[s.key] += 1
        sub.ack(held)
        pub.close_input()
        while True:
            s = sub.get(timeout=30)
            if s is None:
                break
            got[s.key] += 1
            sub.ack(s)
        assert sub.finished, (pub.stats(), sub.stats())
        assert set(got) == {f"k{i:03d}" for i in range(n)} and max(got.values()) == 1, got
        assert wait_until(lambda: pub.stats()["acked"] == n, 10), pub.stats()
    finally:
        sub.close()
        pub.close()


_STUDENT = """
import json, os, sys

from distill.config import CurveConfig, TransportConfig
from distill.transport import Subscriber

ep, keys, n, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
curve = CurveConfig(secret_key=keys + "/students/good.key_secret", server_key=keys + "/teacher.key")
cfg = TransportConfig(connect=[ep], curve=curve, shm="off", connections=2, credit_samples=4)
with Subscriber(cfg, name="s", commit_on_ack=False) as sub:
    got = 0
    while got < n:
        s = sub.get(timeout=60)
        assert s is not None, sub.stats()
        sub.ack([s])
        got += 1
    sub.commit()
    with open(out, "w") as f:
        json.dump(_io_ticks(), f)
"""


def _io_ticks(pid: int | str = "self") -> dict[str, int]:
    """CPU ticks (user + system) of each of the process's ZeroMQ I/O threads, by thread id."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                comm = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        if comm.startswith("ZMQbg/IO"):
            out[tid] = int(fields[11]) + int(fields[12])
    return out


def _spread(ticks: dict[str, int]) -> list[int]:
    """The busy threads' ticks, busiest first."""
    return sorted((t for t in ticks.values() if t > 0), reverse=True)


def test_a_students_curve_connections_are_encrypted_on_different_io_threads_at_both_ends(tmp_path):
    """Two CURVE connections of one student: the student's two I/O threads each decrypt, and the
    teacher's two each encrypt (connections made back to back would share one thread each side,
    and CURVE would run on one core however many connections there are)."""
    t_cfg, _ = _cfgs(tmp_path, True)
    t_cfg = t_cfg.model_copy(update={"io_threads": 2})
    ep = t_cfg.bind[0]
    n, out = 48, tmp_path / "student_ticks.json"
    script = tmp_path / "student.py"
    script.write_text(inspect.getsource(_io_ticks) + _STUDENT)
    big = {"hidden_states": torch.ones((1024, 4, 1024)), "token_ids": torch.arange(1024)}  # 16 MiB
    with Publisher(t_cfg, SpoolConfig(dir=str(tmp_path / "spool"))) as pub:
        before = _io_ticks()
        child = subprocess.Popen(
            [sys.executable, str(script), ep, str(tmp_path / "keys"), str(n), str(out)],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        try:
            assert wait_until(lambda: pub.stats()["sessions"] == 2, 30), pub.stats()
            for i in range(n):
                pub.submit(Sample(key=f"k{i:03d}", tensors=big, layers=[1, 2, 3, 4]))
            assert child.wait(timeout=120) == 0
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        after = _io_ticks()
        assert pub.stats()["acked"] == n
    teacher = _spread({t: after.get(t, 0) - before.get(t, 0) for t in after})
    student = _spread(json.loads(out.read_text()))
    for side, ticks in (("teacher", teacher), ("student", student)):
        assert len(ticks) >= 2 and ticks[1] >= 0.2 * ticks[0], (side, teacher, student)


def test_the_teacher_says_once_when_curve_sessions_outnumber_its_io_threads(tmp_path, caplog):
    t_cfg, s_cfg = _cfgs(tmp_path, True, connections=3)
    t_cfg = t_cfg.model_copy(update={"io_threads": 1})
    caplog.set_level(logging.INFO, logger="distill")
    hint = "share transport.io_threads=1 with CURVE on"
    with Publisher(t_cfg, SpoolConfig(dir=str(tmp_path / "spool"))) as pub:
        with Subscriber(s_cfg, name="s", commit_on_ack=False):
            assert wait_until(lambda: pub.stats()["sessions"] == 3, 15), pub.stats()
            assert wait_until(lambda: hint in caplog.text, 5), caplog.text[-2000:]
    assert caplog.text.count(hint) == 1, caplog.text[-2000:]
    # Enough I/O threads (or no CURVE): no hint.
    caplog.clear()
    t_cfg, s_cfg = _cfgs(tmp_path / "b", True, connections=2)  # io_threads 3
    with Publisher(t_cfg, SpoolConfig(dir=str(tmp_path / "spool2"))) as pub:
        with Subscriber(s_cfg, name="s", commit_on_ack=False):
            assert wait_until(lambda: pub.stats()["sessions"] == 2, 15), pub.stats()
            assert wait_until(lambda: "student s#1 connected" in caplog.text, 5), caplog.text[-2000:]
    assert "with CURVE on" not in caplog.text


def test_a_student_started_before_its_teacher_waits_once_and_every_connection_finds_it(tmp_path):
    """Nobody listening: the first connection's handshake wait ends the waiting (start takes about
    SETTLE_S, not one wait per connection); once the teacher binds, every connection reaches it and
    each sample arrives once."""
    t_cfg, s_cfg = _cfgs(tmp_path, True, connections=4, credit_samples=8)
    t0 = time.monotonic()
    with Subscriber(s_cfg, name="s", commit_on_ack=False) as sub:
        started_s = time.monotonic() - t0
        assert started_s < SETTLE_S + 1.0, started_s
        with Publisher(t_cfg, SpoolConfig(dir=str(tmp_path / "spool"))) as pub:
            assert wait_until(lambda: pub.stats()["sessions"] == 4, 20), pub.stats()
            for i in range(20):
                pub.submit(_sample(i))
            got = collections.Counter()
            while sum(got.values()) < 20:
                s = sub.get(timeout=20)
                assert s is not None, (pub.stats(), sub.stats())
                got[s.key] += 1
                sub.ack([s])
            assert wait_until(lambda: pub.stats()["acked"] == 20, 15), pub.stats()
    assert set(got) == {f"k{i:03d}" for i in range(20)} and max(got.values()) == 1

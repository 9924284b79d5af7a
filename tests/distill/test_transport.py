"""Transport over real sockets between real processes: exactly-once delivery, spool drain, student crash."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import faults
import pytest
from faults import free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
PEERS = str(ROOT / "tests" / "peers.py")
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, PEERS, *args], env=ENV)


def read_lines(path: Path) -> tuple[list[dict], dict | None]:
    recs, final = [], None
    if not path.exists():
        return recs, final
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        d = json.loads(line)
        if "stats" in d:
            final = d
        else:
            recs.append(d)
    return recs, final


def wait_all(procs, timeout=600):
    deadline = time.monotonic() + timeout
    for p in procs:
        p.wait(timeout=max(1, deadline - time.monotonic()))
    return [p.returncode for p in procs]


@pytest.mark.slow
def test_two_students_get_every_sample_exactly_once_bit_identical(tmp_path):
    """1,000 samples of mixed sizes (up to 64 MiB, bf16 and fp32), one student on the shared-memory
    path and one on frames: every sample arrives exactly once, bit-identical (CRC32 per sample)."""
    ep = f"tcp://127.0.0.1:{free_port()}"
    n = 1000
    t = spawn(
        "teacher",
        "--bind",
        ep,
        "--n",
        str(n),
        "--out",
        str(tmp_path / "t.jsonl"),
        "--spool",
        str(tmp_path / "spool"),
    )
    s1 = spawn("student", "--connect", ep, "--out", str(tmp_path / "s1.jsonl"), "--shm", "auto")
    s2 = spawn("student", "--connect", ep, "--out", str(tmp_path / "s2.jsonl"), "--shm", "off")
    assert wait_all([t, s1, s2]) == [0, 0, 0]
    sent, tfinal = read_lines(tmp_path / "t.jsonl")
    r1, f1 = read_lines(tmp_path / "s1.jsonl")
    r2, f2 = read_lines(tmp_path / "s2.jsonl")
    assert len(sent) == n and tfinal["done"]
    expected = {r["key"]: r["crc"] for r in sent}
    got = Counter(r["key"] for r in r1 + r2)
    assert set(got) == set(expected)
    assert max(got.values()) == 1, "a sample arrived twice"
    for r in r1 + r2:
        assert r["crc"] == expected[r["key"]], f"{r['key']} differs"
    assert {r["dtype"] for r in r1 + r2} == {"torch.bfloat16", "torch.float32"}
    assert max(x["nbytes"] for x in sent) >= 64 * (1 << 20)
    # Both students got work; the shared-memory path was used by the first, frames by the second.
    assert r1 and r2
    assert f1["stats"]["shm_samples"] == len(r1) and f2["stats"]["shm_samples"] == 0
    st = tfinal["stats"]
    assert st["sent"] == st["acked"] == n and st["redelivered"] == 0 and st["rejected"] == 0


@pytest.mark.slow
def test_spool_without_students_then_drain_to_students(tmp_path):
    """No student connected: samples spool to files; students connect later: the spool drains to
    them and the counts match exactly (and the spool folder ends empty)."""
    ep = f"tcp://127.0.0.1:{free_port()}"
    n = 120
    spool = tmp_path / "spool"
    t = spawn(
        "teacher",
        "--bind",
        ep,
        "--n",
        str(n),
        "--out",
        str(tmp_path / "t.jsonl"),
        "--spool",
        str(spool),
        "--connect-timeout",
        "0",
    )
    # Wait until the teacher has spooled everything before any student exists.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(read_lines(tmp_path / "t.jsonl")[0]) < n:
        time.sleep(0.2)
    sent, _ = read_lines(tmp_path / "t.jsonl")
    assert len(sent) == n
    assert all(not r["where"].startswith("stream:") for r in sent), "expected every sample spooled"
    assert len(list(spool.glob("*.safetensors"))) == n
    s1 = spawn("student", "--connect", ep, "--out", str(tmp_path / "s1.jsonl"))
    s2 = spawn("student", "--connect", ep, "--out", str(tmp_path / "s2.jsonl"))
    assert wait_all([t, s1, s2]) == [0, 0, 0]
    _, tfinal = read_lines(tmp_path / "t.jsonl")
    r = read_lines(tmp_path / "s1.jsonl")[0] + read_lines(tmp_path / "s2.jsonl")[0]
    expected = {x["key"]: x["crc"] for x in sent}
    assert sorted(x["key"] for x in r) == sorted(expected)
    assert all(x["crc"] == expected[x["key"]] for x in r)
    st = tfinal["stats"]
    assert st["spooled"] == n and st["replayed"] == n and st["acked"] == n
    assert list(spool.glob("*.safetensors")) == []


@pytest.mark.slow
def test_killed_student_samples_reach_the_other(tmp_path):
    """A student killed with SIGKILL while holding unacked samples: they are redelivered to the other
    student; nothing is lost; the teacher does not wait for the dead student after END."""
    ep = f"tcp://127.0.0.1:{free_port()}"
    n = 200
    t = spawn(
        "teacher",
        "--bind",
        ep,
        "--n",
        str(n),
        "--out",
        str(tmp_path / "t.jsonl"),
        "--spool",
        str(tmp_path / "spool"),
        "--hb-timeout",
        "1.5",
    )
    # Victim: acks its first 5 samples, then holds everything it gets (credit 8) until killed.
    victim = spawn(
        "student", "--connect", ep, "--out", str(tmp_path / "v.jsonl"), "--no-ack-after", "5", "--credit", "8"
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(read_lines(tmp_path / "v.jsonl")[0]) < 12:
        time.sleep(0.05)
    survivor = spawn("student", "--connect", ep, "--out", str(tmp_path / "s.jsonl"), "--ack-delay", "0.01")
    # The survivor takes part (its first sample written) before the victim dies with its held samples.
    s_out = tmp_path / "s.jsonl"
    wait_until(lambda: s_out.exists() and "\n" in s_out.read_text(), 60, "the survivor's first sample")
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert wait_all([t, survivor]) == [0, 0]
    sent, tfinal = read_lines(tmp_path / "t.jsonl")
    v, _ = read_lines(tmp_path / "v.jsonl")
    s, _ = read_lines(tmp_path / "s.jsonl")
    assert len(v) >= 12
    acked_by_victim = {x["key"] for x in v[:5]}
    held_by_victim = {x["key"] for x in v[5:]}
    survivor_keys = [x["key"] for x in s]
    assert len(survivor_keys) == len(set(survivor_keys)), "survivor got a sample twice"
    assert held_by_victim <= set(survivor_keys), "unacked samples of the killed student were lost"
    assert acked_by_victim.isdisjoint(survivor_keys), "an acknowledged sample was delivered again"
    assert acked_by_victim | set(survivor_keys) == {x["key"] for x in sent}
    st = tfinal["stats"]
    assert st["acked"] == n and st["redelivered"] >= len(held_by_victim)
    # Its connection closed when it died: the teacher does not wait for it after END (it would
    # wait --end-grace, 30 s, for a student whose link went silent).
    assert tfinal["end_missing"] == [] and tfinal["end_wait_s"] < 10, tfinal


def test_end_reaches_a_student_whose_link_was_down_when_it_was_sent(procs, netns_hosts, tmp_path):
    """Teacher and student on two hosts (network namespaces, the student with a /dev/shm of its
    own: tcp only). Once every sample is acked the student's cable is pulled; the teacher's session
    for it times out (heartbeat_timeout_s=2) and END goes out with no student to take it. The cable
    comes back 4 s later (past the teacher's 3 s linger of before): the teacher is still serving,
    the student comes back (HELLO), gets END and confirms it (BYE). Both exit 0 by themselves, the
    student has every sample once, and the teacher's record says END reached everyone."""
    _end_after_the_cable_is_pulled(procs, netns_hosts, tmp_path, [])


def test_end_reaches_a_student_whose_link_went_down_before_the_previous_publisher_closed(
    procs, netns_hosts, tmp_path
):
    """As distill-teacher's engine phase hands over to its serve phase: once every sample is acked
    the student's cable is pulled and, at once, the teacher closes its Publisher and starts the
    next one on the same endpoint (another teacher id), which never saw the student. It expects the
    students of the first (`expect_students`), sends END with nobody there, and waits for them;
    the cable comes back 4 s later, the student comes (HELLO), gets END and confirms it (BYE).
    Without the expectation (`--no-expect`) the teacher left after its linger and the student
    waited out its teacher_wait_s, then exited 3."""
    _end_after_the_cable_is_pulled(procs, netns_hosts, tmp_path, ["--hand-over"])


def _end_after_the_cable_is_pulled(procs, netns_hosts, tmp_path, teacher_args: list[str]) -> None:
    """The cable is pulled once every sample is acked, END goes out, the cable comes back 4 s later:
    both ends exit 0 by themselves, every sample arrived once, END reached the student."""
    hosts = netns_hosts(["t", "s"])
    ep = f"tcp://{hosts.addr['t']}:{free_port()}"
    n, sig = 24, tmp_path / "end"
    env = {**ENV, "PYTHONUNBUFFERED": "1"}
    teacher = procs.start(
        "teacher",
        [sys.executable, PEERS, "teacher", "--bind", ep, "--n", str(n), "--out", str(tmp_path / "t.jsonl")]
        + ["--spool", str(tmp_path / "spool"), "--end-on", str(sig), "--end-grace", "30", "--timeout", "120"]
        + teacher_args,
        env=env,
        prefix=hosts.prefix("t"),
    )
    student = procs.start(
        "student",
        [sys.executable, PEERS, "student", "--connect", ep, "--out", str(tmp_path / "s.jsonl")]
        + ["--student-hb-timeout", "2", "--teacher-wait", "40"],
        env=env,
        prefix=hosts.prefix("s", private_shm=True),
    )
    idle = Path(str(sig) + ".idle")
    wait_until(idle.exists, 120, "every sample acked", check=_both_alive(teacher, student))
    hosts.link("s", up=False)
    sig.touch()
    ended = Path(str(sig) + ".ended")
    wait_until(ended.exists, 60, "END sent", check=_both_alive(teacher))
    time.sleep(4.0)  # the outage outlasts the teacher's linger (3 s in distill-teacher)
    assert teacher.alive(), f"the teacher left while END could not reach its student:\n{teacher.tail()}"
    hosts.link("s", up=True)
    s_rc, t_rc = student.wait(60), teacher.wait(60)
    assert (s_rc, t_rc) == (0, 0), f"student {s_rc}, teacher {t_rc}\n{student.tail()}\n{teacher.tail()}"
    sent, tfinal = read_lines(tmp_path / "t.jsonl")
    got, sfinal = read_lines(tmp_path / "s.jsonl")
    assert sfinal is not None, "the student did not end by END"
    counts = Counter(r["key"] for r in got)
    assert set(counts) == {r["key"] for r in sent} and len(sent) == n
    assert max(counts.values()) == 1, "a sample arrived twice"
    assert tfinal["done"] and tfinal["end_missing"] == [], tfinal
    assert faults.ended_by_itself(procs)


def _both_alive(*procs):
    def check():
        for p in procs:
            assert p.alive(), f"{p.name} ended early:\n{p.tail()}"

    return check

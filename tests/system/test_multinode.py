"""Multi-node student runs over tcp, with network namespaces as hosts.

Hosts are network namespaces on one bridge (tests/faults.Hosts): a teacher host (or two) and two
student hosts, each with a /dev/shm of its own (a private tmpfs: no shared memory crosses hosts, so
every frame travels over tcp). The students are one Accelerate job over two machines
(`--num_machines 2 --machine_rank R --main_process_ip <s0>`, one rank per host); GLOO_SOCKET_IFNAME
is not set: the student picks the interface of the route to the main process itself.

Rows (each asserts, from the final metrics.json `trained` list: trained == expected, lost == 0,
twice == 0, and that every process ended by itself with its documented exit code):
- one teacher host, two student hosts, one shared checkpoint folder (then, with rank 1's checkpoint
  files removed, a resume is refused on both nodes with one line, exit 2);
- two teachers, each holding half of the dataset, feeding the same students;
- one student host killed (its whole process tree SIGKILLed) with checkpoints on each node's own
  storage: the surviving node exits 4 by itself with one line, the documented restart command
  (`--set student.resume_from=latest` on both nodes) finishes the job; the same with s0 (the main
  process's host) killed, and with s1's cable pulled for good (collective_timeout_s=20: both nodes
  exit 4 after ~20 s instead of hanging).

Each row prints "NETNS <row>: expected=... trained=... twice=... lost=... (N s) ended_by_itself=True".
Skipped (with the reason) where network namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import faults
import pytest
from faults import Procs, wait_until

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
BIN = Path(PY).parent
LAYERS = faults.TINY_LAYERS
HB = 3.0

pytestmark = pytest.mark.slow

TEXTS = [
    "the quick brown fox jumps over the lazy dog and runs far away into the woods",
    "a student learns from a teacher one hidden state at a time",
    "networks of namespaces make hosts out of thin air on one machine",
    "every sample is trained exactly once even when a node is lost",
    "checkpoints live on each node when there is no shared filesystem",
    "gloo needs to know which interface to use for its pairs",
    "short text",
    "one more line of text so that the batches differ in length from one another",
]


def dataset(path: Path, keys: list[str]) -> Path:
    path.write_text(
        "".join(json.dumps({"id": k, "text": TEXTS[i % len(TEXTS)]}) + "\n" for i, k in enumerate(keys))
    )
    return path


def run_file(
    tmp: Path,
    teacher_model: Path,
    binds: list[str],
    student: dict | None = None,
    transport: dict | None = None,
) -> Path:
    transport = {
        "bind": binds[:1],
        "connect": binds,
        "credit_samples": 8,
        "connect_timeout_s": 120,
        "heartbeat_interval_s": 0.5,
        "heartbeat_timeout_s": HB,
        "teacher_wait_s": 300,
        "shm_dir": "/dev/shm",
        "shm_bytes": 16 << 20,
        **(transport or {}),
    }
    return faults.write_run_file(
        tmp / "run.yaml",
        transport=transport,
        spool={"dir": str(tmp / "spool")},
        student=faults.tiny_student(teacher_model, tmp / "out", **{"checkpoint_every": 4, **(student or {})}),
    )


def env() -> dict:
    e = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    e.pop("GLOO_SOCKET_IFNAME", None)  # the student must find the interface itself
    return e


def start_teacher(procs: Procs, name: str, hosts, host: str, model: Path, data: Path, run: Path, *extra):
    cmd = [PY, "-m", "testkit.synthetic_teacher", "--model", str(model), "--data", str(data)]
    cmd += ["--layers", ",".join(map(str, LAYERS)), "--config", str(run), "--timeout", "500", *extra]
    return procs.start(name, cmd, env=env(), prefix=hosts.prefix(host, private_shm=True))


def start_node(procs: Procs, hosts, host: str, machine_rank: int, run: Path, port: int, *sets: str):
    """One machine of a two-machine Accelerate job (one rank per machine; main process on s0)."""
    cmd = [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2"]
    cmd += ["--num_machines", "2", "--machine_rank", str(machine_rank)]
    cmd += ["--main_process_ip", hosts.addr["s0"], "--main_process_port", str(port)]
    cmd += ["student.py", "--config", str(run)]
    for s in sets:
        cmd += ["--set", s]
    return procs.start(f"students-{host}", cmd, env=env(), prefix=hosts.prefix(host, private_shm=True))


def report(row: str, metrics: Path, expected: set[str], t0: float, procs: Procs, **extra) -> dict:
    t = {"expected": len(expected), **faults.tally(metrics, expected)}
    left = procs.leftovers()
    t.update(seconds=round(time.monotonic() - t0, 1), ended_by_itself=not left, **extra)
    print(f"NETNS {row}: {json.dumps(t)}")
    out = os.environ.get("MULTINODE_REPORT")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps({"row": row, **t}) + "\n")
    assert t["twice"] == 0 and t["lost"] == 0 and t["trained"] == len(expected) and not t["unexpected"], t
    assert not left, f"{row}: processes still running: {[p.pid for p in left]}"
    return t


def committed(journal: Path) -> set[str]:
    return faults.journal_state(journal)[0]


def finish(jobs, teachers, timeout: float = 400) -> dict:
    codes = {}
    for j in jobs:
        j.wait(timeout)
        codes[j.name] = j.student_exit()
    assert all(c == 0 for c in codes.values()), f"{codes}\n" + "\n".join(p.tail(3000) for p in jobs)
    for t in teachers:
        codes[t.name] = t.wait(120)
    assert all(c == 0 for c in codes.values()), f"{codes}\n" + "\n".join(
        p.tail(3000) for p in (*jobs, *teachers)
    )
    return codes


def make_hosts(procs, names):
    why = faults.netns_available()
    if why:
        pytest.skip(f"multi-node tests need network namespaces: {why}")
    return faults.Hosts(names)


@pytest.fixture
def hosts3(procs):
    h = make_hosts(procs, ["t", "s0", "s1"])
    try:
        yield h
    finally:
        procs.kill_all()  # nothing may stay inside a namespace that is deleted
        h.close()


@pytest.fixture
def hosts4(procs):
    h = make_hosts(procs, ["t0", "t1", "s0", "s1"])
    try:
        yield h
    finally:
        procs.kill_all()
        h.close()


def test_two_student_hosts_one_teacher_every_key_once(procs, hosts3, tmp_path, tiny_teacher):
    """One teacher host, one Accelerate job over two student hosts (tcp only, private /dev/shm),
    one checkpoint folder both nodes see (the probe finds it shared); gloo's interface is picked by
    the student (GLOO_SOCKET_IFNAME unset). Each rank opens two connections to the teacher
    (`transport.connections: 2`): the teacher had four sessions open at once, two per rank."""
    keys = [f"a{i:04d}" for i in range(96)]
    data = dataset(tmp_path / "data.jsonl", keys)
    port = faults.free_port()
    run = run_file(
        tmp_path,
        tiny_teacher,
        [f"tcp://{hosts3.addr['t']}:{port}"],
        transport={"connections": 2, "io_threads": 2},
    )
    t0 = time.monotonic()
    teacher = start_teacher(
        procs, "teacher", hosts3, "t", tiny_teacher, data, run, "--journal", str(tmp_path / "j.txt")
    )
    mport = faults.free_port()
    jobs = [start_node(procs, hosts3, h, r, run, mport) for r, h in enumerate(["s0", "s1"])]
    codes = finish(jobs, [teacher])
    for j in jobs:
        assert "gloo process group on interface eth0" in j.text(), j.tail()
    assert "not shared between nodes" not in jobs[0].text()
    report(
        "one teacher, two student hosts", tmp_path / "out" / "metrics.json", set(keys), t0, procs, exit=codes
    )
    stats = json.loads((tmp_path / "j.txt.summary.json").read_text())["stats"]
    assert stats["sessions_peak"] == 4, stats  # both ranks' two connections, open together
    # A partial checkpoint (rank 1's files missing, as on a second node of the old layout): a resume
    # is refused on every rank with one line, before any training or teacher contact.
    ckpts = sorted((tmp_path / "out" / "checkpoints").glob("step_*"))
    assert ckpts, "no checkpoint was kept"
    for c in ckpts:
        (c / "random_states_1.pkl").unlink()
    jobs = [
        start_node(procs, hosts3, h, r, run, mport, "student.resume_from=latest")
        for r, h in enumerate(["s0", "s1"])
    ]
    for j in jobs:
        j.wait(300)
        assert j.student_exit() == 2, j.tail()
        lines = [ln for ln in j.text().splitlines() if ln.startswith("student error:")]
        assert len(lines) == 1 and "cannot resume: no checkpoint is complete on every rank" in lines[0], (
            j.tail()
        )
        assert "rank 1 on" in lines[0] and ": none" in lines[0], lines[0]
    print("refused:", lines[0])
    assert not procs.leftovers()


def test_two_teachers_each_half_two_student_hosts(procs, hosts4, tmp_path, tiny_teacher):
    """Two teacher hosts, each holding half of the dataset (own journal), feeding the same two
    student hosts: every key of both halves trained exactly once."""
    keys = [f"b{i:04d}" for i in range(96)]
    halves = [keys[::2], keys[1::2]]
    port = faults.free_port()
    binds = [f"tcp://{hosts4.addr[t]}:{port}" for t in ("t0", "t1")]
    # Two teachers with journals of their own: one run id for all (else each keeps its own).
    run = run_file(tmp_path, tiny_teacher, binds, transport={"run_id": "two-teachers"})
    t0 = time.monotonic()
    teachers = []
    for i, t in enumerate(("t0", "t1")):
        data = dataset(tmp_path / f"half{i}.jsonl", halves[i])
        teachers.append(
            start_teacher(
                procs,
                f"teacher-{t}",
                hosts4,
                t,
                tiny_teacher,
                data,
                run,
                "--journal",
                str(tmp_path / f"j{i}.txt"),
                "--set",
                f"transport.bind=[{binds[i]}]",
            )
        )
    mport = faults.free_port()
    jobs = [start_node(procs, hosts4, h, r, run, mport) for r, h in enumerate(["s0", "s1"])]
    codes = finish(jobs, teachers)
    report(
        "two teachers (half each), two student hosts",
        tmp_path / "out" / "metrics.json",
        set(keys),
        t0,
        procs,
        exit=codes,
    )


def _lost_node_row(procs, hosts, tmp_path, tiny_teacher, *, lost: str, how: str, timeout_s: float = 600):
    """Checkpoints on each node's own storage (different checkpoint folders: no shared filesystem).
    After a few checkpoints host `lost` is lost: `how` = "kill" (its whole student process tree
    SIGKILLed: the kernel closes its connections) or "vanish" (its cable pulled for good: nothing is
    closed, the survivor notices after student.collective_timeout_s = `timeout_s`). Every student
    job still running must exit by itself with code 4 and one line naming the lost rank and host and
    the restart command; that command on both hosts (resume_from=latest, each node from its own
    checkpoints; the cable back in) finishes the job with every key trained exactly once (the
    teacher regenerates keys acked but not committed)."""
    keys = [f"c{i:04d}" for i in range(120)]
    data = dataset(tmp_path / "data.jsonl", keys)
    port = faults.free_port()
    run = run_file(
        tmp_path,
        tiny_teacher,
        [f"tcp://{hosts.addr['t']}:{port}"],
        student={"collective_timeout_s": timeout_s},
    )
    journal = tmp_path / "j.txt"
    t0 = time.monotonic()
    teacher = start_teacher(
        procs, "teacher", hosts, "t", tiny_teacher, data, run, "--journal", str(journal), "--rate", "6"
    )
    mport = faults.free_port()
    nodes = ["s0", "s1"]
    node_sets = {h: f"student.output_dir={tmp_path / ('out-' + h)}" for h in nodes}
    jobs = [start_node(procs, hosts, h, r, run, mport, node_sets[h]) for r, h in enumerate(nodes)]
    wait_until(
        lambda: len(committed(journal)) >= 24,
        300,
        "24 keys committed",
        check=faults.alive_or_fail(teacher, *jobs),
    )
    assert "not shared between nodes" in jobs[0].text(), jobs[0].tail()
    gone = nodes.index(lost)
    if how == "kill":
        procs.kill(jobs[gone])  # the host's launcher, agent and rank: SIGKILL
        survivors = [j for i, j in enumerate(jobs) if i != gone]
    else:
        hosts.link(lost, up=False)
        survivors = list(jobs)  # the lost host's own rank times out too (it sees the other one gone)
    t_lost = time.monotonic()
    exits = {}
    for j in survivors:
        j.wait(timeout_s + 120)  # by itself
        exits[j.name] = (j.student_exit(), round(time.monotonic() - t_lost, 1))
        assert exits[j.name][0] == 4, j.tail()
        lines = [ln for ln in j.text().splitlines() if "student stopped:" in ln]
        assert len(lines) == 1, j.tail()
        assert "--set student.resume_from=latest" in lines[0], lines[0]
        print(f"{j.name}:", lines[0])
        # accelerate launch exits 1: the node's own code and reason are in its metrics.json
        m = json.loads((tmp_path / f"out-{j.name.removeprefix('students-')}" / "metrics.json").read_text())
        assert (m["exit_code"], m["exit_reason"]) == (4, "peer_lost"), m
        assert lines[0].endswith(m["exit_message"]), (lines[0], m["exit_message"])
    other = jobs[1 - gone]
    line = next(ln for ln in other.text().splitlines() if "student stopped:" in ln)
    assert f"lost rank {gone} on host" in line and hosts.addr[lost] in line, line
    if how == "vanish":
        hosts.link(lost, up=True)
    # The documented restart: the same launch command on both nodes, resume_from=latest.
    jobs2 = [
        start_node(procs, hosts, h, r, run, mport, node_sets[h], "student.resume_from=latest")
        for r, h in enumerate(nodes)
    ]
    codes = finish(jobs2, [teacher])
    for j, h in zip(jobs2, nodes, strict=True):  # each node from its own checkpoint folder
        assert f"resumed from {tmp_path / ('out-' + h)}/checkpoints/step_" in j.text(), j.tail()
    return report(
        f"student host {lost} {'killed' if how == 'kill' else 'vanished'}, restart",
        tmp_path / "out-s0" / "metrics.json",
        set(keys),
        t0,
        procs,
        exit={**codes, "first run (code, s after the loss)": exits},
    )


@pytest.mark.parametrize("lost", ["s1", "s0"])
def test_student_host_killed_survivor_exits_4_restart_finishes(procs, hosts3, tmp_path, tiny_teacher, lost):
    """A student host's process tree SIGKILLed (s1; or s0, the main process's host): the other node
    exits 4 by itself at once; the restart finishes, every key once."""
    _lost_node_row(procs, hosts3, tmp_path, tiny_teacher, lost=lost, how="kill")


def test_student_host_vanished_both_exit_4_after_collective_timeout(procs, hosts3, tmp_path, tiny_teacher):
    """Host s1's cable pulled for good (no connection is closed): both nodes exit 4 after
    student.collective_timeout_s (20 s here) instead of hanging; with the cable back the restart
    finishes, every key once."""
    _lost_node_row(procs, hosts3, tmp_path, tiny_teacher, lost="s1", how="vanish", timeout_s=20)

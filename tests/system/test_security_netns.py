"""The traffic cannot be read on the wire, shown with a capture on a namespace link.

Two hosts as network namespaces on one bridge (tests/faults.Hosts): a teacher (a real distill
`Publisher` in a small Python process: this file run as a script, role `teacher`) on host t and a
student (a `Subscriber` process, role `student`) on host s, each with a /dev/shm of its own (a private
tmpfs: the student cannot map the teacher's ring, so the sample's bytes travel over tcp; the student
reports shm_samples == 0). A raw AF_PACKET socket on s's eth0, inside s's namespace
(tests/faults.Capture; no tcpdump needed), records every frame in and out. The teacher sends two
samples whose tensor bytes are a random marker repeated and whose keys hold a second random marker:
a small one, and one of 2 MiB that CURVE sends in 1 MiB frames (`transport.chunk_bytes` unset; the
teacher counts it in `chunked`, plain tcp sends it whole).

- CURVE off (the control, so the check can fail): both markers are in the captured bytes.
- CURVE on: neither marker is in any captured frame nor in the reassembled tcp streams, and the
  student still receives both samples intact. Before it, two unauthorised students on host s (one
  with a key pair that is not in the teacher's authorized_keys, one without CURVE) get nothing in
  8 s, and the teacher counts no student and sends nothing.
- CURVE on with two connections from the student (`transport.connections: 2`, one sample of credit
  each, the first sample acked only once the second came): the samples travel one on each
  connection, and neither connection is readable.

Every process ends by itself (teacher 0 after END, student 0, unauthorised students 3: no teacher
heard). Each case prints one line "CAPTURE curve=...: frames=... bytes=... marker_found=..."
Skipped, with the reason, where network namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # run as a script (the test's peers): tests/ onto sys.path, as conftest.py does
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import faults  # tests/faults.py
import pytest
from faults import Capture, wait_until

pytestmark = pytest.mark.slow

PY = sys.executable
SCRIPT = str(Path(__file__).resolve())
REPEAT = 64  # the tensor is the marker repeated: 64 x 36 bytes, a few tcp segments
REPEAT_BIG = (2 << 20) // 36 + 3  # the second sample's: 2 MiB and 36 bytes (3 frames with CURVE)
BIG = "-big"  # the second sample's key: the first's and this


def _curve(a):
    from distill.config import CurveConfig

    if not a.secret_key:
        return None
    return CurveConfig(secret_key=a.secret_key, server_key=a.server_key, authorized_keys=a.authorized_keys)


def _teacher(a) -> int:
    """Publish one marked sample, wait until the student acked and committed it (END sent)."""
    import torch

    from distill.config import SpoolConfig, TransportConfig
    from distill.protocol import Sample
    from distill.transport import Publisher

    cfg = TransportConfig(
        bind=[a.endpoint],
        shm_bytes=64 << 20,
        connect_timeout_s=300,  # keep the sample in memory while only strangers knock
        heartbeat_interval_s=0.5,
        heartbeat_timeout_s=3,
        curve=_curve(a),
        io_threads=2,
    )

    def payload(repeat: int) -> torch.Tensor:
        return torch.frombuffer(bytearray(a.mark.encode() * repeat), dtype=torch.uint8).clone()

    keep = ("students", "sent", "acked", "committed", "rejected", "refused", "bytes_sent", "chunked")
    last = None
    with Publisher(cfg, SpoolConfig(dir=a.spool), journal=a.journal) as pub:
        print(f"teacher: listening on {a.endpoint}, curve={'on' if cfg.curve else 'off'}", flush=True)
        pub.submit(Sample(key=a.key, tensors={"x": payload(REPEAT)}))
        pub.submit(Sample(key=a.key + BIG, tensors={"x": payload(REPEAT_BIG)}))
        pub.close_input()
        deadline = time.monotonic() + a.timeout
        while True:
            done = pub.wait_done(0.5)
            st = pub.stats()
            now = {k: st.get(k, 0) for k in keep}
            if now != last:
                print("STATS " + json.dumps(now), flush=True)
                last = now
            if done:
                return 0
            if time.monotonic() > deadline:
                print(f"teacher: no END within {a.timeout}s", flush=True)
                return 1


def _student(a) -> int:
    """Receive until END (exit 0) or `timeout` seconds without one (exit 3); one RESULT line."""
    from distill.config import TransportConfig
    from distill.transport import Subscriber, TransportError

    cfg = TransportConfig(
        connect=[a.endpoint],
        heartbeat_interval_s=0.5,
        heartbeat_timeout_s=3,
        teacher_wait_s=max(1.0, a.timeout),
        curve=_curve(a),
        connections=a.connections,
        credit_samples=a.connections if a.connections > 1 else 64,
    )
    want = {False: a.mark.encode() * REPEAT, True: a.mark.encode() * REPEAT_BIG}
    got, err, finished, stats, vias, held = [], None, False, {}, set(), []
    try:
        with Subscriber(cfg) as sub:
            deadline = time.monotonic() + a.timeout
            while True:
                left = deadline - time.monotonic()
                s = sub.get(timeout=max(0.1, left)) if left > 0 else None
                if s is None:
                    break
                data = bytes(s.tensors["x"].numpy())
                ok = data == want[s.key.endswith(BIG)] and sub.valid(s)
                got.append({"key": s.key, "intact": ok, "nbytes": len(data)})
                vias.add(s.via)
                held.append(s)
                if a.connections == 1 or len(got) >= 2:  # several: hold the first until the second came
                    sub.ack(held)
                    held = []
            finished = sub.finished
            stats = {k: v for k, v in sub.stats().items() if isinstance(v, int)}
    except TransportError as e:  # TeacherGone too
        err = f"{type(e).__name__}: {e}"
    res = {"received": got, "finished": finished, "error": err, "stats": stats, "vias": len(vias)}
    print("RESULT " + json.dumps(res))
    return 0 if finished else 3


def _main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["teacher", "student"])
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--mark", required=True)
    ap.add_argument("--key", default="")
    ap.add_argument("--spool", default="")
    ap.add_argument("--journal", default=None)
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--secret-key", default=None)
    ap.add_argument("--server-key", default=None)
    ap.add_argument("--authorized-keys", default=None)
    ap.add_argument("--connections", type=int, default=1)
    a = ap.parse_args(argv)
    return _teacher(a) if a.role == "teacher" else _student(a)


if __name__ == "__main__":
    sys.exit(_main())


# ---------------------------------------------------------------------------------------------
# The test
# ---------------------------------------------------------------------------------------------


def _last(prefix: str, text: str) -> dict | None:
    lines = [ln for ln in text.splitlines() if ln.startswith(prefix + " ")]
    return json.loads(lines[-1][len(prefix) + 1 :]) if lines else None


def _role(procs, hosts, host: str, name: str, role: str, endpoint: str, mark: str, *extra: str):
    cmd = [PY, SCRIPT, role, "--endpoint", endpoint, "--mark", mark, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return procs.start(name, cmd, env=env, prefix=hosts.prefix(host, private_shm=True))


@pytest.mark.parametrize("curve", ["off", "on", "on-2-connections"])
def test_capture_on_the_namespace_link(procs, netns_hosts, tmp_path, curve):
    from distill.keygen import make_keys

    hosts = netns_hosts(["t", "s"])
    t0 = time.monotonic()
    mark = f"distill-wire-marker-{secrets.token_hex(8)}"  # 36 bytes, new in every run
    key = f"sample-key-marker-{secrets.token_hex(8)}"
    port = faults.free_port()
    endpoint = f"tcp://{hosts.addr['t']}:{port}"
    keys = tmp_path / "keys"
    t_extra, s_extra = [], []
    conns = 2 if curve == "on-2-connections" else 1
    if curve != "off":
        make_keys(keys, "teacher")
        make_keys(keys / "students", "good")
        make_keys(tmp_path / "other", "stranger")  # a valid key pair the teacher does not list
        t_extra = ["--secret-key", str(keys / "teacher.key_secret")]
        t_extra += ["--authorized-keys", str(keys / "students")]
        s_extra = ["--secret-key", str(keys / "students" / "good.key_secret")]
        s_extra += ["--server-key", str(keys / "teacher.key"), "--connections", str(conns)]

    cap = Capture(procs, hosts, "s", tmp_path / "s.cap")
    teacher = _role(
        procs,
        hosts,
        "t",
        "teacher",
        "teacher",
        endpoint,
        mark,
        "--key",
        key,
        "--spool",
        str(tmp_path / "spool"),
        "--journal",
        str(tmp_path / "journal.txt"),
        *t_extra,
    )

    def teacher_up():
        if not teacher.alive():
            raise AssertionError(f"teacher ended early (exit {teacher.poll()}):\n{teacher.tail()}")

    wait_until(lambda: "STATS " in teacher.text(), 120, "the teacher listening", check=teacher_up)

    strangers = {}
    if curve == "on":
        # Unauthorised students knock first, while the sample waits for a student: they get nothing.
        stranger_keys = ["--secret-key", str(tmp_path / "other" / "stranger.key_secret")]
        stranger_keys += ["--server-key", str(keys / "teacher.key")]
        for who, extra in (("stranger", stranger_keys), ("plain", [])):
            strangers[who] = _role(
                procs, hosts, "s", f"student-{who}", "student", endpoint, mark, "--timeout", "8", *extra
            )
        for who, p in strangers.items():
            rc = p.wait(120)
            res = _last("RESULT", p.text())
            assert res is not None, f"{who}: no RESULT line:\n{p.tail()}"
            assert res["received"] == [] and rc == 3, f"unauthorised {who} student: exit {rc}, {res}"
        st = _last("STATS", teacher.text())
        assert st["students"] == 0 and st["sent"] == 0, f"the teacher served a stranger: {st}"

    student = _role(procs, hosts, "s", "student", "student", endpoint, mark, "--timeout", "120", *s_extra)
    s_rc = student.wait(180)
    t_rc = teacher.wait(60)
    cap.stop()
    res = _last("RESULT", student.text())
    st = _last("STATS", teacher.text())
    codes = {"teacher": t_rc, "student": s_rc, **{w: p.poll() for w, p in strangers.items()}}
    assert s_rc == 0 and t_rc == 0, f"{codes}\n{student.tail()}\n{teacher.tail()}"
    assert sorted(res["received"], key=lambda r: r["key"]) == [
        {"key": key, "intact": True, "nbytes": len(mark) * REPEAT},
        {"key": key + BIG, "intact": True, "nbytes": len(mark) * REPEAT_BIG},
    ], res
    assert res["stats"].get("shm_samples", 0) == 0, f"the samples did not travel over tcp: {res['stats']}"
    assert res["vias"] == conns, f"the samples came on {res['vias']} of {conns} connections"
    assert st["sent"] == 2 and st["acked"] == 2, st
    assert st["chunked"] == (0 if curve == "off" else 1), st  # CURVE: the 2 MiB tensor in 1 MiB frames
    ended = faults.ended_by_itself(procs)

    teacher_flow = cap.tcp_payload_bytes(port)
    found = {"marker": cap.contains(mark.encode()), "key": cap.contains(key.encode())}
    line = (
        f"CAPTURE curve={curve}: frames={cap.frames} bytes={cap.bytes} "
        f"tcp_payload_to_from_teacher={teacher_flow} marker_found={found['marker']} "
        f"key_found={found['key']} received_intact=True exit={codes} ended_by_itself={ended} "
        f"({time.monotonic() - t0:.1f} s)"
    )
    print(line)
    # The samples crossed the captured link (their tensors alone are over 2 MiB).
    assert teacher_flow > len(mark) * (REPEAT + REPEAT_BIG), line
    if curve == "off":
        assert found == {"marker": True, "key": True}, f"the control cannot see plain bytes: {line}"
    else:
        assert found == {"marker": False, "key": False}, f"readable on the wire with CURVE: {line}"

"""The student's handshake when HELLOs cross: a real Subscriber against a fake teacher (a raw ROUTER
socket that plays the teacher's part message by message, so the crossing is certain)."""

from __future__ import annotations

import time

import zmq

from distill import protocol as P
from distill.config import TransportConfig
from distill.transport import Subscriber


def _recv_kind(router, kind: int, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if router.poll(200):
            ident, msg = router.recv_multipart()
            if P.decode_header(msg)["k"] == kind:
                return ident
    raise AssertionError(f"no {P.KIND_NAMES[kind]} from the student within {timeout} s")


def _wait_stat(sub, name: str, value: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while sub.stats().get(name, 0) != value:
        assert time.monotonic() < deadline, f"{name}={sub.stats().get(name, 0)}, want {value}: {sub.stats()}"
        time.sleep(0.05)


def test_two_crossed_hellos_answered_twice_are_not_foreign(tmp_path):
    """HELLO, then a RESET makes the student send a second HELLO before the first WELCOME came: the
    teacher answers both. The second answer belongs to the same session and is not a rejected
    'foreign' message (it was logged as one, 3-4 times per generate -> serve switch). A WELCOME
    nobody asked for still is."""
    ep = f"ipc://{tmp_path}/fake-teacher.sock"
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.bind(ep)
    sub = Subscriber(TransportConfig(connect=[ep], heartbeat_interval_s=0.1, shm="off")).start()
    try:
        ident = _recv_kind(router, P.HELLO)
        router.send_multipart([ident, P.encode_control(P.RESET, tid="fake")])
        ident = _recv_kind(router, P.HELLO)  # the second HELLO, the first still unanswered
        for _ in range(2):
            router.send_multipart([ident, P.encode_control(P.WELCOME, tid="fake", shm=None)])
        _recv_kind(router, P.CREDIT)
        _wait_stat(sub, "extra_welcomes", 1)
        assert sub.stats()["rejected"] == 0, sub.stats()
        # Nothing asked for this one.
        router.send_multipart([ident, P.encode_control(P.WELCOME, tid="fake", shm=None)])
        _wait_stat(sub, "rejected", 1)
        assert sub.stats()["rejected_by_reason"] == {"foreign": 1}
        # The session works: END ends it.
        router.send_multipart([ident, P.encode_control(P.END, tid="fake")])
        assert sub.get(timeout=10) is None and sub.finished
    finally:
        sub.close()
        router.close(0)


def test_student_finds_a_new_teacher_socket_within_a_second_or_two(tmp_path, free_port):
    """distill-teacher closes the engine's Publisher after generation and binds a serving one on the
    same endpoint; when everything is already committed, the serving Publisher sends END to whoever
    arrives within a few seconds, then leaves. A student's reconnect backoff (doubling, capped at
    heartbeat_timeout_s = 10 s) made it arrive up to 10 s after the bind, after the teacher had
    left: it then waited transport.teacher_wait_s (seen in an end-to-end run). With reconnects at
    least every second, a student is back within ~2 s of the new bind."""
    from distill.config import SpoolConfig
    from distill.transport import Publisher

    ep = f"tcp://127.0.0.1:{free_port()}"
    pcfg = TransportConfig(bind=[ep], shm="off", heartbeat_interval_s=0.5)
    sub = Subscriber(TransportConfig(connect=[ep], shm="off", heartbeat_interval_s=0.5)).start()
    try:
        with Publisher(pcfg, SpoolConfig(dir=str(tmp_path / "spool1"))) as pub:
            deadline = time.monotonic() + 10
            while pub.stats()["students"] < 1:
                assert time.monotonic() < deadline, "the student never reached the first teacher"
                time.sleep(0.05)
        time.sleep(7.0)  # the engine shuts down: the student's reconnect attempts are refused
        with Publisher(pcfg, SpoolConfig(dir=str(tmp_path / "spool2"))) as pub2:
            t_bind = time.monotonic()
            while pub2.stats()["students"] < 1:
                assert time.monotonic() - t_bind < 3.0, "the student took over 3 s to reach the new socket"
                time.sleep(0.05)
    finally:
        sub.close()

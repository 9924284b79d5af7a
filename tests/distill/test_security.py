"""Run identity and CURVE, over real tcp sockets: a student of another run is refused on both sides;
with CURVE only authorised students get samples, and the bytes on the wire (recorded by a tcp
relay between student and teacher) do not contain the sample's bytes."""

from __future__ import annotations

import socket
import threading

import pytest
import torch
from faults import free_port
from waiting import wait_until

from distill.config import CurveConfig, SpoolConfig, TransportConfig
from distill.keygen import make_keys
from distill.protocol import Sample
from distill.transport import Publisher, Subscriber, TransportError

MARK = b"distill-secret-marker-0123456789"  # 32 bytes the sample carries in its tensor


def _marked_sample(key: str, repeat: int = 64) -> Sample:
    payload = torch.frombuffer(bytearray(MARK * repeat), dtype=torch.uint8).clone()
    return Sample(key=key, tensors={"x": payload})


class Relay:
    """A tcp relay that records every byte it forwards (a capture of the student-teacher link)."""

    def __init__(self, target_port: int):
        self.target = target_port
        self.srv = socket.socket()
        self.srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(8)
        self.port = self.srv.getsockname()[1]
        self.captured = bytearray()
        self._lock = threading.Lock()
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self._stop:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            u = socket.create_connection(("127.0.0.1", self.target))
            for a, b in ((c, u), (u, c)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, a, b):
        try:
            while True:
                data = a.recv(1 << 16)
                if not data:
                    break
                with self._lock:
                    self.captured += data
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self._stop = True
        self.srv.close()


def _keys(tmp_path):
    d = tmp_path / "keys"
    make_keys(d, "teacher")
    make_keys(d / "students", "good")
    make_keys(tmp_path / "other", "stranger")
    return d


def _transfer_through_relay(
    tmp_path, curve_t, curve_s, io_threads: int = 1, repeat: int = 64, **t_kw
) -> tuple[bytes, str, dict]:
    """One marked sample (`repeat` x MARK) teacher -> relay -> student: (captured bytes, key the
    student got, the teacher's stats)."""
    port = free_port()
    relay = Relay(port)
    t_cfg = TransportConfig(
        bind=[f"tcp://127.0.0.1:{port}"], shm="off", curve=curve_t, io_threads=io_threads, **t_kw
    )
    s_cfg = TransportConfig(connect=[f"tcp://127.0.0.1:{relay.port}"], shm="off", curve=curve_s)
    try:
        with Publisher(t_cfg, SpoolConfig(dir=str(tmp_path / "spool"))) as pub, Subscriber(s_cfg) as sub:
            pub.submit(_marked_sample("k-secret", repeat))
            s = sub.get(timeout=15)
            assert s is not None, pub.stats()
            assert bytes(s.tensors["x"].numpy()) == MARK * repeat
            sub.ack(s)
            assert wait_until(lambda: pub.stats()["acked"] == 1)
            stats = pub.stats()
    finally:
        relay.close()
    return bytes(relay.captured), s.key, stats


def test_plain_tcp_carries_readable_bytes(tmp_path):
    """The control: without CURVE the relay sees the sample's bytes (so the check below can fail)."""
    captured, _, stats = _transfer_through_relay(tmp_path, None, None)
    assert MARK in captured and b"k-secret" in captured
    assert stats["chunked"] == 0


@pytest.mark.parametrize("io_threads", [1, 3])
def test_curve_encrypts_the_wire(tmp_path, io_threads):
    """Also with the teacher's socket on a context of several I/O threads (transport.io_threads)."""
    d = _keys(tmp_path)
    curve_t = CurveConfig(secret_key=str(d / "teacher.key_secret"), authorized_keys=str(d / "students"))
    curve_s = CurveConfig(
        secret_key=str(d / "students" / "good.key_secret"), server_key=str(d / "teacher.key")
    )
    captured, key, _ = _transfer_through_relay(tmp_path, curve_t, curve_s, io_threads)
    assert key == "k-secret"
    assert len(captured) > 64 * len(MARK)  # the sample did cross the relay
    assert MARK not in captured and b"k-secret" not in captured


@pytest.mark.parametrize("curve", [True, False])
def test_a_tensor_larger_than_the_chunk_arrives_exact_from_its_frames(tmp_path, curve):
    """CURVE cuts tensors into 1 MiB frames by default (transport.chunk_bytes unset); plain tcp
    only when chunk_bytes is set. Either way the student gets every byte, joined in order."""
    repeat = (3 << 20) // len(MARK) + 5  # 3 MiB and 160 bytes: four frames of 1 MiB or less
    if curve:
        d = _keys(tmp_path)
        curve_t = CurveConfig(secret_key=str(d / "teacher.key_secret"), authorized_keys=str(d / "students"))
        curve_s = CurveConfig(
            secret_key=str(d / "students" / "good.key_secret"), server_key=str(d / "teacher.key")
        )
        captured, _, stats = _transfer_through_relay(tmp_path, curve_t, curve_s, repeat=repeat)
        assert MARK not in captured
    else:
        captured, _, stats = _transfer_through_relay(tmp_path, None, None, repeat=repeat)
        assert stats["chunked"] == 0  # plain tcp, chunk_bytes unset: whole tensors
        captured, _, stats = _transfer_through_relay(tmp_path, None, None, repeat=repeat, chunk_bytes=1 << 20)
        assert MARK in captured
    assert stats["chunked"] == 1 and stats["acked"] == 1
    assert len(captured) > repeat * len(MARK)


@pytest.mark.parametrize("who", ["stranger", "plain"])
def test_curve_student_without_an_authorised_key_gets_nothing(tmp_path, who):
    d = _keys(tmp_path)
    port = free_port()
    ep = f"tcp://127.0.0.1:{port}"
    curve_t = CurveConfig(secret_key=str(d / "teacher.key_secret"), authorized_keys=str(d / "students"))
    stranger = (
        CurveConfig(
            secret_key=str(tmp_path / "other" / "stranger.key_secret"), server_key=str(d / "teacher.key")
        )
        if who == "stranger"
        else None
    )
    good = CurveConfig(secret_key=str(d / "students" / "good.key_secret"), server_key=str(d / "teacher.key"))
    t_cfg = TransportConfig(bind=[ep], shm="off", curve=curve_t)
    with Publisher(t_cfg, SpoolConfig(dir=str(tmp_path / "spool"))) as pub:
        bad = Subscriber(TransportConfig(connect=[ep], shm="off", curve=stranger, teacher_wait_s=60)).start()
        pub.submit(_marked_sample("k0"))
        assert bad.get(timeout=3.0) is None
        assert pub.stats()["students"] == 0 and pub.stats()["sent"] == 0
        bad.close()
        with Subscriber(TransportConfig(connect=[ep], shm="off", curve=good)) as sub:
            s = sub.get(timeout=15)
            assert s is not None and s.key == "k0"
            sub.ack(s)


def test_student_of_another_run_is_refused_on_both_sides(tmp_path):
    ep = f"ipc://{tmp_path}/t.sock"
    cfg = TransportConfig(bind=[ep], connect=[ep], shm="off")
    journal = tmp_path / "run1" / "journal.txt"
    with Publisher(cfg, SpoolConfig(dir=str(tmp_path / "spool")), journal=str(journal)) as pub:
        run1 = pub.run_id
        assert run1 and (tmp_path / "run1" / "journal.txt.run").read_text().strip() == run1
        old = Subscriber(cfg).start()  # learns run1
        pub.submit(_marked_sample("a"))
        old.ack(old.get(timeout=10))
        assert old.run_id == run1
    # The next run: a new journal, a new run id. The leftover student must not take its samples.
    journal2 = tmp_path / "run2" / "journal.txt"
    with Publisher(cfg, SpoolConfig(dir=str(tmp_path / "spool2")), journal=str(journal2)) as pub2:
        assert pub2.run_id != run1
        pub2.submit(_marked_sample("b"))
        with pytest.raises(TransportError) as ei:
            while True:
                assert old.get(timeout=15) is None or False
        msg = str(ei.value)
        assert run1 in msg and pub2.run_id in msg and "\n" not in msg
        assert pub2.stats()["refused"] >= 1 and pub2.stats()["sent"] == 0
        old.close()
        # A student of this run gets the sample.
        with Subscriber(cfg.model_copy(update={"run_id": pub2.run_id})) as sub:
            s = sub.get(timeout=10)
            assert s is not None and s.key == "b"
            sub.ack(s)
    # The same journal keeps its run id across teacher restarts.
    with Publisher(cfg, SpoolConfig(dir=str(tmp_path / "spool2")), journal=str(journal2)) as pub3:
        assert pub3.run_id == pub2.run_id


def test_io_threads_gives_the_teachers_socket_a_context_of_that_many_threads():
    import zmq

    from distill.config import validate
    from distill.errors import ConfigError
    from distill.sockets import io_context

    assert TransportConfig().io_threads == 1 and io_context(1) is zmq.Context.instance()
    ctx = io_context(3)
    assert ctx is io_context(3) and ctx.get(zmq.IO_THREADS) == 3
    with pytest.raises(ConfigError, match="io_threads"):
        validate(TransportConfig, {"io_threads": 0})


@pytest.mark.parametrize("cores, lanes", [(2, 1), (8, 2), (16, 4), (128, 4)])
def test_unset_connections_and_io_threads_get_one_per_four_cores(tmp_path, monkeypatch, cores, lanes):
    """With transport.connections / io_threads unset: a quarter of the host's cores, at least 1 and
    at most 4, with CURVE and without (one connection's bytes and its encryption run on one I/O
    thread); set values keep theirs. The host's cores are replaced (this box has 2)."""
    import os

    from distill.config import load_run_file

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    curve = CurveConfig(secret_key="t.key_secret", authorized_keys="students")
    t = TransportConfig(curve=curve)
    assert (t.connections, t.io_threads) == (lanes, lanes)
    assert (TransportConfig().connections, TransportConfig().io_threads) == (lanes, lanes)
    t = TransportConfig(curve=curve, connections=2, io_threads=8)
    assert (t.connections, t.io_threads) == (2, 8)
    t.credit_samples = 32  # re-validated on assignment: the lanes stay
    assert (t.connections, t.io_threads) == (2, 8)
    # From a run file, as each side loads it, with CURVE and without.
    run = tmp_path / "run.yaml"
    for curve_line in ("  curve: {secret_key: t.key_secret, authorized_keys: students}\n", ""):
        run.write_text("transport:\n  bind: [tcp://127.0.0.1:5555]\n" + curve_line)
        rt = load_run_file(run).transport
        assert (rt.connections, rt.io_threads) == (lanes, lanes)
        rt = load_run_file(run, {"transport.connections": 1}).transport
        assert (rt.connections, rt.io_threads) == (1, lanes)


def test_chunk_bytes_defaults_to_1_mib_with_curve_and_whole_tensors_without():
    from distill.config import validate
    from distill.errors import ConfigError

    curve = CurveConfig(secret_key="t.key_secret", authorized_keys="students")
    assert TransportConfig().wire_chunk_bytes == 0
    assert TransportConfig(curve=curve).wire_chunk_bytes == 1 << 20
    assert TransportConfig(curve=curve, chunk_bytes=0).wire_chunk_bytes == 0
    assert TransportConfig(chunk_bytes=1 << 16).wire_chunk_bytes == 1 << 16
    for bad in (4096, -1):
        with pytest.raises(ConfigError, match="chunk_bytes") as ei:
            validate(TransportConfig, {"chunk_bytes": bad})
        assert "\n" not in str(ei.value)

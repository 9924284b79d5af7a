"""Malformed messages fed to live peers over real sockets: each is rejected and counted, the peer
keeps serving."""

from __future__ import annotations

import msgpack
import pytest
import torch
import zmq
from waiting import wait_until

from distill import protocol as P
from distill.config import SpoolConfig, TransportConfig
from distill.protocol import Sample
from distill.transport import Publisher, Subscriber, TransportError


def _wait(cond, timeout=10.0):
    return wait_until(cond, timeout)


def test_teacher_rejects_garbage_and_keeps_serving(tmp_path):
    ep = f"ipc://{tmp_path}/t.sock"
    cfg = TransportConfig(bind=[ep], connect=[ep], heartbeat_interval_s=0.1, shm="off")
    with Publisher(cfg, SpoolConfig(dir=str(tmp_path / "spool"))) as pub:
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.connect(ep)
        bad = [
            [b"\xc1\xc1\xc1"],  # not msgpack
            [msgpack.packb("a string")],  # not a map
            [msgpack.packb({"v": 99, "k": P.HELLO})],  # wrong version
            [msgpack.packb({"v": P.PROTOCOL_VERSION, "k": 1234})],  # unknown kind
            [P.encode_control(P.HELLO, name="x", credit_samples=-1, credit_bytes=5)],  # bad credits
            [P.encode_control(P.HEARTBEAT), b"extra frame"],  # control with extra frame
            [b"\x00" * (P.MAX_HEADER_BYTES + 10)],  # oversized header
            [
                msgpack.packb(
                    {
                        "v": P.PROTOCOL_VERSION,
                        "k": P.HELLO,
                        "credit_samples": [1] * 10,
                        "credit_bytes": {"a": 1},
                    }
                )
            ],
        ]
        for frames in bad:
            raw.send_multipart(frames)
        # The same raw peer then says HELLO properly and sends an ACK with a wrong field type.
        raw.send(P.encode_control(P.HELLO, name="raw", credit_samples=1, credit_bytes=1 << 20))
        raw.send(P.pack({"v": P.PROTOCOL_VERSION, "k": P.ACK, "tid": "x", "seqs": "not a list"}))
        assert _wait(lambda: pub.stats()["rejected"] >= len(bad) + 1)
        assert pub.stats()["rejected"] == len(bad) + 1
        raw.send(P.encode_control(P.BYE))
        raw.close(0)
        # A real student still gets served.
        sub_cfg = cfg.model_copy(update={"credit_samples": 4})
        with Subscriber(sub_cfg) as sub:
            pub.submit(Sample(key="ok", tensors={"hidden_states": torch.ones(3, 1, 4)}))
            s = sub.get(timeout=10)
            assert s is not None and s.key == "ok"
            assert torch.equal(s.tensors["hidden_states"], torch.ones(3, 1, 4))
            sub.ack(s)
            assert _wait(lambda: pub.stats()["acked"] == 1)
        reasons = pub.stats()["rejected_by_reason"]
        assert {"garbage", "version", "kind", "field", "frames", "header_too_large"} <= set(reasons)


@pytest.mark.parametrize("checksum", ["crc32", "xxh3", "xxh3-tree"])
def test_student_rejects_malformed_samples_and_keeps_receiving(tmp_path, checksum):
    ep = f"ipc://{tmp_path}/fake-teacher.sock"
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.bind(ep)
    cfg = TransportConfig(connect=[ep], heartbeat_interval_s=0.1, shm="auto")
    sub = Subscriber(cfg).start()
    try:
        # Handshake as a teacher would.
        ident, hello = router.recv_multipart()
        assert P.decode_header(hello)["k"] == P.HELLO
        router.send_multipart([ident, P.encode_control(P.WELCOME, tid="fake", shm=None)])
        while True:
            ident, msg = router.recv_multipart()
            if P.decode_header(msg)["k"] == P.CREDIT:
                break
        good = Sample(
            key="good",
            tensors={"hidden_states": torch.arange(24, dtype=torch.float32).view(4, 2, 3)},
            teacher="fake",
            seq=1,
        )
        h, bufs = P.sample_header(good, checksum=checksum)
        payload = bytes(bufs[0])
        # The header key that carries the digest.
        digest = {"crc32": "crc", "xxh3": "x3", "xxh3-tree": "x3t"}[checksum]

        def spec(**kw):
            t = list(h["t"][0])
            for i, k in enumerate(("name", "dtype", "shape", "frame")):
                if k in kw:
                    t[i] = kw[k]
            return P.pack({**h, "t": [t]})

        bad = [
            [b"garbage bytes"],  # header not msgpack
            [P.pack(h), payload[:-5]],  # truncated tensor frame
            [P.pack(h)],  # missing frame
            [P.pack(h), payload, b"extra"],  # extra frame
            [spec(dtype="q80"), payload],  # bad dtype
            [spec(shape=[1 << 40, 1 << 20]), payload],  # huge declared shape
            [spec(shape=[-1, 2, 3]), payload],  # negative dimension
            [P.pack({**h, "shm": ["/dev/shm/nope", [4096]]})],  # shm slot on a ring never offered
            [P.pack({**h, "k": 55}), payload],  # unknown kind
            [P.pack({**h, digest: str(h[digest])}), payload],  # digest of the wrong type
        ]
        for frames in bad:
            router.send_multipart([ident, *frames])
        router.send_multipart([ident, P.pack(h), payload])
        s = sub.get(timeout=10)
        assert s is not None and s.key == "good"
        assert torch.equal(s.tensors["hidden_states"], good.tensors["hidden_states"])
        assert sub.stats()["rejected"] == len(bad)
        assert sub.stats()["received"] == 1
        sub.ack(s)
        # The ack reaches the fake teacher.
        while True:
            ident, msg = router.recv_multipart()
            hh = P.decode_header(msg)
            if hh["k"] == P.ACK:
                assert hh["seqs"] == [1]
                break
        # A sample whose bytes do not match its checksum: rejected and counted, never handed out,
        # and the student opens a new session so that the teacher sends it again.
        bad_digest = {**h, "seq": 2, "key": "damaged", digest: h[digest] ^ 1}
        router.send_multipart([ident, P.pack(bad_digest), payload])
        while True:
            ident, msg = router.recv_multipart()
            if P.decode_header(msg)["k"] == P.HELLO:
                break
        assert sub.stats()["rejected_by_reason"].get("checksum") == 1
        assert sub.get(timeout=0.5) is None
        router.send_multipart([ident, P.encode_control(P.WELCOME, tid="fake", shm=None)])
        router.send_multipart(
            [ident, P.pack({**h, "seq": 3, "key": "damaged"}), payload]
        )  # sent again, intact
        s2 = sub.get(timeout=10)
        assert s2 is not None and s2.key == "damaged"
        sub.ack(s2)
        router.send_multipart([ident, P.encode_control(P.END, tid="fake")])
        assert sub.get(timeout=10) is None and sub.finished
    finally:
        sub.close()
        router.close(0)


def test_student_rejects_chunked_samples_with_a_damaged_missing_or_extra_chunk(tmp_path):
    """Tensors in several frames (transport.chunk_bytes, the default with CURVE) over a real socket
    from a fake teacher: a flipped byte in one chunk is a checksum error (the default digest, taken
    over the joined bytes) and the student opens a new session for the teacher to send it again; a
    missing or an extra chunk is a frames error. None is handed out; the intact copy is, whole."""
    ep = f"ipc://{tmp_path}/fake-teacher.sock"
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.bind(ep)
    sub = Subscriber(TransportConfig(connect=[ep], heartbeat_interval_s=0.1, shm="off")).start()

    def welcome() -> bytes:
        while True:
            ident, msg = router.recv_multipart()
            if P.decode_header(msg)["k"] == P.HELLO:
                break
        router.send_multipart([ident, P.encode_control(P.WELCOME, tid="fake", shm=None)])
        return ident

    try:
        ident = welcome()
        hs = torch.arange(24, dtype=torch.float32).view(4, 2, 3)  # 96 bytes: 6 chunks of 16
        sample = Sample(
            key="k", tensors={"hidden_states": hs, "token_ids": torch.arange(4)}, teacher="fake", seq=1
        )
        frames = [bytes(f) for f in P.encode_sample(sample, checksum=TransportConfig().checksum, chunk=16)]
        assert P.decode_header(frames[0])["ch"] == 16 and len(frames) == 1 + 6 + 2
        flipped = list(frames)
        flipped[3] = bytes([flipped[3][0] ^ 1]) + flipped[3][1:]
        router.send_multipart([ident, *flipped])
        ident = welcome()  # the damaged sample ended the session: a new one
        assert sub.stats()["rejected_by_reason"].get("checksum") == 1
        router.send_multipart([ident, *frames[:3], *frames[4:]])  # a chunk missing
        router.send_multipart([ident, *frames, frames[-1]])  # one too many
        assert _wait(lambda: sub.stats()["rejected_by_reason"].get("frames") == 2), sub.stats()
        router.send_multipart([ident, *frames])
        s = sub.get(timeout=10)
        assert s is not None and s.key == "k" and torch.equal(s.tensors["hidden_states"], hs)
        assert torch.equal(s.tensors["token_ids"], torch.arange(4))
        assert sub.stats()["received"] == 1 and sub.stats()["rejected"] == 3
    finally:
        sub.close()
        router.close(0)


def test_student_reports_teacher_protocol_version_clearly(tmp_path):
    ep = f"ipc://{tmp_path}/old-teacher.sock"
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.bind(ep)
    sub = Subscriber(TransportConfig(connect=[ep], heartbeat_interval_s=0.1)).start()
    try:
        ident, _ = router.recv_multipart()
        router.send_multipart(
            [ident, msgpack.packb({"v": P.PROTOCOL_VERSION + 1, "k": P.WELCOME, "tid": "new"})]
        )
        try:
            sub.get(timeout=10)
            raise AssertionError("expected a TransportError")
        except TransportError as e:
            assert "protocol version" in str(e)
    finally:
        sub.close()
        router.close(0)

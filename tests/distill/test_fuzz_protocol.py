"""Seeded fuzzing of the decoder: thousands of mutated messages (byte flips, truncations, fields
replaced by values of every msgpack type, frames dropped / added / resized, shared-memory references
bent) must each either decode into a consistent Sample or raise ProtocolError, never anything else:
a peer's I/O thread relies on that to count a bad frame and carry on."""

from __future__ import annotations

import random

import msgpack
import pytest
import torch
from waiting import wait_until as _wait

from distill import protocol as P
from distill.errors import ProtocolError
from distill.protocol import Sample
from distill.shm import HEADER, ShmReader, ShmRing

ODD_VALUES = [
    None,
    True,
    0,
    -1,
    1 << 40,
    (1 << 64) - 1,
    -(1 << 63),
    1.5,
    float("nan"),
    "",
    "x" * 300,
    b"\x00\xff",
    [],
    [1, 2],
    ["a", "bfloat16", [1], 1],
    {},
    {"a": 1},
    [[None]],
]


def _sample(rng: random.Random) -> Sample:
    n = rng.randint(0, 9)
    layers = rng.randint(1, 3)
    dtype = rng.choice([torch.bfloat16, torch.float32, torch.float16])
    return Sample(
        key=f"k{rng.randint(0, 999)}",
        tensors={
            "hidden_states": torch.randn(n, layers, 8).to(dtype),
            "token_ids": torch.arange(n, dtype=torch.int64),
        },
        layers=list(range(layers)),
        meta={"num_tokens": n},
        teacher="t",
        seq=rng.randint(0, 1 << 20),
    )


def _mutate_value(rng: random.Random, v):
    """A random structural change somewhere inside a decoded header value."""
    if isinstance(v, dict) and v and rng.random() < 0.7:
        k = rng.choice(list(v))
        v = dict(v)
        r = rng.random()
        if r < 0.2:
            del v[k]
        else:
            v[k] = _mutate_value(rng, v[k])
        return v
    if isinstance(v, list) and v and rng.random() < 0.7:
        v = list(v)
        i = rng.randrange(len(v))
        r = rng.random()
        if r < 0.15:
            del v[i]
        elif r < 0.3:
            v.append(rng.choice(ODD_VALUES))
        else:
            v[i] = _mutate_value(rng, v[i])
        return v
    if isinstance(v, int) and not isinstance(v, bool) and rng.random() < 0.5:
        w = v + rng.choice([-1, 1, -(1 << 20), 1 << 20, 1 << 62])
        if -(1 << 63) <= w < 1 << 64:  # what msgpack can carry (an x3 is up to 2**64 - 1)
            return w
    return rng.choice(ODD_VALUES)


def _decode(header_bytes, frames, resolver=None):
    h = P.decode_header(header_bytes)
    if h["k"] != P.SAMPLE:
        return None
    s = P.decode_sample(h, frames, resolver)
    for t in s.tensors.values():  # a decoded sample is consistent: its views are readable
        assert isinstance(t, torch.Tensor)
        t.reshape(-1)[:1].tolist()
    return s


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mutated_frame_messages_decode_or_raise_protocol_error(seed):
    rng = random.Random(seed)
    outcomes = {"ok": 0, "rejected": 0}
    for _ in range(1500):
        sample = _sample(rng)
        chunk = rng.choice([0, 0, 16, 64])  # tensors in frames of this many bytes (`ch`)
        frames = [bytes(f) for f in P.encode_sample(sample, checksum=rng.choice(P.CHECKSUMS), chunk=chunk)]
        header, payload = frames[0], frames[1:]
        r = rng.random()
        if r < 0.3:  # raw byte damage in the header
            b = bytearray(header)
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(len(b))] = rng.randrange(256)
            header = bytes(b)
        elif r < 0.4:  # truncated header
            header = header[: rng.randrange(len(header))]
        elif r < 0.8:  # structural: a field (or something inside it) gets a value of another type
            header = msgpack.packb(_mutate_value(rng, msgpack.unpackb(header)), use_bin_type=True)
        else:  # payload frames dropped, added, resized or corrupted
            payload = list(payload)
            op = rng.randrange(4)
            if op == 0 and payload:
                payload.pop(rng.randrange(len(payload)))
            elif op == 1:
                payload.append(bytes(rng.randrange(64)))
            elif op == 2 and payload:
                i = rng.randrange(len(payload))
                payload[i] = payload[i][: rng.randrange(len(payload[i]) + 1)] + bytes(rng.randrange(3))
            elif payload and payload[0]:
                b = bytearray(payload[0])
                b[rng.randrange(len(b))] ^= 0xFF
                payload[0] = bytes(b)
        try:
            _decode(header, payload)
            outcomes["ok"] += 1
        except ProtocolError:
            outcomes["rejected"] += 1
    # Both outcomes occur: the mutations reach deep enough to be accepted sometimes (e.g. a meta
    # value changed) and are rejected most of the time.
    assert outcomes["rejected"] > 500 and outcomes["ok"] > 20, outcomes


def test_mutated_shared_memory_references_decode_or_raise_protocol_error(tmp_path):
    rng = random.Random(7)
    ring = ShmRing(str(tmp_path), "fuzz.ring", 1 << 20)
    reader = ShmReader()
    assert reader.attach(str(ring.path), ring.nonce)
    outcomes = {"ok": 0, "rejected": 0}
    try:
        for _ in range(1500):
            sample = _sample(rng)
            specs = [(t.numel() * t.element_size()) for t in sample.tensors.values()]
            offs = [ring.alloc(n) for n in specs]
            header, _ = P.sample_header(sample, shm=(str(ring.path), offs, HEADER, 1))
            h = msgpack.unpackb(P.pack(header) if isinstance(header, dict) else header)
            if rng.random() < 0.5:  # bend the shm reference itself
                shm = h["shm"]
                choice = rng.randrange(4)
                if choice == 0:
                    shm[1][rng.randrange(len(shm[1]))] = rng.choice([-4096, 0, 1 << 19, 1 << 20, 1 << 60])
                elif choice == 1:
                    shm[0] = rng.choice(["/nonexistent", "", str(tmp_path / "other.ring")])
                elif choice == 2:
                    shm[1] = shm[1][:-1]
                else:
                    h["shm"] = _mutate_value(rng, shm)
            else:
                h = _mutate_value(rng, h)
            frames = [] if rng.random() < 0.9 else [b"extra"]
            try:
                _decode(msgpack.packb(h, use_bin_type=True), frames, reader.resolve)
                outcomes["ok"] += 1
            except ProtocolError:
                outcomes["rejected"] += 1
            for off in offs:
                ring.free(off)
    finally:
        reader.close()
        ring.close()
    assert outcomes["rejected"] > 500 and outcomes["ok"] > 20, outcomes


# ---- over real sockets: the peers' I/O threads survive a stream of mutated messages ----------


N_LIVE = 10_000  # mutated messages per live peer


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _no_end(h):
    """A mutated kind may become END (a valid "stream over") or REFUSE (a valid "stop"): keep the
    stream open for the test."""
    if isinstance(h, dict) and h.get("k") in (P.END, P.REFUSE):
        h["k"] = P.HEARTBEAT
    return h


def _mutated_controls(rng: random.Random, kinds, n: int) -> list[list[bytes]]:
    good = {
        P.HELLO: {
            "v": P.PROTOCOL_VERSION,
            "k": P.HELLO,
            "name": "x",
            "credit_samples": 4,
            "credit_bytes": 1 << 20,
        },
        P.WELCOME: {"v": P.PROTOCOL_VERSION, "k": P.WELCOME, "tid": "fuzz", "shm": ["/dev/shm/none", "ab"]},
        P.CREDIT: {"v": P.PROTOCOL_VERSION, "k": P.CREDIT, "shm_ok": False},
        P.ACK: {"v": P.PROTOCOL_VERSION, "k": P.ACK, "tid": "fuzz", "seqs": [1, 2, 3]},
        P.HEARTBEAT: {"v": P.PROTOCOL_VERSION, "k": P.HEARTBEAT, "name": "x"},
        P.DRAIN: {"v": P.PROTOCOL_VERSION, "k": P.DRAIN, "tid": "fuzz"},
        P.BYE: {"v": P.PROTOCOL_VERSION, "k": P.BYE, "name": "x"},
        P.RESET: {"v": P.PROTOCOL_VERSION, "k": P.RESET, "tid": "fuzz"},
        P.COMMIT: {"v": P.PROTOCOL_VERSION, "k": P.COMMIT, "keys": ["a", "b"]},
        P.ACKED: {"v": P.PROTOCOL_VERSION, "k": P.ACKED, "keys": ["a"]},
        P.REFUSE: {"v": P.PROTOCOL_VERSION, "k": P.REFUSE, "tid": "fuzz", "reason": "x", "version": 99},
    }
    out = []
    for _ in range(n):
        h = _no_end(_mutate_value(rng, dict(good[rng.choice(kinds)])))
        msg = [msgpack.packb(h, use_bin_type=True)]
        r = rng.random()
        if r < 0.1:
            msg = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))]
        elif r < 0.15:
            msg.append(b"unexpected frame")
        out.append(msg)
    return out


def test_teacher_survives_mutated_control_messages(tmp_path):
    """A raw socket sends 10,000 mutated student messages (HELLO/CREDIT/ACK/COMMIT/ACKED/HEARTBEAT/BYE with fields of
    every type, garbage, extra frames) to a real Publisher; a real student then gets every sample."""
    import zmq

    from distill.config import SpoolConfig, TransportConfig
    from distill.transport import Publisher, Subscriber

    ep = f"ipc://{tmp_path}/t.sock"
    cfg = TransportConfig(bind=[ep], connect=[ep], shm="off", heartbeat_timeout_s=5)
    rng = random.Random(11)
    with Publisher(cfg, SpoolConfig(dir=str(tmp_path / "spool"))) as pub:
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(ep)
        rss0 = _rss()
        kinds = [P.HELLO, P.CREDIT, P.ACK, P.COMMIT, P.ACKED, P.HEARTBEAT, P.BYE]
        for msg in _mutated_controls(rng, kinds, N_LIVE):
            raw.send_multipart(msg)
        raw.send(P.encode_control(P.HEARTBEAT, name="last"))
        assert _wait(lambda: pub.stats()["rejected"] >= N_LIVE // 4, 60), pub.stats()
        assert _rss() - rss0 < 64 << 20, "publisher memory grew by more than 64 MiB under fuzzing"
        raw.close()
        with Subscriber(cfg) as sub:
            for i in range(3):
                pub.submit(Sample(key=f"s{i}", tensors={"x": torch.full((16,), float(i))}))
            got = []
            for _ in range(3):
                s = sub.get(timeout=10)
                assert s is not None, f"publisher stopped serving after fuzzing: {pub.stats()}"
                got.append(s.key)
                sub.ack(s)
            assert sorted(got) == ["s0", "s1", "s2"]
            assert _wait(lambda: pub.stats()["acked"] == 3)


def test_student_survives_mutated_teacher_messages(tmp_path):
    """A fake teacher answers a real Subscriber with 10,000 mutated messages (WELCOME, HEARTBEAT, DRAIN,
    RESET variants and mutated samples), then a valid WELCOME and sample: the student is still
    healthy, counts the rejects, and delivers the good sample."""
    import zmq

    from distill.config import TransportConfig
    from distill.transport import Subscriber

    ep = f"ipc://{tmp_path}/t.sock"
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    # No send limit: a ROUTER drops what goes past its high-water mark, and 10,000 messages sent at
    # once would lose some (the good sample among them) whenever the student drains them slowly. The
    # real teacher sends within the student's credit.
    router.setsockopt(zmq.SNDHWM, 0)
    router.bind(ep)
    rng = random.Random(12)
    cfg = TransportConfig(connect=[ep], shm="auto", shm_dir=str(tmp_path), heartbeat_timeout_s=30)
    try:
        with Subscriber(cfg) as sub:
            assert router.poll(10_000), "no HELLO"
            ident, hello = router.recv_multipart()
            assert P.decode_header(hello)["k"] == P.HELLO
            router.send_multipart([ident, P.encode_control(P.WELCOME, tid="fuzz", shm=None)])
            rss0 = _rss()
            msgs = _mutated_controls(rng, [P.WELCOME, P.HEARTBEAT, P.DRAIN, P.RESET, P.REFUSE], N_LIVE // 2)
            for _ in range(N_LIVE // 2):
                frames = [bytes(f) for f in P.encode_sample(_sample(rng))]
                h = _no_end(_mutate_value(rng, msgpack.unpackb(frames[0])))
                msgs.append([msgpack.packb(h, use_bin_type=True), *frames[1:]])
            rng.shuffle(msgs)
            for m in msgs:
                router.send_multipart([ident, *m])
            router.send_multipart([ident, P.encode_control(P.WELCOME, tid="fuzz", shm=None)])
            good = Sample(key="good", tensors={"x": torch.arange(8.0)}, teacher="fuzz", seq=10**6)
            router.send_multipart([ident, *P.encode_sample(good)])
            keys = []
            while "good" not in keys:
                s = sub.get(timeout=10)
                assert s is not None, f"student stopped receiving after fuzzing: {sub.stats()}"
                keys.append(s.key)
                sub.ack(s)
            assert sub.stats()["rejected"] >= N_LIVE // 4 and (sub._error or sub._sessions.error) is None, (
                sub.stats()
            )
            assert _rss() - rss0 < 64 << 20, "subscriber memory grew by more than 64 MiB under fuzzing"
    finally:
        router.close()

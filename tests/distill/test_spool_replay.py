"""Spool replay: our safetensors reader on damaged files, and the publisher's read-ahead (reader
threads into ring slots, within max_buffer_bytes, only while a student is connected) and removal of
acked files. Real ZeroMQ sockets (ipc) and a real shared-memory ring; one process."""

from __future__ import annotations

import json
import struct
import time

import pytest
import torch

from distill.config import SpoolConfig, TransportConfig
from distill.errors import SpoolChecksumError, SpoolFormatError
from distill.protocol import Sample, sample_x3
from distill.spool import list_spool, read_spool_file, read_spool_into, write_sample
from distill.transport import Publisher, Subscriber

KiB = 1024


def _wait(cond, timeout=10.0) -> bool:
    t = time.monotonic() + timeout
    while time.monotonic() < t:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def _sample(i: int, tokens: int = 64) -> Sample:
    s = Sample(
        key=f"k{i:03d}",
        tensors={
            "hidden_states": torch.full((tokens, 2, 64), float(i)).bfloat16(),
            "token_ids": torch.arange(tokens) + i,
        },
        layers=[1, 2],
    )
    s.x3 = sample_x3(s)
    return s


def _rewrite_header(path, edit) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    new = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


def test_damaged_files_raise_one_named_error(tmp_path):
    good = write_sample(tmp_path, _sample(1))
    assert read_spool_file(good).key == "k001"
    raw = good.read_bytes()
    cases = {
        "short": raw[:5],
        "header_too_long": struct.pack("<Q", len(raw)) + raw[8:],
        "not_json": raw[:8]
        + b"{" * struct.unpack("<Q", raw[:8])[0]
        + raw[8 + struct.unpack("<Q", raw[:8])[0] :],
        "truncated": raw[:-100],
    }
    for name, data in cases.items():
        p = tmp_path / f"{name}.safetensors"
        p.write_bytes(data)
        with pytest.raises(SpoolFormatError, match=name + ".safetensors"):
            read_spool_file(p)
    p = tmp_path / "offsets.safetensors"
    p.write_bytes(raw)
    _rewrite_header(p, lambda h: h["token_ids"].update(shape=[65]))
    with pytest.raises(SpoolFormatError, match="does not fit its data offsets"):
        read_spool_file(p)
    p = tmp_path / "dtype.safetensors"
    p.write_bytes(raw)
    _rewrite_header(p, lambda h: h["token_ids"].update(dtype="Q99"))
    with pytest.raises(SpoolFormatError, match="unreadable entry"):
        read_spool_file(p)


def test_read_into_caller_memory_and_release_on_damage(tmp_path):
    """alloc gets the shapes in the producer's order; a file that fails its digest after the bytes
    went into the caller's memory gives that memory back through release."""
    path = write_sample(tmp_path, _sample(2))
    asked, released = [], []

    def alloc(specs):
        asked.append(list(specs))
        return {k: torch.empty(shape, dtype=dt) for k, (shape, dt) in specs.items()}, "slot-1"

    s, handle = read_spool_into(path, alloc=alloc, release=released.append)
    assert handle == "slot-1" and asked == [["hidden_states", "token_ids"]] and not released
    assert torch.equal(s.tensors["token_ids"], torch.arange(64) + 2)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x01  # a byte of the last tensor
    path.write_bytes(bytes(raw))
    with pytest.raises(SpoolChecksumError):
        read_spool_into(path, alloc=alloc, release=released.append)
    assert released == ["slot-1"]


def test_replay_reads_ahead_within_budget_into_the_ring_and_removes_acked_files(tmp_path):
    spool = tmp_path / "spool"
    files = [write_sample(spool, _sample(i)) for i in range(12)]
    nbytes = _sample(0).nbytes
    budget = 5 * nbytes  # room for the 2 in flight and 2 read ahead (files are a little larger)
    ep = f"ipc://{tmp_path}/t.sock"
    cfg = TransportConfig(
        bind=[ep], connect=[ep], max_buffer_bytes=budget, credit_samples=2, shm_dir=str(tmp_path)
    )
    with Publisher(cfg, SpoolConfig(dir=str(spool))) as pub:
        time.sleep(0.5)
        st = pub.stats()  # no student yet: nothing is read ahead
        assert st["buffered_bytes"] == 0 and st["replayed"] == 0
        pub.close_input()
        got = []
        with Subscriber(cfg) as sub:
            held = [sub.get(timeout=10), sub.get(timeout=10)]  # credit 2: the teacher waits for acks
            assert all(held)
            # in flight (2) + read ahead (the reader threads never pass the budget)
            assert _wait(lambda: pub.stats()["buffered_bytes"] > 2 * nbytes), pub.stats()
            time.sleep(0.5)  # the readers had time to overshoot, if they would
            st = pub.stats()
            assert 2 * nbytes < st["buffered_bytes"] <= budget
            assert st["shm_samples"] >= 2  # replayed straight into ring slots
            sub.ack(held)
            got += [s.key for s in held]
            while (s := sub.get(timeout=10)) is not None:
                got.append(s.key)
                sub.ack(s)
            assert sub.finished
        assert sorted(got) == [f"k{i:03d}" for i in range(12)]  # each once
        st = pub.stats()
        assert st["acked"] == 12 and st["sent"] == 12 and st["redelivered"] == 0
    assert list_spool(spool) == [] and not any(f.exists() for f in files)  # removed after the acks

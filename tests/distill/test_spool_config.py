"""Spool files (ours and vLLM's layout) and typed config errors."""

from __future__ import annotations

import fcntl
import os

import pytest
import torch
from safetensors.torch import save_file

from distill.config import RunFile, TransportConfig, load_run_file, validate
from distill.errors import ConfigError, SpoolChecksumError
from distill.protocol import Sample, sample_crc, sample_x3, sample_x3t
from distill.spool import iter_spool, list_spool, read_spool_file, write_sample


def test_write_read_roundtrip_with_metadata(tmp_path):
    hs = torch.randn(5, 3, 8).bfloat16()
    s = Sample(
        key="row/7",
        tensors={"hidden_states": hs, "token_ids": torch.arange(5)},
        layers=[1, 2, 4],
        meta={"n": 5},
        teacher="t",
        seq=9,
    )
    p = write_sample(tmp_path, s)
    assert p.exists() and p.suffix == ".safetensors"
    # No temporary file is left; the empty .lock is what vLLM's load_hidden_states flocks.
    assert sorted(x.name for x in tmp_path.iterdir()) == [p.name, p.name + ".lock"]
    out = read_spool_file(p)
    assert out.key == "row/7" and out.layers == [1, 2, 4] and out.meta == {"n": 5} and out.seq == 9
    assert torch.equal(out.tensors["hidden_states"].view(torch.uint8), hs.view(torch.uint8))


def test_tensor_order_and_digest_survive_the_file(tmp_path):
    """safetensors returns tensors sorted by name; the digest (and the frames a replay sends) follow
    the producer's order: a file written in any order reads back in that order and checks."""
    s = Sample(
        key="k",
        tensors={
            "token_ids": torch.arange(4),
            "hidden_states": torch.randn(4, 2, 3),
            "loss_mask": torch.ones(4, dtype=torch.uint8),
        },
        layers=[1, 2],
    )
    out = read_spool_file(write_sample(tmp_path, s))  # raised SpoolChecksumError before
    assert list(out.tensors) == ["token_ids", "hidden_states", "loss_mask"]
    # A sample without a digest gets the xxh3 tree digest (the default checksum) in its file.
    assert out.x3t == sample_x3t(s) == sample_x3t(out) and out.crc is None and out.x3 is None


def _spool_sample(**kw) -> Sample:
    g = torch.Generator().manual_seed(3)
    tensors = {"hidden_states": torch.randn(6, 2, 8, generator=g).bfloat16(), "token_ids": torch.arange(6)}
    return Sample(key="d", tensors=tensors, layers=[1, 2], **kw)


def _flip_last_byte(p):
    raw = bytearray(p.read_bytes())
    raw[-1] ^= 0x01  # the last tensor byte
    p.write_bytes(bytes(raw))


def _file_metadata(p) -> dict:
    from safetensors import safe_open

    with safe_open(str(p), framework="pt") as f:
        return f.metadata()


def test_spool_file_keeps_the_samples_xxh3_and_rejects_damage(tmp_path):
    s = _spool_sample()
    s.x3 = sample_x3(s)
    p = write_sample(tmp_path, s)
    assert _file_metadata(p)["x3"] == str(s.x3) and "crc" not in _file_metadata(p)
    out = read_spool_file(p)
    assert out.x3 == s.x3 and out.crc is None
    _flip_last_byte(p)
    with pytest.raises(SpoolChecksumError, match="xxh3"):
        read_spool_file(p)
    # The recorded digest is the sample's own (computed once by the producer), not recomputed.
    s2 = _spool_sample()
    s2.x3 = 42
    with pytest.raises(SpoolChecksumError, match="xxh3"):
        read_spool_file(write_sample(tmp_path / "b", s2))


def test_spool_file_keeps_the_samples_tree_digest_and_rejects_damage(tmp_path):
    s = _spool_sample()
    s.x3t = sample_x3t(s)  # as the connector's copy threads computed it
    p = write_sample(tmp_path, s)
    md = _file_metadata(p)
    assert md["x3t"] == str(s.x3t) and "x3" not in md and "crc" not in md
    out = read_spool_file(p)
    assert out.x3t == s.x3t and out.x3 is None
    _flip_last_byte(p)
    with pytest.raises(SpoolChecksumError, match="xxh3 tree"):
        read_spool_file(p)
    # A sample without a digest (a `checksum: none` teacher) gets the tree digest in its file.
    bare = write_sample(tmp_path / "none", _spool_sample())
    assert _file_metadata(bare)["x3t"] == str(sample_x3t(_spool_sample()))
    assert read_spool_file(bare).x3t == sample_x3t(_spool_sample())
    _flip_last_byte(bare)
    with pytest.raises(SpoolChecksumError, match="xxh3 tree"):
        read_spool_file(bare)


def test_crc_only_spool_files_still_read_and_verify(tmp_path):
    """Files of earlier versions (and samples of a `checksum: crc32` teacher) carry a CRC32 only."""
    s = _spool_sample()
    s.crc = sample_crc(s)
    p = write_sample(tmp_path, s)
    assert _file_metadata(p)["crc"] == str(s.crc) and "x3" not in _file_metadata(p)
    out = read_spool_file(p)
    assert out.crc == s.crc and out.x3 is None
    _flip_last_byte(p)
    with pytest.raises(SpoolChecksumError, match="CRC32"):
        read_spool_file(p)
    # A file that carries both digests (another writer): both are checked.
    both = tmp_path / "both.safetensors"
    meta = {"key": "d", "x3": str(sample_x3(s)), "crc": str(s.crc), "order": '["hidden_states", "token_ids"]'}
    save_file(dict(s.tensors), str(both), metadata=meta)
    out = read_spool_file(both)
    assert (out.x3, out.crc) == (sample_x3(s), s.crc)
    save_file(dict(s.tensors), str(both), metadata={**meta, "crc": str(s.crc ^ 1)})
    with pytest.raises(SpoolChecksumError, match="CRC32"):
        read_spool_file(both)
    save_file(dict(s.tensors), str(both), metadata={**meta, "x3": str(sample_x3(s) ^ 1)})
    with pytest.raises(SpoolChecksumError, match="xxh3"):
        read_spool_file(both)


def test_failed_write_leaves_no_partial_file(tmp_path, monkeypatch):
    import distill.spool as spool

    def disk_full(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(spool, "save_file", disk_full)
    with pytest.raises(OSError):
        write_sample(tmp_path, Sample(key="x", tensors={"hidden_states": torch.ones(2, 2)}))
    assert list(tmp_path.iterdir()) == []


def test_reads_vllm_connector_files_with_lock(tmp_path):
    # vLLM's ExampleHiddenStatesConnector writes <dir>/<req>.safetensors (no metadata) and a .lock.
    sub = tmp_path / "req-abc"
    sub.mkdir()
    f = sub / "req-abc.safetensors"
    save_file({"hidden_states": torch.ones(4, 2, 6), "token_ids": torch.arange(4)}, str(f))
    lock = str(f) + ".lock"
    fd = os.open(lock, os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
    (samples,) = list(iter_spool(tmp_path))
    assert samples.key == "req-abc" and samples.tensors["hidden_states"].shape == (4, 2, 6)


def test_iter_spool_splits_ranks_and_rejects_empty(tmp_path):
    for i in range(10):
        write_sample(tmp_path, Sample(key=f"k{i}", tensors={"hidden_states": torch.zeros(1, 1, 1)}))
    a = [s.key for s in iter_spool(tmp_path, rank=0, world_size=2)]
    b = [s.key for s in iter_spool(tmp_path, rank=1, world_size=2)]
    assert sorted(a + b) == [f"k{i}" for i in range(10)] and not set(a) & set(b)
    assert len(list_spool(tmp_path)) == 10
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors files"):
        list(iter_spool(tmp_path / "empty"))


def test_unknown_key_names_key_and_allowed(tmp_path):
    with pytest.raises(ConfigError) as ei:
        validate(TransportConfig, {"credit_sample": 3}, "transport.")
    msg = str(ei.value)
    assert "transport.credit_sample" in msg and "credit_samples" in msg
    p = tmp_path / "x.yaml"
    p.write_text("transport:\n  bind: [tcp://127.0.0.1:1]\n  shm: maybe\nspol: {}\n")
    with pytest.raises(ConfigError) as ei:
        load_run_file(p)
    assert "spol" in str(ei.value) and "transport.shm" in str(ei.value)


def test_bad_values_are_named(tmp_path):
    with pytest.raises(ConfigError, match="endpoint"):
        validate(TransportConfig, {"bind": ["http://x"]})
    with pytest.raises(ConfigError, match="max_buffer_bytes"):
        validate(TransportConfig, {"max_buffer_bytes": 0})
    with pytest.raises(ConfigError, match="not found"):
        load_run_file(tmp_path / "missing.yaml")


def test_checksum_defaults_to_xxh3_tree_and_names_unknown_algorithms():
    assert TransportConfig().checksum == "xxh3-tree"
    for ok in ("none", "crc32", "xxh3", "xxh3-tree"):
        assert validate(TransportConfig, {"checksum": ok}).checksum == ok
    with pytest.raises(ConfigError, match="checksum"):
        validate(TransportConfig, {"checksum": "md5"})


def test_example_configs_load():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "configs"
    files = sorted(root.glob("*.yaml"))
    assert files, "configs/ has no example"
    for f in files:
        first = f.read_text().splitlines()[0]
        assert first.startswith("#") and (
            "distill-teacher" in first or "student.py" in first or "python" in first
        ), f
        assert isinstance(load_run_file(f), RunFile)

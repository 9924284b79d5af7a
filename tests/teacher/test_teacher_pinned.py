"""The connector's pinned staging pool (CUDA path), exercised on the CPU with pinning off.

Pinned memory needs CUDA, which CI does not have: `pin=False` is the only difference from the
pool the connector uses on a GPU.
"""

from __future__ import annotations

import pytest
from waiting import wait_until

pytest.importorskip("vllm")

from teacher.connector.parts import ConnectorTiming, PinnedBlock, PinnedPool  # noqa: E402

MiB = 1 << 20


def test_pool_reuses_bounds_and_grows():
    pool = PinnedPool(2, pin=False)
    a = pool.take(3 * MiB)
    assert a.numel() == 4 * MiB  # power of two
    b = pool.take(100)
    assert b.numel() == MiB  # at least 1 MiB
    assert pool.take(10) is None  # both busy, capacity 2: the caller copies to pageable memory
    pool.give(a)
    pool.give(b)
    assert pool.take(MiB) is b  # the smallest buffer that fits, found by identity
    assert pool.take(MiB) is a
    pool.give(a)
    pool.give(b)
    c = pool.take(8 * MiB)  # none fits: one idle buffer is replaced by a larger one
    assert c.numel() == 8 * MiB and pool._count == 2
    assert pool.take(MiB) is b  # a (first idle) was the one replaced
    assert pool.take(MiB) is None


def test_pool_disabled():
    assert PinnedPool(0, pin=False).take(10) is None


def test_background_pool_never_allocates_in_take_and_keeps_one_ahead(monkeypatch):
    """With `background` (the connector's pool), `take` only hands out idle buffers: a buffer it
    lacks is made on the pool's thread (take says None meanwhile: the caller defers), and a take
    that leaves none idle has the next one made ahead of need. The calling thread never allocates."""
    import threading

    caller = threading.get_ident()
    made_on: list[int] = []
    real_new = PinnedPool._new

    def spy(self, size):
        made_on.append(threading.get_ident())
        return real_new(self, size)

    monkeypatch.setattr(PinnedPool, "_new", spy)
    pool = PinnedPool(3, pin=False, background=True)
    try:
        assert pool.take(3 * MiB) is None  # nothing idle: one is being made
        a = _take_within(pool, 3 * MiB)
        assert a.numel() == 4 * MiB
        b = _take_within(pool, 3 * MiB)  # made ahead when `a` left none idle
        assert b is not a and b.numel() == 4 * MiB
        c = _take_within(pool, MiB)
        assert pool._count == 3 and pool.take(MiB) is None  # at capacity, all busy
        pool.give(a)
        assert pool.take(MiB) is a
        assert made_on and caller not in made_on, "a buffer was allocated on the calling thread"
        for x in (a, b, c):
            pool.give(x)
        # None fits: an idle buffer is replaced by a larger one, made on the pool's thread too
        d = _take_within(pool, 8 * MiB)
        assert d.numel() == 8 * MiB and pool._count == 3
    finally:
        pool.close()


def _take_within(pool: PinnedPool, nbytes: int, timeout: float = 10.0):
    """Take a buffer, polling (bounded) while the pool's thread makes it."""
    got = []
    assert wait_until(lambda: got.append(pool.take(nbytes)) or got[-1] is not None, timeout), "no buffer made"
    return got[-1]


def test_background_pool_stops_growing_when_pinning_fails(monkeypatch):
    """A buffer that cannot be made (pinned memory exhausted) stops the growth: capacity becomes
    what exists, said once; with none made, capacity 0 (the connector copies to pageable memory)."""

    def fail(self, size):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(PinnedPool, "_new", fail)
    pool = PinnedPool(4, pin=False, background=True)
    try:
        assert pool.take(MiB) is None
        assert wait_until(lambda: pool.error is not None and not pool._making, 10)
        assert pool.capacity == 0 and pool._count == 0
        assert pool.take(MiB) is None and not pool._making  # no further tries
    finally:
        pool.close()


@pytest.mark.parametrize(
    ("copy_threads", "shm", "rows", "block"),
    [(1, "auto", 8, False), (3, "auto", 1031, False), (3, "off", 1031, False), (3, "auto", 1031, True)],
    ids=["one-copy-ring", "chunked-ring", "chunked-pageable", "chunked-ring-block"],
)
def test_staged_sample_copied_out_once(tmp_path, monkeypatch, copy_threads, shm, rows, block):
    """The CUDA placement path on the CPU: a sample in a (here unpinned) staging buffer is copied
    once, into a shared-memory ring slot (shm auto) or fresh memory (shm off), and submitted; the
    staging buffer goes back to the pool and may be overwritten at once without touching what the
    student receives. With copy_threads > 1 and >= 4 MiB the copy is split into page-aligned chunks
    over a thread pool (1031 rows: 8.05 MiB, not a multiple of the chunking), and the default
    digest's leaves (xxh3-tree) are hashed by the copy threads as they write them (no second pass
    over the bytes): the Publisher never hashes it."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    import distill.protocol as P
    from distill.config import SpoolConfig, TransportConfig
    from distill.digest import x3t_of
    from distill.transport import Publisher, Subscriber
    from teacher.config import ConnectorConfig
    from teacher.connector import DistillHiddenStatesConnector
    from teacher.connector.parts import SampleInfo, SendJob

    ep = f"ipc://{tmp_path}/t.sock"
    tcfg = TransportConfig(
        bind=[ep], connect=[ep], shm=shm, shm_dir=str(tmp_path), shm_bytes=16 * MiB, checksum="xxh3-tree"
    )
    conn = DistillHiddenStatesConnector.__new__(DistillHiddenStatesConnector)  # no engine needed
    conn.cfg = ConnectorConfig(
        transport=tcfg, spool=SpoolConfig(dir=str(tmp_path / "spool")), copy_threads=copy_threads
    )
    conn.layer_ids = [1, 2]
    conn._placed = {"stream": 0, "spool": 0, "errors": 0}
    conn._timing = ConnectorTiming()
    # block: staging is a range of one pinned block (teacher.pinned_bytes), not a buffer of its own
    conn._pinned = PinnedBlock(16 * MiB, 4, pin=False) if block else PinnedPool(1, pin=False)
    conn._copy_pool = ThreadPoolExecutor(copy_threads) if copy_threads > 1 else None
    shape = (rows, 2, 1024)
    nbytes = rows * 2 * 1024 * 4
    with Publisher(tcfg, conn.cfg.spool) as pub, Subscriber(tcfg) as sub:
        conn._publisher = pub
        assert wait_until(lambda: pub.stats()["students"] >= 1, 10), pub.stats()
        staging = conn._pinned.take(nbytes)
        hs = staging[:nbytes].view(torch.float32).view(shape)
        want = torch.arange(rows * 2 * 1024, dtype=torch.float32).view(shape)
        hs.copy_(want)
        info = SampleInfo(key="row-1", meta={"m": 1}, path=str(tmp_path / "spool" / "x"))

        def no_hash_on_the_sender(sample):
            raise AssertionError("the sender thread hashed the sample")

        monkeypatch.setattr(P, "sample_x3t", no_hash_on_the_sender)

        def no_second_pass(tensors):
            raise AssertionError("a digest pass after the copy: the copy threads hash what they write")

        monkeypatch.setattr(conn, "_digest", no_second_pass)
        conn._place(SendJob("req-1", info, torch.arange(rows), hs, None, staging, None))
        if block:  # the range went back: the block is one free range, and the next take reuses it
            assert conn._pinned.free_ranges() == [(0, conn._pinned.nbytes)]
            assert conn._pinned.take(1).data_ptr() == staging.data_ptr()
        else:
            assert conn._pinned.take(1) is staging  # given back to the pool ...
        staging.fill_(0)  # ... and reused at once
        s = sub.get(timeout=10)
        assert s is not None and s.key == "row-1" and s.meta["m"] == 1
        assert torch.equal(s.tensors["hidden_states"], want)
        assert torch.equal(s.tensors["token_ids"], torch.arange(rows))
        # The digest the copy threads computed is the tree digest of what the student holds.
        assert s.x3t is not None and s.x3t == x3t_of([P.tensor_bytes(t) for t in s.tensors.values()])
        assert conn._timing.copy_s > 0 and conn._timing.digest_s > 0
        ring = 1 if shm == "auto" else 0
        assert sub.stats().get("shm_samples", 0) == ring and pub.stats().get("shm_samples", 0) == ring
        sub.ack(s)
        assert wait_until(lambda: pub.stats()["acked"] >= 1, 10), pub.stats()
        assert pub.stats()["acked"] == 1
        if ring:
            assert pub._ring.used_bytes == 0
    if conn._copy_pool is not None:
        conn._copy_pool.shutdown()


def test_layer_perm_maps_the_configured_order_to_the_cache_slots():
    """vLLM's cache holds the layers ascending; slot i of a delivered sample is layer_ids[i]."""
    import torch

    from teacher.connector.parts import layer_perm

    assert layer_perm([0, 1, 3]) is None  # already ascending: no reordering
    ids = [6, 0, 1, 5]
    perm = layer_perm(ids)
    cache = torch.tensor(sorted(ids)).view(1, -1, 1)  # [T=1, L, H=1]: each slot holds its layer id
    assert cache.index_select(1, perm).flatten().tolist() == ids


@pytest.mark.parametrize("checksum", ["xxh3", "xxh3-tree"])
def test_ring_sample_whose_bytes_changed_after_hashing_is_rejected_and_never_handed_out(tmp_path, checksum):
    """Shared-memory path with the default digest (xxh3) and the tree digest: the bytes in the ring
    slot no longer match the digest the teacher recorded (a byte changed after hashing): the student
    rejects the sample (counted under 'checksum') and never hands it out."""
    import time

    import torch

    import distill.protocol as P
    from distill.config import SpoolConfig, TransportConfig
    from distill.transport import Publisher, Subscriber

    ep = f"ipc://{tmp_path}/t.sock"
    tcfg = TransportConfig(
        bind=[ep], connect=[ep], shm="auto", shm_dir=str(tmp_path), shm_bytes=16 * MiB, checksum=checksum
    )
    if checksum == "xxh3-tree":
        assert TransportConfig().checksum == checksum  # the default
    with Publisher(tcfg, SpoolConfig(dir=str(tmp_path / "spool"))) as pub, Subscriber(tcfg) as sub:
        assert wait_until(lambda: pub.stats()["students"] >= 1, 10), pub.stats()
        slot = pub.ring_slot(
            {"hidden_states": ([64, 2, 256], torch.float32), "token_ids": ([64], torch.int64)}
        )
        assert slot is not None
        slot.tensors["hidden_states"].copy_(torch.randn(64, 2, 256))
        slot.tensors["token_ids"].copy_(torch.arange(64))
        s = P.Sample(key="damaged", tensors=dict(slot.tensors), layers=[1, 2])
        if checksum == "xxh3":
            s.x3 = P.sample_x3(s)
        else:
            s.x3t = P.sample_x3t(s)
        slot.tensors["hidden_states"].view(-1)[7] += 1.0  # changed after it was hashed
        pub.submit(s, slot=slot)
        deadline = time.monotonic() + 10
        while sub.stats()["rejected_by_reason"].get("checksum", 0) < 1 and time.monotonic() < deadline:
            assert sub.get(timeout=0.05) is None  # never handed out
        assert sub.stats()["rejected_by_reason"].get("checksum", 0) >= 1
        assert sub.stats().get("received", 0) == 0


def _worker_side():
    """A connector with only its worker-side bookkeeping (no vLLM config, no cache, no sender)."""
    from collections import deque

    from teacher.connector.plugin import DistillHiddenStatesConnector

    conn = DistillHiddenStatesConnector.__new__(DistillHiddenStatesConnector)
    conn._deferred = deque()
    conn._pending_copies = {}
    conn._finished_reqs = set()
    conn._lock_fds = {}
    conn._timing = ConnectorTiming()
    conn._sender_error = None
    return conn


def test_busy_pinned_pool_defers_the_copy_and_keeps_the_blocks_in_order():
    """CUDA path bookkeeping on the CPU: when every pinned buffer is busy, `_extract` does nothing
    (stubbed here: CUDA copies cannot run on CI) and the request waits in order, its blocks kept
    (not reported finished) until a later step copies it; the engine step never blocks."""
    from teacher.connector.plugin import _DEFERRED

    conn = _worker_side()
    free = {"buffers": 0}
    copied = []

    def extract(pending, info, wait=False):  # stands in for the CUDA copy: a buffer or nothing
        if free["buffers"] == 0:
            return False
        free["buffers"] -= 1
        copied.append(pending.req_id)
        conn._pending_copies[pending.req_id] = None  # copy done (no event on the CPU)
        return True

    conn._extract = extract
    conn.has_connector_metadata = lambda: False

    class Pending:
        def __init__(self, rid):
            self.req_id = rid

    for rid in ("a", "b"):
        conn._extract_or_defer(Pending(rid), None)
    assert [p.req_id for p, _ in conn._deferred] == ["a", "b"] and conn._timing.deferred == 2
    assert conn._pending_copies == {"a": _DEFERRED, "b": _DEFERRED}
    # The scheduler reports both finished: their blocks stay held while they wait.
    assert conn.get_finished({"a", "b"}) == (None, None)
    free["buffers"] = 1  # one buffer comes back: the oldest goes first, "b" waits on
    assert conn.get_finished(set()) == ({"a"}, None)
    # A new save arriving behind a waiting one queues behind it (order kept), even with room.
    free["buffers"] = 1
    conn._extract_or_defer(Pending("c"), None)
    assert copied == ["a"] and [p.req_id for p, _ in conn._deferred] == ["b", "c"]
    assert conn.get_finished(set()) == ({"b"}, None)  # the next step: "b" copied, "c" waits
    assert [p.req_id for p, _ in conn._deferred] == ["c"]
    free["buffers"] = 5
    conn._finished_reqs.add("c")
    assert conn.get_finished(set()) == ({"c"}, None)
    assert copied == ["a", "b", "c"] and not conn._deferred and not conn._pending_copies


def test_pending_saves_are_taken_off_when_the_step_binds_before_its_forward():
    """The worker takes a finished request's rows off the cache in `bind_connector_metadata`, which
    vLLM calls before the step's forward (so a CUDA copy overlaps that forward); `get_finished`
    after the forward only reports. A dead sender thread stops the step at bind, before a job is
    queued that nobody would take (`_extract` stubbed: CUDA copies cannot run on CI)."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as ref

    conn = _worker_side()
    conn._is_tp_rank_zero = True
    calls = []

    def extract(pending, info, wait=False):
        calls.append((pending.req_id, info))
        conn._pending_copies[pending.req_id] = None  # copy done (no event on the CPU)
        return True

    conn._extract = extract

    class Pending:
        def __init__(self, rid):
            self.req_id = rid

    meta = ref.ExampleHiddenStatesConnectorMetadata(pending_saves=[Pending("a"), Pending("b")])
    meta.distill_samples = {"a": "info-a"}
    conn.bind_connector_metadata(meta)
    assert calls == [("a", "info-a"), ("b", None)]  # at bind, in order, each with its sample info
    assert conn._timing.extract_s > 0
    assert conn.get_finished({"a", "b"}) == ({"a", "b"}, None)
    assert len(calls) == 2  # get_finished took nothing off again
    conn.clear_connector_metadata()

    conn._sender_error = OSError("disk full")
    with pytest.raises(RuntimeError, match="sender thread failed"):
        conn.bind_connector_metadata(ref.ExampleHiddenStatesConnectorMetadata(pending_saves=[Pending("c")]))
    assert len(calls) == 2  # nothing queued behind a dead sender


# ---------------------------------------------------------------------------------------------
# teacher.pinned_bytes: one block pinned at engine start, handed out in ranges.
# ---------------------------------------------------------------------------------------------


def test_block_hands_out_ranges_first_fit_and_merges_them_back_in_any_order():
    """Ranges of each request's size rounded up to 4 KiB (not a power of two), first fit; given
    back in any order, free neighbours merge, so the whole block is one free range again."""
    # Exactly the bytes asked for: torch's pinned allocator rounds a request up to a power of two,
    # so a block of 16 MiB plus slack would pin 32 MiB.
    assert PinnedBlock(16 * MiB, 8, pin=False).nbytes == 16 * MiB
    # Unless the largest range (a staging_bytes sample and its slack) needs more.
    blk = PinnedBlock(16 * MiB, 8, largest=16 * MiB + 2 * 4096, pin=False)
    total = blk.nbytes
    assert total == 16 * MiB + 2 * 4096 and blk.free_ranges() == [(0, total)]
    a, b, c = blk.take(5 * MiB + 128), blk.take(3 * MiB), blk.take(1)
    assert (a.numel(), b.numel(), c.numel()) == (5 * MiB + 4096, 3 * MiB, 4096)
    base = a.data_ptr()
    assert (b.data_ptr() - base, c.data_ptr() - base) == (5 * MiB + 4096, 8 * MiB + 4096)
    a.fill_(1), b.fill_(2), c.fill_(3)
    assert int(a.max()) == 1 and int(b.min()) == 2  # disjoint
    blk.give(a)  # a hole at the front: the next small request fills it (first fit)
    d = blk.take(MiB)
    assert d.data_ptr() == base
    assert blk.take(9 * MiB) is None  # 4 MiB + 4 KiB hole and 8 MiB at the end: neither fits
    for r in (c, d, b):  # back out of order: everything merges
        blk.give(r)
    assert blk.free_ranges() == [(0, total)]
    assert blk.peak_ranges == 3 and blk.peak_bytes == 8 * MiB + 2 * 4096  # a, b, c
    assert blk.take(16 * MiB + 128) is not None  # a staging_bytes sample plus its slack fits


def test_block_caps_the_ranges_out_at_pinned_buffers():
    blk = PinnedBlock(8 * MiB, 2, pin=False)
    r1, r2 = blk.take(4096), blk.take(4096)
    assert r1 is not None and r2 is not None and blk.take(4096) is None  # the caller defers
    blk.give(r1)
    assert blk.take(4096) is not None


def test_block_that_cannot_be_pinned_warns_once_and_copies_go_to_pageable_memory(monkeypatch, caplog):
    import torch

    real = torch.empty

    def no_pinned(*a, **kw):
        if kw.get("pin_memory"):
            raise RuntimeError("CUDA error: out of memory (pinned)")
        return real(*a, **kw)

    monkeypatch.setattr(torch, "empty", no_pinned)
    with caplog.at_level("WARNING"):
        blk = PinnedBlock(8 * MiB, 4)
    lines = [r.getMessage() for r in caplog.records if "staging block" in r.getMessage()]
    assert len(lines) == 1 and "teacher.pinned_bytes" in lines[0] and "pageable memory" in lines[0]
    assert blk.capacity == 0 and blk.take(4096) is None  # capacity 0: the connector copies pageable


def test_pinned_bytes_below_staging_bytes_is_refused_in_one_line(tmp_path, capsys):
    import yaml

    from distill.errors import ConfigError
    from teacher.cli import main
    from teacher.config import ConnectorConfig

    with pytest.raises(ConfigError, match=r"pinned_bytes \(1048576\) must be 0 or at least staging_bytes"):
        ConnectorConfig.from_extra({"pinned_bytes": MiB})
    assert ConnectorConfig.from_extra({"pinned_bytes": 1 << 32}).pinned_bytes == 1 << 32
    data = tmp_path / "d.jsonl"
    data.write_text('{"id": "a", "text": "x"}\n')
    run = tmp_path / "run.yaml"
    run.write_text(
        yaml.safe_dump(
            {
                "teacher": {"model": str(tmp_path), "layer_ids": [1], "dataset": str(data)},
                "spool": {"dir": str(tmp_path / "spool")},
            }
        )
    )
    assert main(["--config", str(run), "--set", "teacher.pinned_bytes=1048576"]) == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("distill-teacher: error: ")]
    assert len(lines) == 1 and "pinned_bytes (1048576) must be 0 or at least staging_bytes" in lines[0], err
    assert "Traceback" not in err


def test_the_default_block_is_4_gib_and_grows_to_hold_one_staged_sample():
    from teacher.config import ConnectorConfig, load_teacher_config

    assert ConnectorConfig.from_extra({}).pinned_bytes == 4 << 30
    # left at its default, the block holds one staged sample whatever staging_bytes is
    assert ConnectorConfig.from_extra({"staging_bytes": 6 << 30}).pinned_bytes == 6 << 30
    assert ConnectorConfig.from_extra({"pinned_bytes": 0}).pinned_bytes == 0  # the pool, asked for
    teacher = load_teacher_config(
        {"model": "m", "layer_ids": [1], "dataset": "d.jsonl", "staging_bytes": 6 << 30}
    )
    tuning = teacher.connector_tuning()
    assert tuning["pinned_bytes"] == 6 << 30
    assert ConnectorConfig.from_extra(tuning).pinned_bytes == 6 << 30  # what the connector is handed
    off = load_teacher_config({"model": "m", "layer_ids": [1], "dataset": "d.jsonl", "pinned_bytes": 0})
    assert ConnectorConfig.from_extra(off.connector_tuning()).pinned_bytes == 0

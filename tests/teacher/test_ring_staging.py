"""`teacher.ring_staging`: on CUDA each sample's rows are copied from the device straight into its
slot of the Publisher's shared-memory ring, page-locked for the GPU (no pinned buffer, no host copy).

The ring's side (reserving every page, the address a device registers) and the sender's side (a
sample whose rows are already in its slot: only the small tensors written, the slot hashed, nothing
copied) run on the CPU. The device-to-host copy into the registered ring needs CUDA: that test is
skipped here and runs on a GPU host (`pytest tests/teacher/test_ring_staging.py`).
"""

from __future__ import annotations

import os
import queue

import pytest
import torch
from waiting import wait_until

from distill.config import SpoolConfig, TransportConfig
from distill.shm import ShmRing

MiB = 1 << 20


def test_reserve_all_reserves_every_page_and_gives_the_address_slots_live_at(tmp_path):
    ring = ShmRing(str(tmp_path), "r.ring", 8 * MiB)
    try:
        assert os.stat(ring.path).st_blocks * 512 < ring.size  # sparse until reserved
        address, length = ring.reserve_all()
        assert length == ring.size and os.stat(ring.path).st_blocks * 512 >= ring.size
        slot = ring.slot({"hidden_states": ([16, 2, 64], torch.bfloat16)}, stamp=7)
        t = slot.tensors["hidden_states"]
        # The slot's tensor lives at its offset past the registered address, inside the range.
        assert t.data_ptr() - address == slot.offsets[0]
        assert address <= t.data_ptr() and t.data_ptr() + t.numel() * 2 <= address + length
        ring.free(slot.offset)
    finally:
        ring.close()
    assert not ring.path.exists()


def test_a_ring_that_cannot_be_reserved_whole_is_not_offered(tmp_path):
    from distill.transport import Publisher

    ring = ShmRing(str(tmp_path), "r.ring", MiB)
    ring._reserve = False  # a filesystem without posix_fallocate: pinning could SIGBUS
    try:
        assert ring.reserve_all() is None
    finally:
        ring.close()
    ep = f"ipc://{tmp_path}/t.sock"
    off = TransportConfig(bind=[ep], shm="off")
    with Publisher(off, SpoolConfig(dir=str(tmp_path / "spool"))) as pub:
        assert pub.ring_memory() is None  # no ring: the connector keeps the pinned path


def test_ring_staging_is_on_by_default_and_reaches_the_connector():
    pytest.importorskip("vllm")
    from teacher.config import ConnectorConfig, TeacherConfig

    assert ConnectorConfig().ring_staging is True
    assert TeacherConfig.model_fields["ring_staging"].default is True
    assert ConnectorConfig(ring_staging=False).ring_staging is False


def _connector(tmp_path, tcfg, kv, layer_ids, hidden_dtype="model"):
    """The worker side of a connector around the cache view `kv` [blocks, L, block_size, H]."""
    from collections import deque

    from teacher.config import ConnectorConfig
    from teacher.connector.parts import ConnectorTiming, layer_perm
    from teacher.connector.plugin import DistillHiddenStatesConnector
    from teacher.connector.staging import token_bytes

    conn = DistillHiddenStatesConnector.__new__(DistillHiddenStatesConnector)  # no engine needed
    conn.cfg = ConnectorConfig(
        transport=tcfg,
        spool=SpoolConfig(dir=str(tmp_path / "spool")),
        copy_threads=2,
        hidden_dtype=hidden_dtype,
        pinned_bytes=16 * MiB,
        staging_bytes=16 * MiB,
    )
    conn.layer_ids = layer_ids
    conn._perm = layer_perm(layer_ids)
    conn._perm_dev = None
    conn._cache = kv
    conn._block_size = kv.shape[2]
    conn._staged_token = token_bytes(kv.shape[1], kv.shape[3], kv.element_size(), hidden_dtype == "fp8")
    conn._deferred = deque()
    conn._pending_copies = {}
    conn._finished_reqs = set()
    conn._lock_fds = {}
    conn.use_lock = False
    conn._timing = ConnectorTiming()
    conn._sender_error = None
    conn._placed = {"stream": 0, "spool": 0, "errors": 0}
    conn._copy_pool = None
    conn._queue = queue.Queue()
    return conn


def test_a_sample_already_in_its_ring_slot_is_hashed_in_place_and_never_copied(tmp_path, monkeypatch):
    """The sender's side of ring staging, on the CPU: the rows are in the slot (as the device's copy
    leaves them), the sender writes only the loss mask and token ids into it, hashes the slot (the
    default tree digest) and submits it; the student reads that slot; its bytes go back on ack."""
    pytest.importorskip("vllm")
    import distill.protocol as P
    from distill.digest import x3t_of
    from distill.transport import Publisher, Subscriber
    from teacher.connector.parts import SampleInfo, SendJob, loss_mask

    ep = f"ipc://{tmp_path}/t.sock"
    tcfg = TransportConfig(bind=[ep], connect=[ep], shm="auto", shm_dir=str(tmp_path), shm_bytes=16 * MiB)
    kv = torch.zeros(4, 3, 16, 64, dtype=torch.bfloat16)
    conn = _connector(tmp_path, tcfg, kv, [2, 0])  # two of the three cached layers, reordered
    info = SampleInfo(key="row-1", meta={"m": 1}, path=str(tmp_path / "spool" / "x"), prompt_len=40)
    token_ids = torch.arange(40)
    mask = loss_mask(info, 40)

    def no_host_copy(dst, src):
        raise AssertionError("the rows were copied on the host")

    monkeypatch.setattr(conn, "_copy", no_host_copy)
    with Publisher(tcfg, conn.cfg.spool) as pub, Subscriber(tcfg) as sub:
        conn._publisher = pub
        assert wait_until(lambda: pub.stats()["students"] >= 1, 10), pub.stats()
        want = torch.randn(40, 2, 64).to(torch.bfloat16)
        with torch.inference_mode():  # the engine step (vLLM runs it in inference mode)
            slot = conn._ring_slot(40, mask, None, token_ids)
            assert slot is not None and list(slot.tensors) == ["hidden_states", "loss_mask", "token_ids"]
            hs = slot.tensors["hidden_states"]
            assert list(hs.shape) == [40, 2, 64] and hs.dtype == torch.bfloat16
            hs.copy_(want)  # what the device's copy writes
        # The sender thread (outside inference mode) writes the small tensors into the same slot.
        job = SendJob("req-1", info, token_ids, hs, None, None, None)
        job.slot, job.loss_mask = slot, mask
        conn._place(job)
        s = sub.get(timeout=10)
        assert s is not None and s.key == "row-1" and s.meta["m"] == 1
        assert torch.equal(s.tensors["hidden_states"], want)
        assert torch.equal(s.tensors["token_ids"], token_ids) and torch.equal(s.tensors["loss_mask"], mask)
        assert s.x3t is not None and s.x3t == x3t_of([P.tensor_bytes(t) for t in s.tensors.values()])
        assert sub.stats().get("shm_samples", 0) == 1
        sub.ack(s)
        assert wait_until(lambda: pub.stats()["acked"] >= 1, 10), pub.stats()
        assert pub._ring.used_bytes == 0
        # Over the Publisher's memory bound: no slot (the pinned path places or spools it).
        conn.cfg.transport.max_buffer_bytes = 1000
        assert conn._ring_slot(40, mask, None, token_ids) is None


def test_a_full_ring_is_counted_and_said_once_with_the_size_that_holds_the_credit_window(tmp_path):
    """Ring staging with every slot taken (students hold them until they ack): `_ring_slot` gives
    None (the pinned path takes the sample), counts each miss in the connector timing and says once
    how large the ring should be for the credit window at this sample's size (half again over it)."""
    pytest.importorskip("vllm")
    import logging

    from distill.transport import Publisher
    from teacher.connector.parts import SampleInfo, loss_mask

    ep = f"ipc://{tmp_path}/t.sock"
    tcfg = TransportConfig(bind=[ep], shm="auto", shm_dir=str(tmp_path), shm_bytes=MiB, credit_samples=50)
    kv = torch.zeros(4, 3, 16, 1024, dtype=torch.bfloat16)
    conn = _connector(tmp_path, tcfg, kv, [2, 0])
    info = SampleInfo(key="row-1", meta={}, path=str(tmp_path / "spool" / "x"), prompt_len=40)
    token_ids, mask = torch.arange(40), loss_mask(info, 40)
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    log = logging.getLogger("vllm.teacher.connector")
    log.addHandler(handler)
    try:
        with Publisher(tcfg, conn.cfg.spool) as pub:
            conn._publisher = pub
            taken = []
            while (slot := conn._ring_slot(40, mask, None, token_ids)) is not None:
                taken.append(slot)  # held, as slots are until students ack
                assert len(taken) < 100
            assert len(taken) >= 3 and conn._timing.ring_missed == 1
            assert conn._ring_slot(40, mask, None, token_ids) is None
            assert conn._timing.ring_missed == 2 and conn._timing.ring_staged == 0
            said = [m for m in lines if "no room in the" in m]
            assert len(said) == 1, lines
            # 40 rows x 2 layers x 1024 x 2 bytes + mask and token ids: about 0.16 MB a sample,
            # 50 of them (the credit window) about 8.2 MB, half again over it about 12 MB.
            assert "1 MB shared-memory ring for a 0.2 MB sample" in said[0], said[0]
            assert "about 12 MB per student (1.5 x credit_samples 50 x" in said[0], said[0]
            for slot in taken:
                pub.release_slot(slot)
            slot = conn._ring_slot(40, mask, None, token_ids)  # acked: room again
            assert slot is not None and conn._timing.ring_missed == 2
            pub.release_slot(slot)
    finally:
        log.removeHandler(handler)


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="device-to-host copies into a page-locked ring need CUDA (no GPU here)",
)
@pytest.mark.parametrize("hidden_dtype", ["model", "fp8"])
def test_rows_go_from_the_device_straight_into_the_page_locked_ring(tmp_path, hidden_dtype):
    """On a GPU: the ring is registered with CUDA, `_extract` copies a request's rows (configured
    layer order; fp8: quantized on the device) from the cache into its ring slot on the copy stream
    with no pinned buffer taken, and the student receives exactly the cache's rows. The cache is
    overwritten right after the copy's event: what was delivered is what the copy read."""
    pytest.importorskip("vllm")
    from distill import fp8
    from distill.transport import Publisher, Subscriber
    from teacher.connector.parts import PinnedBlock, SampleInfo
    from teacher.connector.staging import gather_rows, slot_mapping

    ep = f"ipc://{tmp_path}/t.sock"
    tcfg = TransportConfig(bind=[ep], connect=[ep], shm="auto", shm_dir=str(tmp_path), shm_bytes=64 * MiB)
    kv = torch.randn(16, 4, 16, 512, device="cuda").to(torch.bfloat16)
    conn = _connector(tmp_path, tcfg, kv, [3, 0, 2], hidden_dtype)
    conn._pinned = PinnedBlock(16 * MiB, 4)
    conn._copy_stream = None  # (vLLM's reference connector makes its copy stream on first use)

    class Pending:
        req_id, block_ids, filename = "req-1", [5, 2, 9, 11], str(tmp_path / "spool" / "x")
        token_ids = torch.arange(57)

    info = SampleInfo(key="row-1", meta={}, path=Pending.filename, prompt_len=57)
    with Publisher(tcfg, conn.cfg.spool) as pub, Subscriber(tcfg) as sub:
        conn._publisher = pub
        assert wait_until(lambda: pub.stats()["students"] >= 1, 10), pub.stats()
        conn._register_ring()
        assert conn._ring_host is not None
        try:
            slots = slot_mapping(Pending.block_ids, 16, 57).cuda()
            rows = gather_rows(kv, slots, conn._perm.cuda())
            with torch.inference_mode():  # as on the engine step
                assert conn._extract(Pending(), info)
            job = conn._queue.get_nowait()
            assert job.slot is not None and job.staging is None and conn._timing.ring_staged == 1
            assert conn._pinned.peak_bytes == 0  # no pinned range was taken
            job.copy_done.synchronize()
            kv.fill_(0)  # the cache's blocks are reused: the slot holds the copy
            conn._place(job)
            s = sub.get(timeout=10)
            assert s is not None
            want = (
                rows.cpu()
                if hidden_dtype == "model"
                else fp8.dequantize(*fp8.reference_quantize(rows), kv.dtype).cpu()
            )
            assert s.tensors["hidden_states"].dtype == torch.bfloat16
            assert torch.equal(s.tensors["hidden_states"], want)
            assert torch.equal(s.tensors["token_ids"], Pending.token_ids)
            assert sub.stats().get("shm_samples", 0) == 1
            sub.ack(s)
            assert wait_until(lambda: pub.stats()["acked"] >= 1, 10), pub.stats()
        finally:
            conn._ring_host.close()


_SMALL_TMPFS_RING = r"""
import sys, torch
from distill.config import SpoolConfig, TransportConfig
from distill.transport import Publisher

d = sys.argv[1]
for size in (64 << 20, 4 << 20):  # rings of 64 MB and 4 MB in an 8 MB tmpfs
    cfg = TransportConfig(bind=[f"ipc://{d}/t{size}.sock"], shm_dir=d, shm="on", shm_bytes=size)
    with Publisher(cfg, SpoolConfig(dir=sys.argv[2])) as pub:
        mem = pub.ring_memory()
        slot = pub.ring_slot({"hidden_states": ([256, 1024], torch.float32)})  # 1 MB
        if slot is not None:
            slot.tensors["hidden_states"].fill_(1.0)
            pub.release_slot(slot)
        print("ring", size, "memory", None if mem is None else mem[1], "slot", slot is not None, flush=True)
"""


def test_a_ring_larger_than_its_tmpfs_is_not_page_locked_and_still_takes_slots(tmp_path):
    """A container's small /dev/shm: a ring it cannot hold whole is not offered for page-locking
    (the connector keeps the pinned path; no SIGBUS from pinning unbacked pages) and its slots still
    work as before (each reserved when taken); a ring that fits is reserved whole. A real 8 MB tmpfs
    in a mount namespace of its own (skipped without root and unshare)."""
    from test_transport_bounds import _in_small_tmpfs

    r = _in_small_tmpfs(tmp_path, _SMALL_TMPFS_RING, str(tmp_path / "spool"))
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    lines = [x.split() for x in r.stdout.splitlines() if x.startswith("ring")]
    assert [x[1] for x in lines] == [str(64 << 20), str(4 << 20)], r.stdout
    assert lines[0][3] == "None" and lines[0][5] == "True", r.stdout  # too big: not offered, slots work
    assert int(lines[1][3]) >= 4 << 20 and lines[1][5] == "True", r.stdout  # fits: reserved whole

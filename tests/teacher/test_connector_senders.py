"""teacher.sender_threads: several threads place samples, so a slow spool write does not hold the
samples queued behind it. No engine needed: the connector's own send loop and shutdown, a real
Publisher over ipc, real spool files and a real Subscriber; only the spool write is made slow (and
counted) by wrapping distill.spool.write_sample."""

from __future__ import annotations

import threading
import time

import pytest
from waiting import wait_until

N = 24
ROWS, LAYERS, HIDDEN = 16, 2, 256  # 32 KiB of hidden states a sample


def _connector(
    tmp_path,
    sender_threads: int,
    spool_max_bytes: int = 0,
    drain_timeout_s: float = 5,
    queue_samples: int = 64,
):
    from distill.config import SpoolConfig, TransportConfig
    from distill.transport import Publisher
    from teacher.config import ConnectorConfig
    from teacher.connector import DistillHiddenStatesConnector
    from teacher.connector.parts import ConnectorTiming

    ep = f"ipc://{tmp_path}/t.sock"
    # Room in memory for two samples: with no student yet, the rest goes to the spool.
    tcfg = TransportConfig(
        bind=[ep], connect=[ep], shm="off", max_buffer_bytes=80 * 1024, heartbeat_interval_s=0.2
    )
    conn = DistillHiddenStatesConnector.__new__(DistillHiddenStatesConnector)  # no engine needed
    conn.cfg = ConnectorConfig(
        transport=tcfg,
        spool=SpoolConfig(dir=str(tmp_path / "spool"), max_bytes=spool_max_bytes),
        sender_threads=sender_threads,
        copy_threads=1,
        drain_timeout_s=drain_timeout_s,
        queue_samples=queue_samples,
    )
    conn.layer_ids = list(range(1, LAYERS + 1))
    conn._closed, conn._deferred, conn._stats = False, [], None
    conn._lock_fds, conn._copy_pool, conn._pinned = {}, None, None
    conn._placed = {"stream": 0, "spool": 0, "errors": 0, "unplaced": 0}
    conn._timing = ConnectorTiming()
    conn._abandon, conn._sender_error = False, None
    conn._count_lock = threading.Lock()
    conn._publisher = Publisher(tcfg, conn.cfg.spool).start()
    return conn, tcfg


@pytest.mark.parametrize("sender_threads", [1, 3])
def test_several_senders_write_spool_files_at_once_and_every_sample_arrives_once(
    tmp_path, monkeypatch, sender_threads
):
    """24 samples, memory for two, no student yet: the rest go to spool files, each write held
    0.2 s. One sender writes one file at a time; three write up to three at once. A student that
    comes afterwards receives every sample exactly once (from memory or replayed from the spool),
    and the connector's shutdown ends with every sender thread gone and every sample counted."""
    import torch

    import distill.spooler as spooler
    from distill.transport import Subscriber
    from teacher.connector.parts import SampleInfo, SendJob

    writing, most = 0, 0
    lock = threading.Lock()
    real_write = spooler.write_sample

    def slow_write(directory, sample):
        nonlocal writing, most
        with lock:
            writing += 1
            most = max(most, writing)
        try:
            time.sleep(0.2)
            return real_write(directory, sample)
        finally:
            with lock:
                writing -= 1

    monkeypatch.setattr(spooler, "write_sample", slow_write)
    conn, tcfg = _connector(tmp_path, sender_threads)
    pub = conn._publisher
    conn._start_senders()
    assert len(conn._senders) == sender_threads
    want = {}
    for i in range(N):
        key = f"k{i:02d}"
        hs = torch.full((ROWS, LAYERS, HIDDEN), float(i))
        want[key] = hs.clone()
        info = SampleInfo(key=key, meta={"i": i}, path=str(tmp_path / "spool" / key))
        conn._queue.put(SendJob(f"req-{i}", info, torch.arange(ROWS), hs, None, None, None))
    placed = lambda: conn._placed["stream"] + conn._placed["spool"]  # noqa: E731
    assert wait_until(lambda: placed() == N, 60), conn._placed
    assert conn._placed["errors"] == 0 and conn._placed["spool"] >= N - 4, conn._placed
    if sender_threads == 1:
        assert most == 1
    else:
        assert most >= 2, f"{sender_threads} senders never wrote two spool files at once"

    got: list[str] = []
    with Subscriber(tcfg.model_copy(update={"bind": []})) as sub:
        deadline = time.monotonic() + 60
        while len(got) < N and time.monotonic() < deadline:
            s = sub.get(timeout=5)
            if s is None:
                continue
            assert torch.equal(s.tensors["hidden_states"], want[s.key]), s.key
            got.append(s.key)
            sub.ack(s)
        assert wait_until(lambda: pub.stats()["acked"] >= N, 30), pub.stats()
        done = threading.Thread(target=conn.shutdown)
        done.start()
        done.join(60)
    assert not done.is_alive(), "the connector's shutdown did not end"
    assert sorted(got) == sorted(want), f"missing {sorted(set(want) - set(got))}"
    assert len(got) == len(set(got)), "a sample arrived twice"
    assert not any(t.is_alive() for t in conn._senders)
    assert pub.stats()["acked"] == N


@pytest.mark.parametrize(
    ("sender_threads", "queue_samples"),
    [(3, 64), (1, 4), (3, 4)],
    ids=["3-senders", "1-full-queue", "3-full-queue"],
)
def test_senders_waiting_for_spool_room_with_no_student_are_let_go_at_shutdown(
    tmp_path, sender_threads, queue_samples
):
    """Memory for two samples, a spool budget of one file and no student: the senders block in
    `submit` waiting for room, and behind them the queue holds the rest (full: `queue_samples`
    samples, with the engine thread's next put waiting). The connector's shutdown gives them
    drain_timeout_s, then lets every one of them go: it ends by itself (its stop marks wait for
    room in the queue instead of blocking on it), every sender thread is gone, and each sample is
    counted once, placed (memory or the spool file) or left unplaced (not committed: a next run
    generates it), none as an error."""
    import torch

    from teacher.connector.parts import SampleInfo, SendJob

    conn, _ = _connector(
        tmp_path, sender_threads, spool_max_bytes=1, drain_timeout_s=1, queue_samples=queue_samples
    )
    pub = conn._publisher
    conn._start_senders()
    n = min(N, 3 + sender_threads + queue_samples)  # placed + held by the senders + a full queue
    for i in range(n):
        key = f"k{i:02d}"
        hs = torch.full((ROWS, LAYERS, HIDDEN), float(i))
        info = SampleInfo(key=key, meta={}, path=str(tmp_path / "spool" / key))
        conn._queue.put(SendJob(f"req-{i}", info, torch.arange(ROWS), hs, None, None, None))
    # each sender holds a sample it cannot place: the spool is full
    assert wait_until(
        lambda: pub.spool_full_wait_s() > 0 and conn._queue.qsize() == n - 3 - sender_threads, 30
    ), (
        conn._placed,
        conn._queue.qsize(),
        pub.stats(),
    )
    assert conn._placed["stream"] + conn._placed["spool"] == 3, conn._placed
    done = threading.Thread(target=conn.shutdown)
    done.start()
    done.join(60)
    assert not done.is_alive(), "the connector's shutdown did not end with the spool full"
    assert not any(t.is_alive() for t in conn._senders)
    p = conn._placed
    assert p["errors"] == 0, p
    assert p["stream"] + p["spool"] + p["unplaced"] == n and p["unplaced"] == n - 3, p

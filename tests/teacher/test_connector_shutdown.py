"""The connector's shutdown (vLLM's worker, no engine needed here): what it does with samples still
in its Publisher's memory when no student holds them."""

from __future__ import annotations

import threading
import time

import pytest
from waiting import wait_until

N = 12


def _connector(tmp_path, connect_timeout_s: float, drain_timeout_s: float):
    """A connector whose Publisher holds N samples in memory and has never seen a student."""
    import torch

    from distill.config import SpoolConfig, TransportConfig
    from distill.protocol import Sample
    from distill.transport import Publisher
    from teacher.config import ConnectorConfig
    from teacher.connector import DistillHiddenStatesConnector

    ep = f"ipc://{tmp_path}/t.sock"
    tcfg = TransportConfig(
        bind=[ep], connect=[ep], shm="off", connect_timeout_s=connect_timeout_s, heartbeat_interval_s=0.2
    )
    conn = DistillHiddenStatesConnector.__new__(DistillHiddenStatesConnector)  # no engine needed
    conn.cfg = ConnectorConfig(
        transport=tcfg, spool=SpoolConfig(dir=str(tmp_path / "spool")), drain_timeout_s=drain_timeout_s
    )
    conn._closed, conn._deferred, conn._senders, conn._stats = False, [], [], None
    conn._lock_fds, conn._copy_pool, conn._pinned = {}, None, None
    pub = conn._publisher = Publisher(tcfg, conn.cfg.spool).start()
    for i in range(N):
        hs = torch.full((4, 2, 8), float(i))
        pub.submit(Sample(key=f"k{i:02d}", tensors={"hidden_states": hs, "token_ids": torch.arange(4)}))
    assert wait_until(lambda: pub.stats()["pending"] + pub.stats()["spooled"] == N, 10), pub.stats()
    return conn, pub, tcfg


def test_samples_wait_in_memory_for_a_first_student_within_connect_timeout(tmp_path):
    """A short generation ends before the first student has come (connect_timeout_s not passed):
    at shutdown the samples in memory get up to drain_timeout_s for it, and it takes them all
    from memory, none through the spool. (Before: shutdown spooled them at once, and the generate
    phase streamed nothing.)"""
    from distill.transport import Subscriber

    conn, pub, tcfg = _connector(tmp_path, connect_timeout_s=120, drain_timeout_s=30)
    assert pub.awaiting_students() and pub.stats()["pending"] == N
    done = threading.Thread(target=conn.shutdown)
    done.start()  # waits for a first student; none is there yet
    got = []
    with Subscriber(tcfg.model_copy(update={"bind": []})) as sub:
        while len(got) < N:
            s = sub.get(timeout=30)
            assert s is not None, f"{len(got)} of {N} samples came before the connector closed"
            got.append(s.key)
            sub.ack(s)
        done.join(30)
    assert not done.is_alive(), "the connector's shutdown did not end after its samples were acked"
    assert sorted(got) == [f"k{i:02d}" for i in range(N)]
    st = pub.stats()
    assert st["acked"] == N and st.get("spooled", 0) == 0, st
    assert not list((tmp_path / "spool").glob("*.safetensors"))


@pytest.mark.parametrize("why", ["connect_timeout passed", "a student came and left"])
def test_shutdown_spools_at_once_when_no_first_student_is_awaited(tmp_path, why):
    """Past connect_timeout_s, or once a student has come (it may have left for good), shutdown
    does not wait for one: the samples in memory go to the spool at once."""
    from distill.transport import Subscriber

    conn, pub, tcfg = _connector(
        tmp_path, connect_timeout_s=1 if "passed" in why else 120, drain_timeout_s=60
    )
    if "left" in why:
        with Subscriber(tcfg.model_copy(update={"bind": [], "credit_samples": 1})) as sub:
            s = sub.get(timeout=30)
            assert s is not None
            sub.ack(s)
            assert wait_until(lambda: pub.stats()["acked"] == 1, 10), pub.stats()
        assert wait_until(lambda: pub.stats()["students"] == 0, 10), pub.stats()
    assert wait_until(lambda: not pub.awaiting_students(), 10)
    t0 = time.monotonic()
    conn.shutdown()
    took = time.monotonic() - t0
    left = N - (1 if "left" in why else 0)
    spooled = list((tmp_path / "spool").glob("*.safetensors"))
    assert len(spooled) == left, (len(spooled), pub.stats())
    assert took < 30, f"shutdown waited {took:.1f}s for a student (drain_timeout_s=60)"

"""Transport bounds and topologies over real sockets (peers in threads of this process)."""

from __future__ import annotations

import torch
from waiting import wait_until as _wait

from distill.config import SpoolConfig, TransportConfig
from distill.protocol import Sample
from distill.spool import list_spool
from distill.transport import Publisher, Subscriber

KiB = 1024


def _sample(i: int, kib: int = 64) -> Sample:
    return Sample(key=f"k{i}", tensors={"hidden_states": torch.full((kib * KiB // 4,), float(i))})


def test_memory_bound_holds_when_the_student_stalls(tmp_path):
    """A student that takes samples but never acks: the teacher holds at most max_buffer_bytes in
    memory, the rest goes to the spool, and the counts add up."""
    ep = f"ipc://{tmp_path}/t.sock"
    budget = 1024 * KiB
    cfg = TransportConfig(bind=[ep], connect=[ep], max_buffer_bytes=budget, credit_samples=4, shm="off")
    spool = tmp_path / "spool"
    with Publisher(cfg, SpoolConfig(dir=str(spool))) as pub, Subscriber(cfg) as sub:
        assert _wait(lambda: pub.stats()["students"] == 1)
        peak = 0
        for i in range(64):  # 64 x 64 KiB = 4 MiB submitted against a 1 MiB budget
            pub.submit(_sample(i))
            peak = max(peak, pub.stats()["buffered_bytes"])
        held = [sub.get(timeout=5) for _ in range(4)]  # the student's whole credit, never acked
        assert all(s is not None for s in held)
        assert sub.get(timeout=0.5) is None, "the teacher sent beyond the student's credit"
        st = pub.stats()
        assert peak <= budget and st["buffered_bytes"] <= budget
        assert st["spooled"] > 0 and st["spooled"] + budget // (64 * KiB) >= 64
        assert len(list_spool(spool)) == st["spooled"]
        assert st["sent"] == 4
        # Once the student acks, everything drains: memory first, then the spool.
        sub.ack(held)
        pub.close_input()
        got = 4
        while True:
            s = sub.get(timeout=10)
            if s is None:
                break
            got += 1
            sub.ack(s)
        assert sub.finished and got == 64
        assert pub.stats()["acked"] == 64 and list_spool(spool) == []


def test_student_reads_from_two_teachers(tmp_path):
    """A student connected to two teacher endpoints gets every sample of both, and finishes only
    when both have ended."""
    eps = [f"ipc://{tmp_path}/a.sock", "tcp://127.0.0.1:0"]
    pubs = []
    for i, ep in enumerate(eps):
        cfg = TransportConfig(bind=[ep], teacher_id=f"teacher{i}")
        pubs.append(Publisher(cfg, SpoolConfig(dir=str(tmp_path / f"spool{i}"))).start())
    connect = [eps[0], pubs[1].endpoints[0]]
    with Subscriber(TransportConfig(connect=connect)) as sub:
        assert _wait(lambda: all(p.stats()["students"] == 1 for p in pubs))
        for i in range(20):
            pubs[i % 2].submit(_sample(i, kib=4))
        pubs[0].close_input()
        keys = []
        for _ in range(20):
            s = sub.get(timeout=10)
            assert s is not None
            keys.append((s.teacher, s.key))
            sub.ack(s)
        assert not sub.finished and sub.get(timeout=0.5) is None  # teacher1 is still open
        pubs[1].close_input()
        assert sub.get(timeout=10) is None and sub.finished
    for p in pubs:
        assert p.wait_done(5)
        p.close()
    assert sorted(k for _, k in keys) == sorted(f"k{i}" for i in range(20))
    assert {t for t, _ in keys} == {"teacher0", "teacher1"}


def test_ring_slot_samples_reach_shm_and_frame_students(tmp_path):
    """A producer that fills ring slots directly (one copy on the teacher): a shared-memory student
    maps them, a frames student gets them sent straight from the slot; all slots are freed."""
    ep = f"ipc://{tmp_path}/t.sock"
    cfg = TransportConfig(bind=[ep], connect=[ep], shm_dir=str(tmp_path), shm_bytes=8 << 20, credit_samples=2)
    with Publisher(cfg, SpoolConfig(dir=str(tmp_path / "spool"))) as pub:
        subs = [Subscriber(cfg).start(), Subscriber(cfg.model_copy(update={"shm": "off"})).start()]
        assert _wait(lambda: pub.stats()["students"] == 2)
        for i in range(10):
            slot = pub.ring_slot(
                {"hidden_states": ([16, 2, 32], torch.bfloat16), "token_ids": ([16], torch.int64)}
            )
            assert slot is not None
            slot.tensors["hidden_states"].copy_(torch.full((16, 2, 32), float(i)))
            slot.tensors["token_ids"].copy_(torch.arange(16) + i)
            pub.submit(Sample(key=f"k{i}", tensors=dict(slot.tensors)), slot=slot)
        pub.close_input()
        got = {}
        done = [False, False]
        while not all(done):
            for j, sub in enumerate(subs):
                s = None if done[j] else sub.get(timeout=0.05)
                if s is not None:
                    i = int(s.key[1:])
                    assert torch.equal(
                        s.tensors["hidden_states"], torch.full((16, 2, 32), float(i)).bfloat16()
                    )
                    assert torch.equal(s.tensors["token_ids"], torch.arange(16) + i)
                    got[s.key] = j
                    sub.ack(s)
                done[j] = sub.finished
        assert sorted(got) == sorted(f"k{i}" for i in range(10))
        assert set(got.values()) == {0, 1}
        assert subs[0].stats()["shm_samples"] > 0 and subs[1].stats()["shm_samples"] == 0
        assert pub._ring.used_bytes == 0
        for sub in subs:
            sub.close()


def test_samples_in_memory_spool_once_students_are_gone(tmp_path):
    """Samples held in memory for a student that leaves (its unacked ones included) move to the
    spool after connect_timeout_s without any student, and memory is released."""
    ep = f"ipc://{tmp_path}/t.sock"
    cfg = TransportConfig(
        bind=[ep], connect=[ep], connect_timeout_s=0.5, credit_samples=2, shm_dir=str(tmp_path)
    )
    spool = tmp_path / "spool"
    with Publisher(cfg, SpoolConfig(dir=str(spool))) as pub:
        sub = Subscriber(cfg).start()
        assert _wait(lambda: pub.stats()["students"] == 1)
        for i in range(6):
            pub.submit(_sample(i, kib=8))
        assert sub.get(timeout=5) is not None and sub.get(timeout=5) is not None  # held, never acked
        sub.close()  # BYE: its 2 samples go back to the queue
        assert _wait(lambda: pub.stats()["spooled"] == 6, timeout=10)
        st = pub.stats()
        assert st["buffered_bytes"] == 0 and st["redelivered"] == 2
        assert len(list_spool(spool)) == 6
        assert pub._ring.used_bytes == 0
        # A student that comes back gets them all from the spool.
        pub.close_input()
        with Subscriber(cfg) as sub2:
            keys = []
            for s in sub2:
                keys.append(s.key)
                sub2.ack(s)
        assert sorted(keys) == sorted(f"k{i}" for i in range(6))
        assert list_spool(spool) == []


def test_student_remembers_a_bounded_window_of_acked_keys(tmp_path):
    """Over real sockets: every sample arrives and is acked, and the student keeps only the newest
    `dedup_keys` acked keys (memory stays flat on long runs), oldest forgotten first."""
    ep = f"ipc://{tmp_path}/t.sock"
    cfg = TransportConfig(bind=[ep], connect=[ep], shm="off", dedup_keys=5)
    with Publisher(cfg, SpoolConfig(dir=str(tmp_path / "spool"))) as pub, Subscriber(cfg) as sub:
        assert _wait(lambda: pub.stats()["students"] == 1)
        for i in range(20):
            pub.submit(_sample(i, kib=4))
        got = []
        while len(got) < 20:
            s = sub.get(timeout=10)
            assert s is not None, f"only {len(got)} of 20 samples arrived"
            got.append(s.key)
            sub.ack(s)
        assert sorted(got) == sorted(f"k{i}" for i in range(20))
        assert list(sub._consumed) == got[-5:]
        assert _wait(lambda: pub.stats()["acked"] == 20)

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
        assert pub.stats()["acked"] == 64
    # Acked spool files are removed by the publisher's remover thread: all of them by the time
    # close() returns (asserting inside the block raced that thread).
    assert list_spool(spool) == []


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
    assert list_spool(spool) == []  # removed by the time close() returns (the remover thread)


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
        assert list(sub._deliveries._consumed) == got[-5:]
        assert _wait(lambda: pub.stats()["acked"] == 20)


def test_backed_ranges_merge_and_cover():
    """The ring's record of reserved pages: adjacent and overlapping ranges merge; a range is
    covered only when one reserved range holds all of it."""
    from distill.shm import _Backed

    b = _Backed()
    b.add(0, 4096)
    b.add(8192, 12288)
    assert b.covers(0, 4096) and b.covers(8192, 12288)
    assert not b.covers(0, 8192) and not b.covers(4096, 8192) and not b.covers(8192, 16384)
    b.add(4096, 8192)  # fills the gap: one range
    assert (b.starts, b.ends) == ([0], [12288]) and b.covers(100, 12000)
    b.add(20000, 30000)
    b.add(10000, 21000)  # overlaps both ends
    assert (b.starts, b.ends) == ([0], [30000])


_SMALL_TMPFS = r"""
import logging, sys, time, torch
from distill.config import SpoolConfig, TransportConfig
from distill.protocol import Sample
from distill.transport import Publisher, Subscriber

logging.basicConfig(level=logging.WARNING)
d = sys.argv[1]
ep = f"ipc://{d}/t.sock"
cfg = TransportConfig(bind=[ep], connect=[ep], shm_dir=d, shm="on", shm_bytes=64 << 20, credit_samples=20)

def sample(i):
    return Sample(key=f"k{i:03d}", tensors={"hidden_states": torch.full((256, 1, 1024), float(i))}, layers=[1])

with Publisher(cfg, SpoolConfig(dir=sys.argv[2])) as pub, Subscriber(cfg) as sub:
    for n in (20, 5):  # 20 MB against an 8 MB tmpfs; then 5 more once the first 20 are acked
        base = sub.stats().get("received", 0)
        for i in range(base, base + n):
            pub.submit(sample(i))
        got = []
        while len(got) < n:
            s = sub.get(timeout=10)
            assert s is not None, pub.stats()
            assert sub.valid(s) and torch.equal(s.tensors["hidden_states"], sample(int(s.key[1:])).tensors["hidden_states"])
            got.append(s)
        print("round", n, "ring", sub.stats()["shm_samples"], "frames", pub.stats()["shm_full"], flush=True)
        sub.ack(got)
        t_end = time.monotonic() + 10
        while pub.stats()["acked"] < base + n:
            assert time.monotonic() < t_end, pub.stats()
            time.sleep(0.01)
"""


def _in_small_tmpfs(tmp_path, script: str, *args: str):
    """Run `script` with python in a mount namespace of its own, with a real 8 MB tmpfs mounted
    on tmp_path/small (passed as the first argument); skip where that cannot be done."""
    import os
    import shutil
    import subprocess
    import sys

    if os.geteuid() != 0 or not shutil.which("unshare"):
        import pytest

        pytest.skip("needs root and unshare to mount a small tmpfs in a mount namespace of its own")
    path = tmp_path / "script.py"
    path.write_text(script)
    mnt = tmp_path / "small"
    mnt.mkdir()
    return subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c",
         'mount -t tmpfs -o size=8m tmpfs "$1" && shift && exec "$@"', "sh",
         str(mnt), sys.executable, str(path), str(mnt), *args],
        capture_output=True, text=True, timeout=120, cwd=os.getcwd(),
    )  # fmt: skip


def test_a_tmpfs_smaller_than_the_ring_sends_frames_instead_of_crashing(tmp_path):
    """A container's /dev/shm is often 64 MB, smaller than the 2 GiB default ring. The ring file is
    sparse, so without reserving pages the teacher's first write past the tmpfs's end is a SIGBUS.
    Here a real 8 MB tmpfs under a 64 MB ring: the samples that find no pages go in frames with the
    same bytes, the teacher says why once, the process exits 0, and once acked the reserved slots
    carry samples again."""
    r = _in_small_tmpfs(tmp_path, _SMALL_TMPFS, str(tmp_path / "spool"))
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    rounds = [line.split() for line in r.stdout.splitlines() if line.startswith("round")]
    assert len(rounds) == 2, r.stdout
    ring1, frames1 = int(rounds[0][3]), int(rounds[0][5])
    ring2, frames2 = int(rounds[1][3]), int(rounds[1][5])
    assert ring1 > 0 and frames1 > 0 and ring1 + frames1 == 20, rounds
    assert ring2 - ring1 == 5 and frames2 == frames1, "the reserved slots are used again after acks"
    said = [x for x in r.stderr.splitlines() if "is full" in x]
    assert len(said) == 1 and "docker run --shm-size" in said[0], r.stderr[-3000:]


_FULL_SPOOL_DISK = r"""
import os, sys, torch
from distill.config import SpoolConfig, TransportConfig
from distill.protocol import Sample
from distill.transport import Publisher, TransportError

d = sys.argv[1]
ep = f"ipc://{sys.argv[2]}/t.sock"
cfg = TransportConfig(bind=[ep], shm="off", connect_timeout_s=0.0)  # nobody connects: spool at once
pub = Publisher(cfg, SpoolConfig(dir=d)).start()
placed = 0
try:
    for i in range(20):  # 20 x 1 MB into 8 MB
        pub.submit(Sample(key=f"k{i:03d}", tensors={"hidden_states": torch.full((256, 1, 1024), float(i))}))
        placed += 1
except TransportError as e:
    print("error", e, flush=True)
pub.close()
print("placed", placed, "files", sorted(os.listdir(d)), flush=True)
"""


def test_a_full_spool_filesystem_is_one_line_and_leaves_no_partial_file(tmp_path):
    """spool.max_bytes unset and the spool's filesystem (a real 8 MB tmpfs) full: submit raises a
    TransportError that names the folder and spool.max_bytes; every sample it accepted is a whole
    file, no temporary file is left, and close() still works."""
    r = _in_small_tmpfs(tmp_path, _FULL_SPOOL_DISK, str(tmp_path))
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    err = [x for x in r.stdout.splitlines() if x.startswith("error")]
    assert len(err) == 1 and "is full" in err[0] and "spool.max_bytes" in err[0], r.stdout + r.stderr[-2000:]
    placed_line = [x for x in r.stdout.splitlines() if x.startswith("placed")][0]
    placed = int(placed_line.split()[1])
    names = eval(placed_line.split(" files ", 1)[1])  # a list literal printed by the script
    assert 0 < placed < 20
    assert len([n for n in names if n.endswith(".safetensors")]) == placed, names
    assert not [n for n in names if n.endswith(".tmp") or n.startswith(".")], names


def test_a_producer_waiting_on_a_full_spool_can_stop_waiting(tmp_path):
    """spool.max_bytes full and nobody connected: submit waits for room (spool_full_wait_s counts
    the wait) until stop_waiting_for_room(); then it raises TransportError naming spool.max_bytes,
    as does every later submit that would wait, and the spool holds only what was accepted before.
    (The connector calls this at shutdown so that vLLM's shutdown is not held.)"""
    import threading

    import pytest

    from distill.errors import TransportError

    ep = f"ipc://{tmp_path}/t.sock"
    cfg = TransportConfig(bind=[ep], shm="off", connect_timeout_s=0)
    spool = tmp_path / "spool"
    with Publisher(cfg, SpoolConfig(dir=str(spool), max_bytes=100 * KiB)) as pub:
        pub.submit(_sample(0))  # an empty spool takes one sample of any size
        assert pub.spool_full_wait_s() == 0.0
        out: list = []
        t = threading.Thread(target=lambda: out.append(_try(pub.submit, _sample(1))), daemon=True)
        t.start()
        assert _wait(lambda: pub.spool_full_wait_s() > 0.2), "submit did not wait for spool room"
        assert t.is_alive()
        pub.stop_waiting_for_room()
        t.join(timeout=10)
        assert not t.is_alive() and isinstance(out[0], TransportError), out
        assert "spool.max_bytes" in str(out[0]), out
        assert pub.spool_full_wait_s() == 0.0
        with pytest.raises(TransportError, match="spool.max_bytes"):
            pub.submit(_sample(2))  # would wait: raises at once
        assert len(list_spool(spool)) == 1 and pub.stats()["spooled"] == 1


def _try(fn, *args):
    try:
        return fn(*args)
    except Exception as e:
        return e

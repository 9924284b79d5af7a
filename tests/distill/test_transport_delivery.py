"""Delivery guarantees of the transport, each against its failure, in-process over real sockets:
a student declared gone while it holds shared-memory samples, redelivered copies of held samples,
commit at checkpoints and lost keys, a silent teacher, another protocol version, control messages
from another teacher, a full spool, stale rings, END only when the run says so."""

from __future__ import annotations

import os
import socket
import threading
import time

import msgpack
import torch
import zmq
from waiting import wait_until

from distill import protocol as P
from distill.config import SpoolConfig, TransportConfig
from distill.journal import Journal, JournalTail
from distill.protocol import Sample
from distill.spool import spool_bytes
from distill.transport import Publisher, Subscriber, TeacherGone, TransportError


def _cfg(tmp_path, **kw) -> TransportConfig:
    ep = f"ipc://{tmp_path}/t.sock"
    base = dict(
        bind=[ep], connect=[ep], shm_dir=str(tmp_path), heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0
    )
    base.update(kw)
    return TransportConfig(**base)


def _sample(i: int, n: int = 64) -> Sample:
    return Sample(
        key=f"k{i:03d}",
        tensors={"hidden_states": torch.full((n, 1, 8), float(i)), "token_ids": torch.arange(n) + 100 * i},
        layers=[1],
    )


def _mute(sub: Subscriber) -> None:
    """This student stops heartbeating (as if frozen): the teacher declares it gone."""
    sub._sessions.keepalive = lambda t, now: None


def test_frozen_student_finds_its_reused_slots_stale(tmp_path):
    """A student holds a shared-memory sample and goes silent; the teacher redelivers it to another
    student, which acks it; the slot is reused by new samples. The first student's copy is then
    detected as stale (valid() False) instead of silently holding another sample's bytes."""
    cfg = _cfg(tmp_path, shm="on", credit_samples=1)
    with Publisher(cfg, SpoolConfig(dir=str(tmp_path / "spool"))) as pub:
        a = Subscriber(cfg, name="a").start()
        pub.submit(_sample(0))
        s_a = a.get(timeout=10)
        assert s_a is not None and s_a.stamp is not None and a.valid(s_a)
        _mute(a)
        assert wait_until(lambda: pub.stats()["redelivered"] == 1, 10), pub.stats()
        with Subscriber(cfg, name="b") as b:
            s_b = b.get(timeout=10)
            assert s_b is not None and s_b.key == "k000" and b.valid(s_b)
            assert torch.equal(s_b.tensors["token_ids"], torch.arange(64))
            b.ack(s_b)
            assert wait_until(lambda: pub.stats()["acked"] == 1)
            # The freed slot takes new samples; a's view now points at them.
            for i in range(1, 4):
                pub.submit(_sample(i))
                s = b.get(timeout=10)
                b.ack(s)
            ids_seen_by_a = s_a.tensors["token_ids"].clone()
            assert not a.valid(s_a), "a stale shared-memory sample passed the stamp check"
            assert not torch.equal(ids_seen_by_a, torch.arange(64))  # what the check protects from
            assert a.stats()["stale"] == 1
        a.discard(s_a)
        a.close()


def test_redelivered_copy_of_a_held_sample_is_acked_with_it_not_for_it(tmp_path):
    """The student says HELLO again while it holds a sample (its session is replaced): the teacher
    redelivers the sample to the same student. The copy must not be acked while the original is
    held (that would free the slot under it); it is acked together with the original."""
    cfg = _cfg(tmp_path, shm="on", heartbeat_timeout_s=30)
    with Publisher(cfg, SpoolConfig(dir=str(tmp_path / "spool"))) as pub, Subscriber(cfg) as sub:
        pub.submit(_sample(7))
        s = sub.get(timeout=10)
        assert s is not None
        t = sub._sessions.links[0]
        sub._sessions.hello(t)  # a new session: the teacher redelivers what the old one held
        assert wait_until(lambda: sub.stats().get("held_copies", 0) == 1, 10), sub.stats()
        time.sleep(0.3)
        assert pub.stats()["acked"] == 0, "a copy was acked on behalf of a held sample"
        assert sub.valid(s) and torch.equal(s.tensors["token_ids"], torch.arange(64) + 700)
        sub.ack(s)
        assert wait_until(lambda: pub.stats()["acked"] == 1 and pub.stats()["inflight"] == 0, 10), pub.stats()
        assert sub.get(timeout=0.5) is None  # the copy is never handed out as a second sample


def test_discarded_sample_hands_over_its_waiting_copy(tmp_path):
    cfg = _cfg(tmp_path, shm="off", heartbeat_timeout_s=30)
    with Publisher(cfg, SpoolConfig(dir=str(tmp_path / "spool"))) as pub, Subscriber(cfg) as sub:
        pub.submit(_sample(3))
        s = sub.get(timeout=10)
        sub._sessions.hello(sub._sessions.links[0])
        assert wait_until(lambda: sub.stats().get("held_copies", 0) == 1, 10)
        sub.discard(s)
        s2 = sub.get(timeout=10)
        assert s2 is not None and s2.key == "k003"
        sub.ack(s2)
        assert wait_until(lambda: pub.stats()["acked"] == 1)


def test_commit_at_checkpoint_journals_and_a_lost_session_is_reported(tmp_path):
    """Acks without commit are not journaled; commit() journals them; a student that goes away
    with acked, uncommitted keys makes them lost (journal + take_lost) so they are generated again."""
    cfg = _cfg(tmp_path, shm="off")
    journal = tmp_path / "journal.txt"
    with Publisher(cfg, SpoolConfig(dir=str(tmp_path / "spool")), journal=str(journal)) as pub:
        sub = Subscriber(cfg, commit_on_ack=False).start()
        for i in range(6):
            pub.submit(_sample(i))
        got = [sub.get(timeout=10) for _ in range(6)]
        sub.ack(got[:3])
        assert wait_until(lambda: pub.stats()["acked"] == 3)
        assert Journal.read(journal).committed == set()
        assert sub.uncommitted == 3
        sub.commit()
        assert wait_until(lambda: Journal.read(journal).committed == {"k000", "k001", "k002"}, 10)
        sub.ack(got[3:5])  # trained after the checkpoint, then the student dies
        assert wait_until(lambda: pub.stats()["acked"] == 5)
        _mute(sub)
        assert wait_until(lambda: pub.stats()["lost"] == 2, 10), pub.stats()
        assert sorted(pub.take_lost()) == ["k003", "k004"]
        state = Journal.read(journal)
        assert state.lost == {"k003", "k004"} and "k005" not in state.committed
        sub.close()
    tail = JournalTail(journal)
    committed, lost = tail.poll()
    assert committed == {"k000", "k001", "k002"} and lost == {"k003", "k004"}


def test_auto_end_waits_for_the_drain_checkpoint(tmp_path):
    cfg = _cfg(tmp_path, shm="off")
    with (
        Publisher(cfg, SpoolConfig(dir=str(tmp_path / "spool"))) as pub,
        Subscriber(cfg, commit_on_ack=False) as sub,
    ):
        pub.submit(_sample(1))
        pub.close_input()
        s = sub.get(timeout=10)
        sub.ack(s)
        assert wait_until(lambda: sub.draining, 10)
        assert not pub.wait_done(0.5), "END before the acked sample was committed"
        sub.commit()
        assert pub.wait_done(10)
        assert sub.get(timeout=10) is None and sub.finished


def test_end_only_when_the_run_says_so(tmp_path):
    cfg = _cfg(tmp_path, shm="off")
    with (
        Publisher(cfg, SpoolConfig(dir=str(tmp_path / "spool")), auto_end=False) as pub,
        Subscriber(cfg) as sub,
    ):
        pub.submit(_sample(1))
        pub.close_input()
        sub.ack(sub.get(timeout=10))
        assert pub.wait_idle(10)
        assert not pub.wait_done(0.5) and not sub.finished
        pub.end()
        assert pub.wait_done(10)
        assert sub.get(timeout=10) is None and sub.finished


def test_the_students_a_publisher_names_and_expects_and_how_long_it_remembers_them(tmp_path):
    """`student_names`: open sessions, and expected or silent students not come yet; one that came
    and left (BYE) is not named. After END, an expected student that never comes is waited for
    (grace_s from the expectation) and reported. A name silent past transport.teacher_wait_s is
    forgotten (that student has stopped by itself): a long run keeps no growing list."""
    cfg = _cfg(tmp_path, shm="off", teacher_wait_s=4.0)
    with Publisher(cfg, SpoolConfig(dir=str(tmp_path / "spool")), auto_end=False) as pub:
        assert pub.student_names() == []
        with Subscriber(cfg) as sub:
            assert wait_until(lambda: pub.stats()["students"] == 1, 10)
            me = sub.name
            assert pub.student_names() == [me]
            pub.submit(_sample(1))
            pub.close_input()
            sub.ack(sub.get(timeout=10))
            assert pub.wait_idle(10)
            pub.expect_students(["gone-0", "gone-1", me])  # `me` is here: not waited for
            assert pub.student_names() == sorted(["gone-0", "gone-1", me])
            pub.end()
            assert pub.wait_done(10)
            t0 = time.monotonic()
            missing = pub.wait_end_delivered(0.2, grace_s=3.0)
            waited = time.monotonic() - t0
            assert sub.get(timeout=10) is None and sub.finished  # END reached the one that came
        assert missing == ["gone-0", "gone-1"], missing
        assert 1.0 < waited < 0.2 + cfg.heartbeat_timeout_s + 3.0 + 2.0, waited
        assert me not in pub.student_names()  # it left (BYE)
        # forgotten once silent for longer than teacher_wait_s (4 s after expect_students)
        assert wait_until(lambda: pub.student_names() == [], 10), pub.student_names()


def test_student_gives_up_on_a_silent_teacher(tmp_path):
    cfg = _cfg(tmp_path, teacher_wait_s=2.0, heartbeat_timeout_s=0.5)
    with Publisher(cfg, SpoolConfig(dir=str(tmp_path / "spool"))) as pub:
        sub = Subscriber(cfg).start()
        pub.submit(_sample(0))
        sub.ack(sub.get(timeout=10))
    t0 = time.monotonic()  # the teacher is gone now
    try:
        while True:
            assert sub.get(timeout=1) is None
            assert time.monotonic() - t0 < 10, "the student waits forever for a dead teacher"
    except TeacherGone as e:
        assert "no word from teacher" in str(e)
    assert 1.5 < time.monotonic() - t0 < 10
    sub.close()


def test_student_picks_up_a_restarted_teacher(tmp_path):
    """Teacher restarted on the same endpoint (new id): the student says HELLO again by itself,
    re-registers what it acked and has not committed, and commits it to the new teacher."""
    cfg = _cfg(tmp_path, shm="off", heartbeat_timeout_s=0.5)
    journal = tmp_path / "j.txt"
    spool = SpoolConfig(dir=str(tmp_path / "spool"))
    sub = Subscriber(cfg, commit_on_ack=False).start()
    with Publisher(cfg, spool, journal=str(journal)) as pub:
        pub.submit(_sample(0))
        sub.ack(sub.get(timeout=10))
        assert wait_until(lambda: pub.stats()["acked"] == 1)
    with Publisher(cfg, spool, journal=str(journal)) as pub2:
        assert wait_until(lambda: pub2.stats()["uncommitted"] == 1, 15), pub2.stats()
        pub2.submit(_sample(1))
        s = sub.get(timeout=10)
        assert s is not None and s.key == "k001"
        sub.ack(s)
        sub.commit()
        assert wait_until(lambda: Journal.read(journal).committed == {"k000", "k001"}, 10)
    sub.close()


def test_teacher_refuses_another_protocol_version(tmp_path):
    cfg = _cfg(tmp_path)
    with Publisher(cfg, SpoolConfig(dir=str(tmp_path / "spool"))):
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(cfg.bind[0])
        old = {"v": 1, "k": P.HELLO, "name": "old", "credit_samples": 1, "credit_bytes": 1}
        raw.send(msgpack.packb(old))
        assert raw.poll(5000), "no answer to a student of another protocol version"
        h = P.decode_header(raw.recv())
        assert h["k"] == P.REFUSE and h["version"] == P.PROTOCOL_VERSION
        raw.close()


def test_end_and_drain_from_another_teacher_are_rejected(tmp_path):
    ep = f"ipc://{tmp_path}/fake.sock"
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(ep)
    try:
        with Subscriber(TransportConfig(connect=[ep], shm="off", heartbeat_timeout_s=30)) as sub:
            assert router.poll(10_000)
            ident, _ = router.recv_multipart()
            router.send_multipart([ident, P.encode_control(P.WELCOME, tid="real", shm=None)])
            router.send_multipart([ident, P.encode_control(P.END, tid="intruder")])
            router.send_multipart([ident, P.encode_control(P.DRAIN, tid="intruder")])
            assert wait_until(lambda: sub.stats()["rejected_by_reason"].get("foreign", 0) == 2, 10)
            assert sub.get(timeout=0.5) is None and not sub.finished and not sub.draining
            router.send_multipart([ident, P.encode_control(P.END, tid="real")])
            assert sub.get(timeout=10) is None and sub.finished
    finally:
        router.close()


def test_full_spool_blocks_the_producer_until_students_take_samples(tmp_path):
    """max_buffer_bytes is one sample and spool.max_bytes about two: a producer submitting ten
    samples waits for the student instead of writing past the limit; nothing is lost."""
    one = _sample(0).nbytes
    cfg = _cfg(tmp_path, shm="off", max_buffer_bytes=one, connect_timeout_s=0.0, credit_samples=1)
    spool = SpoolConfig(dir=str(tmp_path / "spool"), max_bytes=int(2.5 * one))
    with Publisher(cfg, spool) as pub:
        done = threading.Event()

        def produce():
            for i in range(10):
                pub.submit(_sample(i))
            done.set()

        th = threading.Thread(target=produce, daemon=True)
        th.start()
        peak = 0
        t_end = time.monotonic() + 1.0
        while time.monotonic() < t_end:  # no student yet: the producer must be blocked
            peak = max(peak, spool_bytes(spool.dir))
            time.sleep(0.01)
        assert not done.is_set(), "the producer wrote past spool.max_bytes"
        assert wait_until(lambda: pub.stats()["spool_full_waits"] >= 1, 10), pub.stats()
        keys = []
        with Subscriber(cfg) as sub:
            while len(keys) < 10:
                s = sub.get(timeout=15)
                assert s is not None, pub.stats()
                keys.append(s.key)
                sub.ack(s)
                peak = max(peak, spool_bytes(spool.dir))
        assert done.wait(10)
        assert sorted(keys) == [f"k{i:03d}" for i in range(10)]
        assert peak <= spool.max_bytes + one, (peak, spool.max_bytes)


def test_stale_ring_of_a_dead_teacher_is_removed_at_start(tmp_path):
    dead = tmp_path / "distill-999999999-old.ring"
    dead.write_bytes(b"x")
    alive = tmp_path / f"distill-{os.getpid()}-mine.ring"
    alive.write_bytes(b"x")
    cfg = _cfg(tmp_path, shm="auto")
    with Publisher(cfg, SpoolConfig(dir=str(tmp_path / "spool"))) as pub:
        assert not dead.exists() and alive.exists()
        ring = pub._ring.path
        assert ring.exists()
    assert not ring.exists()  # a teacher removes its own ring on close


def test_bad_keys_are_refused_at_submit(tmp_path):
    cfg = _cfg(tmp_path, shm="off")
    with Publisher(cfg, SpoolConfig(dir=str(tmp_path / "spool"))) as pub:
        for bad in ("a\nb", "a\tb", "!lost"):
            try:
                pub.submit(Sample(key=bad, tensors={"x": torch.zeros(1)}))
            except ValueError:
                continue
            raise AssertionError(f"key {bad!r} accepted")


def test_transport_error_names_both_versions(tmp_path):
    """A teacher of another version: the student stops with one line naming both versions."""
    ep = f"ipc://{tmp_path}/old.sock"
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(ep)
    try:
        with Subscriber(TransportConfig(connect=[ep], shm="off")) as sub:
            assert router.poll(10_000)
            ident, _ = router.recv_multipart()
            router.send_multipart([ident, msgpack.packb({"v": 1, "k": P.WELCOME, "tid": "old"})])
            try:
                sub.get(timeout=10)
            except TransportError as e:
                msg = str(e)
                assert "version 1" in msg and f"speaks {P.PROTOCOL_VERSION}" in msg and "\n" not in msg
            else:
                raise AssertionError("no error for a teacher of another protocol version")
    finally:
        router.close()


def test_auto_end_waits_until_lost_keys_are_submitted_again(tmp_path):
    cfg = _cfg(tmp_path, shm="off")
    with Publisher(cfg, SpoolConfig(dir=str(tmp_path / "spool"))) as pub:
        dying = Subscriber(cfg, commit_on_ack=False).start()
        pub.submit(_sample(0))
        dying.ack(dying.get(timeout=10))
        assert wait_until(lambda: pub.stats()["acked"] == 1)
        _mute(dying)  # dies before its checkpoint
        assert wait_until(lambda: pub.stats()["lost"] == 1, 10)
        pub.close_input()
        with Subscriber(cfg) as sub:
            assert not pub.wait_done(1.0), "END although a lost key was never generated again"
            assert pub.take_lost() == ["k000"]
            pub.submit(_sample(0))
            s = sub.get(timeout=10)
            assert s is not None and s.key == "k000"
            sub.ack(s)
            assert pub.wait_done(10)
        dying.close()


def test_rings_of_earlier_teacher_sessions_are_unmapped(tmp_path):
    """A restarted teacher makes a new ring; the student unmaps the old one once no sample views it
    (an unlinked ring's pages stay allocated in /dev/shm while a student maps it)."""
    cfg = _cfg(tmp_path, shm="on", heartbeat_timeout_s=0.5)
    spool = SpoolConfig(dir=str(tmp_path / "spool"))
    with Subscriber(cfg) as sub:
        with Publisher(cfg, spool) as pub:
            pub.submit(_sample(0))
            s = sub.get(timeout=10)
            old_ring = str(pub._ring.path)
        assert old_ring in sub._shm._maps  # still viewed by the held sample
        with Publisher(cfg, spool) as pub2:
            # While the sample's tensor still views the old ring, detaching must wait, not fail.
            assert sub._shm.detach_unused(set()) == []
            assert sub.valid(s), "the held sample's slot was reused while it still views it"
            time.sleep(2 * cfg.heartbeat_interval_s)
            assert (sub._error or sub._sessions.error) is None
            sub.ack(s)
            del s
            pub2.submit(_sample(1))
            s1 = sub.get(timeout=15)
            assert s1 is not None and s1.key == "k001" and sub.valid(s1)
            assert wait_until(lambda: old_ring not in sub._shm._maps, 10), list(sub._shm._maps)
            assert str(pub2._ring.path) in sub._shm._maps
            sub.ack(s1)


def test_damaged_spool_file_is_set_aside_not_delivered(tmp_path):
    """A spool file whose bytes no longer match its digest is never handed to a student: it is
    counted and renamed `.corrupt` (then it no longer counts as spooled: distill-teacher generates
    the key again); the intact files are served."""
    from distill.errors import SpoolChecksumError
    from distill.spool import read_spool_file, write_sample

    spool = tmp_path / "spool"
    good = write_sample(spool, _sample(1))
    bad = write_sample(spool, _sample(2))
    raw = bytearray(bad.read_bytes())
    raw[-1] ^= 0xFF  # one flipped bit in the last tensor byte
    bad.write_bytes(bytes(raw))
    try:
        read_spool_file(bad)
        raise AssertionError("a damaged spool file was read without error")
    except SpoolChecksumError:
        pass
    cfg = _cfg(tmp_path, shm="off")
    with Publisher(cfg, SpoolConfig(dir=str(spool))) as pub, Subscriber(cfg) as sub:
        s = sub.get(timeout=10)
        assert s is not None and s.key == "k001" and s.x3t is not None  # the file's, carried on
        sub.ack(s)
        assert sub.get(timeout=1.0) is None
        assert wait_until(lambda: pub.stats()["rejected_by_reason"].get("spool_file") == 1, 10), pub.stats()
    assert not good.exists() and not bad.exists() and bad.with_name(bad.name + ".corrupt").exists()


def test_header_size_limit_comes_from_the_config(tmp_path):
    cfg = _cfg(tmp_path, shm="off", max_header_bytes=8192)
    with Publisher(cfg, SpoolConfig(dir=str(tmp_path / "spool"))) as pub, Subscriber(cfg) as sub:
        pub.submit(Sample(key="k", tensors={"x": torch.zeros(4)}, meta={"pad": "y" * 10_000}))
        assert sub.get(timeout=2.0) is None
        assert wait_until(lambda: sub.stats()["rejected_by_reason"].get("header_too_large", 0) >= 1, 10)
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(cfg.bind[0])
        raw.send(msgpack.packb({"v": P.PROTOCOL_VERSION, "k": P.HEARTBEAT, "name": "z" * 20_000}))
        assert wait_until(lambda: pub.stats()["rejected_by_reason"].get("header_too_large", 0) == 1, 10)
        raw.close()


def test_full_ring_sends_in_frames_counts_and_says_so_once(tmp_path, caplog):
    """A ring of three slots and a student with credit for six: three samples go through the ring,
    three in frames with the same bytes; the publisher counts them (shm_full) and logs the reason
    once. Once the student acks, the ring takes samples again."""
    cfg = _cfg(tmp_path, shm="on", credit_samples=6, shm_bytes=3 * 4096)
    caplog.set_level("WARNING", logger="distill.transport")
    with Publisher(cfg, SpoolConfig(dir=str(tmp_path / "spool"))) as pub, Subscriber(cfg) as sub:
        for i in range(6):
            pub.submit(_sample(i))
        got = []
        while len(got) < 6:
            s = sub.get(timeout=10)
            assert s is not None, pub.stats()
            got.append(s)
        for s in got:
            i = int(s.key[1:])
            assert sub.valid(s)
            assert torch.equal(s.tensors["hidden_states"], torch.full((64, 1, 8), float(i)))
            assert torch.equal(s.tensors["token_ids"], torch.arange(64) + 100 * i)
        via_ring = sub.stats()["shm_samples"]
        assert via_ring == 3, sub.stats()
        assert pub.stats()["shm_full"] == 3, pub.stats()
        said = [r.getMessage() for r in caplog.records if "shared-memory ring full" in r.getMessage()]
        assert len(said) == 1 and "transport.shm_bytes" in said[0], said
        sub.ack(got)
        assert wait_until(lambda: pub.stats()["acked"] == 6, 10), pub.stats()
        pub.submit(_sample(6))
        s = sub.get(timeout=10)
        assert s is not None and s.key == "k006"
        assert sub.stats()["shm_samples"] == 4 and pub.stats()["shm_full"] == 3
        sub.ack(s)


def test_spool_files_added_again_are_sent_once(tmp_path):
    """`add_spool_files` with files of the Publisher's own spool.dir, which `start()` queued
    already (and the same files twice): each sample is sent once, not once per call."""
    from distill.spool import list_spool, write_sample

    spool = tmp_path / "spool"
    for i in range(4):
        write_sample(spool, _sample(i))
    cfg = _cfg(tmp_path, shm="off")
    got: list[str] = []
    with Publisher(cfg, SpoolConfig(dir=str(spool))) as pub:
        pub.add_spool_files(list_spool(spool))
        pub.add_spool_files(list_spool(spool))
        with Subscriber(cfg) as sub:

            def drained() -> bool:
                s = sub.get(timeout=0.05)
                if s is not None:
                    got.append(s.key)
                    sub.ack(s)
                st = pub.stats()
                return st["acked"] >= 4 and not (st["spool_files"] or st["pending"] or st["inflight"])

            assert wait_until(drained, 15), pub.stats()
            skipped = sub.stats()["skipped_duplicates"]
        st = pub.stats()
    assert sorted(got) == [f"k{i:03d}" for i in range(4)]
    assert (st["sent"], st["replayed"], skipped) == (4, 4, 0), st
    assert list_spool(spool) == []


def test_a_new_publisher_binds_the_endpoint_its_predecessor_just_closed(tmp_path):
    """distill-teacher's serve phase starts its Publisher on the endpoint the engine phase's has just
    closed. ZeroMQ lets the port go in its I/O thread after close() returns, so an immediate bind
    used to fail now and then with "Address already in use" (it did in CI). Twenty hand-overs with
    students connected, each new Publisher started at once: every one binds. A port held by a
    socket that is not a closed Publisher's still fails, with one line."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ep = f"tcp://127.0.0.1:{port}"
    cfg = _cfg(tmp_path, bind=[ep], connect=[ep], shm="off")
    spool = SpoolConfig(dir=str(tmp_path / "spool"))
    subs = [Subscriber(cfg).start() for _ in range(3)]
    try:
        pub = Publisher(cfg, spool, auto_end=False).start()
        for i in range(20):
            assert wait_until(lambda p=pub: p.stats()["students"] == 3, 15), (i, pub.stats())
            pub.close()
            pub = Publisher(cfg.model_copy(update={"teacher_id": f"t{i}"}), spool, auto_end=False).start()
        pub.close()
    finally:
        for sub in subs:
            sub.close()
    other = zmq.Context.instance().socket(zmq.ROUTER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        ep2 = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    other.bind(ep2)
    try:
        cfg2 = _cfg(tmp_path, bind=[ep2], connect=[ep2], shm="off")
        try:
            Publisher(cfg2, spool).start()
        except TransportError as e:
            assert "Address already in use" in str(e) and "\n" not in str(e)
        else:
            raise AssertionError("a Publisher bound a port another socket holds")
    finally:
        other.close(0)

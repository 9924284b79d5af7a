"""The journal (distill/journal.py) against damage: a torn last line, bytes that are not text, a
write cut short, a file renamed over a waiting writer; and `<journal>.lock`, the one lock a
`distill-teacher` holds from its start to its exit (its end-to-end test: tests/system/test_teacher_cli.py)."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from waiting import wait_until

from distill import journal as jmod
from distill.errors import JournalBusy, JournalError
from distill.journal import Journal, JournalTail, OwnerLock

ROOT = Path(__file__).resolve().parents[2]


def _damage_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "distill.journal"]


def test_a_torn_last_line_is_no_record_and_the_next_commit_starts_a_line_of_its_own(tmp_path, caplog):
    """`k238` cut to `k23` (no newline): `k23` is not committed (it may be another key's prefix, or
    the key itself with its newline lost: either way it is trained again, never lost), and the
    next commit is a record of its own, not `k23k233`."""
    j = tmp_path / "journal.txt"
    j.write_bytes(b"k1\n!lost\tk7\nk238\n"[:-2])  # the last write cut short: b"...k23"
    st = Journal.read(j)
    assert st.committed == {"k1"} and st.lost == {"k7"} and st.torn == b"k23"
    tail = JournalTail(j)
    assert tail.poll() == ({"k1"}, {"k7"})

    caplog.set_level(logging.INFO, logger="distill.journal")
    w = Journal(j).open(lock_wait_s=0)
    w.append_committed(["k233"])
    w.close()
    assert j.read_bytes() == b"k1\n!lost\tk7\nk233\n"
    assert Journal.read(j).committed == {"k1", "k233"}
    lines = _damage_lines(caplog)
    assert len(lines) == 1, lines
    backups = sorted(tmp_path.glob("journal.txt.damaged-*"))
    assert len(backups) == 1 and backups[0].read_bytes() == b"k1\n!lost\tk7\nk23"
    assert lines[0].startswith(f"journal {str(j)!r} has a torn last line (b'k23', no newline")
    assert str(backups[0]) in lines[0] and "not committed" in lines[0]
    # The reader that followed the file sees the rewrite and the new record.
    assert tail.poll()[0] == {"k233"} and tail.committed == {"k1", "k233"}
    # A clean journal opens without a word and without a backup.
    Journal(j).open(lock_wait_s=0).close()
    assert len(_damage_lines(caplog)) == 1 and len(list(tmp_path.glob("journal.txt.damaged-*"))) == 1


def test_bytes_that_are_not_text_are_skipped_counted_and_set_aside(tmp_path, caplog):
    """Binary bytes in the journal: no UnicodeDecodeError from any reader; a record they replaced
    (`k\\xff5` was `k5`) counts as not committed; the writer sets the lines aside in one log line."""
    j = tmp_path / "journal.txt"
    good = b"k1\nk2\n!lost\tk3\n"
    j.write_bytes(good + b"k\xff5\n\x00\x00\x00\x00\nk6\n\x89PNG\r\n\x1a\n\xff\xd8\xff")
    st = Journal.read(j)
    assert st.committed == {"k1", "k2", "k6", "\x1a"} and st.lost == {"k3"}
    assert st.damaged == [4, 5, 7] and st.torn == b"\xff\xd8\xff"
    tail = JournalTail(j)
    committed, lost = tail.poll()
    assert committed == {"k1", "k2", "k6", "\x1a"} and lost == {"k3"} and tail.state.damaged == [4, 5, 7]

    caplog.set_level(logging.INFO, logger="distill.journal")
    w = Journal(j).open(lock_wait_s=0)
    w.append_committed(["k5"])
    w.close()
    assert j.read_bytes() == good + b"k6\n\x1a\nk5\n"
    lines = _damage_lines(caplog)
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        f"journal {str(j)!r} has 3 damaged lines (not UTF-8 text: line 4, 5, 7) and a torn last line"
    )
    (backup,) = tmp_path.glob("journal.txt.damaged-*")
    assert backup.read_bytes().startswith(good + b"k\xff5\n")
    assert Journal.read(j).committed == {"k1", "k2", "k6", "\x1a", "k5"}


def test_a_write_cut_short_is_taken_back(tmp_path, monkeypatch):
    """A full disk in the middle of a commit: what was written of it is cut off again, so the next
    record does not land on half a line (and nothing half-written is read as a key)."""
    j = tmp_path / "journal.txt"
    w = Journal(j).open(lock_wait_s=0)
    w.append_committed(["k1"])
    real_write = os.write

    def half_then_full(fd, data):
        real_write(fd, bytes(data[:3]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(jmod.os, "write", half_then_full)
    with pytest.raises(OSError):
        w.append_committed(["k2-long-key", "k3"])
    monkeypatch.setattr(jmod.os, "write", real_write)
    assert j.read_bytes() == b"k1\n"
    w.append_committed(["k4"])
    w.close()
    assert j.read_bytes() == b"k1\nk4\n"


def test_a_writer_waiting_for_the_lock_gets_the_file_that_replaced_it(tmp_path):
    """distill-reconcile (or a repair) renames a new file over the journal while a teacher waits
    for the lock: the teacher must lock and append to the new file, not the unlinked old one."""
    j = tmp_path / "journal.txt"
    j.write_bytes(b"a\nb\n")
    first = Journal(j).open(lock_wait_s=0)
    second = Journal(j)
    t = threading.Thread(target=second.open, kwargs={"lock_wait_s": 20}, daemon=True)
    t.start()
    assert not wait_until(lambda: second._f is not None, 0.5)  # it waits for the lock
    first.replace_committed(["a"])
    first.close()
    t.join(20)
    assert not t.is_alive() and second._f is not None
    assert os.fstat(second._f.fileno()).st_ino == os.stat(j).st_ino
    second.append_committed(["c"])
    second.close()
    assert j.read_bytes() == b"a\nc\n"


def test_an_unreadable_journal_is_one_line_naming_it(tmp_path):
    d = tmp_path / "journal.txt"
    d.mkdir()  # not a file (root reads through permissions, so a folder stands for any OSError)
    with pytest.raises(JournalError) as e:
        Journal(d).open(lock_wait_s=0)
    assert str(e.value).startswith(f"journal {str(d)!r}: Is a directory; ") and "\n" not in str(e.value)
    with pytest.raises(JournalError, match="cannot be read: Is a directory"):
        Journal.read(d)
    with pytest.raises(JournalError, match="cannot be read: Is a directory"):
        JournalTail(d).poll()


_HOLD = """
import os, sys, time
from distill.journal import OwnerLock
lock = OwnerLock(sys.argv[1]).acquire(0)
if os.fork() == 0:  # a child that outlives its parent, as vLLM's engine core may
    time.sleep(60)
    os._exit(0)
print("held", flush=True)
time.sleep(60)
"""


def test_owner_lock_names_the_holder_and_goes_with_its_death(tmp_path):
    """A second holder is refused with one line naming the first one's pid; SIGKILL of the holder
    frees it at once, although a process it forked lives on (the fork closed its copy)."""
    j = tmp_path / "journal.txt"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(j)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(JournalBusy) as e:
            OwnerLock(j).acquire(wait_s=0.3)
        assert f"is in use by another distill-teacher (pid {holder.pid}, holding '{j}.lock')" in str(e.value)
        assert str(e.value).startswith(f"journal {str(j)!r}") and "\n" not in str(e.value)
        holder.kill()  # the parent only: its forked child keeps running
        holder.wait(10)
        assert wait_until(lambda: _acquired(j), 10), "the lock outlived its holder"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(holder.pid, signal.SIGKILL)  # the forked child too
        holder.wait(10)


def _acquired(j: Path) -> bool:
    try:
        OwnerLock(j).acquire(wait_s=0).release()
        return True
    except JournalBusy:
        return False

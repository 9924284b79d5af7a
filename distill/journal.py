"""The teacher's journal: which sample keys are done for good, and which must be generated again.

One text file, appended to, one record per line:

    <key>              committed: a student's saved checkpoint covers this key (or, for students
                       without checkpoints, an optimizer step did). A restarted teacher skips it.
    !lost<TAB><key>    lost: a student acknowledged the key, then its session ended before a
                       checkpoint covered it (the student died, or was declared gone). Its training
                       lived only in a model state that may be gone: the producer generates it again.
                       A later committed record of the same key wins.

Journals of earlier releases (bare keys only) read the same way. Keys may not contain a newline or
a tab. This module is the one owner of the file: the lock, appends, incremental reads and the
atomic rewrite (distill-reconcile) all live here, and so does `<journal>.lock`, which the
`distill-teacher` process holds from its start to its exit (`OwnerLock`).

A record counts once its newline is written. Damage is never merged into, nor taken for, a record:
  * a torn last line (bytes after the last newline: a write cut short by a crash or a full disk)
    is not a record: readers ignore it, and `Journal.open` removes it before anything is appended,
    so that the next record never lands on it (`k23` + `k233` -> `k23k233`);
  * a line that is not UTF-8 text (or holds a NUL byte) is not a record: readers skip it.
Either way that key counts as NOT committed: it is generated and delivered again, never lost
(students skip what their checkpoint holds). `Journal.open` sets such a journal's damaged lines and
torn tail aside (the original is kept as `<journal>.damaged-<time>`, the journal is rewritten
atomically with its good records in order) and says so in one log line.
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from distill.errors import JournalBusy, JournalError

LOST = "!lost\t"

log = logging.getLogger("distill.journal")


def check_key(key: str) -> None:
    if "\n" in key or "\t" in key or key.startswith("!"):
        raise ValueError(f"sample key {key!r} may not contain a newline or a tab, nor start with '!'")


@dataclass
class JournalState:
    committed: set[str] = field(default_factory=set)
    lost: set[str] = field(default_factory=set)  # lost and not committed since
    damaged: list[int] = field(default_factory=list)  # 1-based numbers of lines that are no records
    torn: bytes = b""  # bytes after the last newline (Journal.read; JournalTail waits for the rest)

    def add_line(self, line: str) -> tuple[str | None, str | None]:
        """Apply one record; returns (committed key, lost key) of that line (one is None)."""
        if not line:
            return None, None
        if line.startswith(LOST):
            key = line[len(LOST) :]
            if key not in self.committed:
                self.lost.add(key)
                return None, key
            return None, None
        self.committed.add(line)
        self.lost.discard(line)
        return line, None

    def add_raw(self, raw: bytes, lineno: int) -> tuple[str | None, str | None]:
        """Apply one complete line as read from the file; a damaged one is counted, not applied."""
        line = decode_line(raw)
        if line is None:
            self.damaged.append(lineno)
            return None, None
        return self.add_line(line)


def decode_line(raw: bytes) -> str | None:
    """A journal line's text, or None when it is damaged (not UTF-8 text, or a NUL byte in it: the
    zero-filled blocks a filesystem may leave after a crash)."""
    if b"\0" in raw:
        return None
    try:
        return raw.removesuffix(b"\r").decode("utf-8")  # \r: a journal edited with CRLF line ends
    except UnicodeDecodeError:
        return None


def scan(data: bytes) -> tuple[JournalState, list[bytes]]:
    """The state recorded in a journal's bytes, and its good lines (raw, in order)."""
    st = JournalState()
    *lines, st.torn = data.split(b"\n")
    good = []
    for n, raw in enumerate(lines, 1):
        line = decode_line(raw)
        if line is None:
            st.damaged.append(n)
        else:
            good.append(raw)
            st.add_line(line)
    return st, good


def _damage_line(path: Path, st: JournalState) -> str:
    what = []
    if st.damaged:
        shown = ", ".join(map(str, st.damaged[:5])) + (", ..." if len(st.damaged) > 5 else "")
        n = len(st.damaged)
        what.append(f"{n} damaged line{'s' if n > 1 else ''} (not UTF-8 text: line {shown})")
    if st.torn:
        torn = st.torn[:40] + (b"..." if len(st.torn) > 40 else b"")
        what.append(f"a torn last line ({torn!r}, no newline: a write cut short)")
    return f"journal {str(path)!r} has " + " and ".join(what)


class Journal:
    """The writer: an exclusive lock for as long as it is open, then appends (flushed per call)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._f = None

    def open(self, lock_wait_s: float = 10.0) -> Journal:
        """Open for appending and take the exclusive lock, waiting up to `lock_wait_s`; then set
        aside a torn last line and damaged lines (one log line), so appends start on a new line.

        Raises:
            JournalBusy: another process (a teacher, distill-reconcile) holds it.
            JournalError: the journal cannot be opened or repaired (one line naming it).
        """
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = _lock_current(self.path, lock_wait_s)
            self._repair()
        except JournalBusy:
            raise
        except OSError as e:
            self.close()
            raise JournalError(
                f"journal {str(self.path)!r}: {e.strerror or e}; fix its folder's permissions or space, "
                "or move the file aside (its keys are then generated again)"
            ) from None
        return self

    def _repair(self) -> None:
        """(Held lock) A torn tail or damaged lines: keep the original as `<journal>.damaged-<time>`,
        rewrite the journal with its good lines (atomic; the lock moves to the new file first)."""
        with open(self.path, "rb") as f:
            data = f.read()
        st, good = scan(data)
        if not st.damaged and not st.torn:
            return
        backup = _backup_path(self.path)
        shutil.copyfile(self.path, backup)
        self._rewrite(b"".join(raw + b"\n" for raw in good))
        log.warning(
            "%s: set aside (the original is %s); those records count as not committed, so their keys "
            "are generated and delivered again",
            _damage_line(self.path, st),
            backup,
        )

    def _rewrite(self, data: bytes) -> None:
        """(Held lock) Replace the file by `data` atomically: temp file, locked, then renamed over the
        journal, so a process waiting for the lock finds the new file locked too (`_lock_current`)."""
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC
        out = os.fdopen(os.open(tmp, flags, 0o644), "ab", buffering=0)
        try:
            fcntl.flock(out.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody else has this file yet
            _write_all(out.fileno(), data)
            os.fsync(out.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            out.close()
            raise
        old, self._f = self._f, out
        if old is not None:
            old.close()

    def append_committed(self, keys: Iterable[str]) -> None:
        self._write("".join(k + "\n" for k in keys))

    def append_lost(self, keys: Iterable[str]) -> None:
        self._write("".join(LOST + k + "\n" for k in keys))

    def _write(self, text: str) -> None:
        """Append whole records; a write that fails half-way is cut back off (never a torn line
        for the next record to land on), then raised."""
        if not text or self._f is None:
            return
        data = text.encode("utf-8")
        fd = self._f.fileno()
        start = os.fstat(fd).st_size
        try:
            _write_all(fd, data)
        except OSError:
            try:
                os.ftruncate(fd, start)
            except OSError:
                pass  # a torn tail stays: the next open sets it aside
            raise

    def close(self) -> None:
        if self._f is not None:
            self._f.close()  # also releases the lock
            self._f = None

    @staticmethod
    def read(path: str | os.PathLike) -> JournalState:
        """Everything recorded so far (an absent file is an empty journal); a torn last line and
        damaged lines are no records (`JournalState.torn`, `.damaged` say what was there).

        Raises:
            JournalError: the file cannot be read (one line naming it).
        """
        p = Path(path)
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            return JournalState()
        except OSError as e:
            raise JournalError(f"journal {str(p)!r} cannot be read: {e.strerror or e}") from None
        return scan(data)[0]

    def replace_committed(self, committed: Iterable[str]) -> None:
        """(Held lock) Replace the file by these committed keys, atomically (temp file + rename)."""
        if self._f is None:
            raise RuntimeError("open() the journal first")
        self._rewrite("".join(k + "\n" for k in committed).encode("utf-8"))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _backup_path(path: Path) -> Path:
    stem = f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"
    p, n = path.with_name(stem), 1
    while p.exists():
        p, n = path.with_name(f"{stem}-{n}"), n + 1
    return p


def _lock_current(path: Path, wait_s: float):
    """The file at `path`, opened for appending (unbuffered, binary) with its exclusive lock, taken
    within `wait_s`. A file renamed over while we waited (a repair, distill-reconcile) is opened
    again: a lock on the old file would let two writers in."""
    deadline = time.monotonic() + wait_s
    while True:
        f = open(path, "ab", buffering=0)
        try:
            while True:
                try:
                    fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise JournalBusy(
                            f"journal {str(path)!r} is in use by another process (a teacher running "
                            "with the same journal, or distill-reconcile); give each teacher its own"
                        ) from None
                    time.sleep(0.1)  # a restarted teacher may find the previous engine still exiting
            try:
                same = os.stat(path).st_ino == os.fstat(f.fileno()).st_ino
            except FileNotFoundError:
                same = False
        except BaseException:
            f.close()
            raise
        if same:
            return f
        f.close()


def lock_holder(path: str | os.PathLike) -> int | None:
    """The pid of the process holding the journal's lock (`flock`), from the kernel's table
    (/proc/locks, Linux); None when nobody holds it or it cannot be told."""
    try:
        st = os.stat(path)
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    want = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    for line in lines:
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF"; a waiter's line has "->" after "1:"
        if len(parts) < 6 or parts[1] != "FLOCK":
            continue
        try:
            major, minor, ino = parts[5].split(":")
            if (int(major, 16), int(minor, 16), int(ino)) == want:
                return int(parts[4])
        except ValueError:
            continue
    return None


class OwnerLock:
    """`<journal>.lock`: held by one `distill-teacher` process from its start to its exit, across
    every phase (its Publishers take the journal's own lock, in vLLM's worker or in this process,
    only while they append). A second teacher on the same journal is refused with the holder's pid.

    The lock is the kernel's (flock): it goes with the holder's death, whatever kills it. Processes
    forked from the holder (vLLM's engine core) close their copy, so one outliving a killed teacher
    does not keep the next one out; the file stays (removing it would let two teachers lock
    different files)."""

    _held: list[OwnerLock] = []  # closed in forked children (os.register_at_fork below)

    def __init__(self, journal: str | os.PathLike):
        j = Path(journal)
        self.journal = j
        self.path = j.with_name(j.name + ".lock")
        self._fd: int | None = None

    def acquire(self, wait_s: float = 10.0) -> OwnerLock:
        """Take the lock within `wait_s` and write our pid into the file.

        Raises:
            JournalBusy: another process holds it (the message names its pid).
            JournalError: the lock file cannot be made.
        """
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise JournalError(f"cannot make the lock file {str(self.path)!r}: {e.strerror or e}") from None
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = self.holder()
                    os.close(fd)
                    who = f"pid {holder}" if holder else "another process"
                    raise JournalBusy(
                        f"journal {str(self.journal)!r} is in use by another distill-teacher "
                        f"({who}, holding {str(self.path)!r}); wait for it to end or stop it, or give "
                        "each teacher its own journal"
                    ) from None
                time.sleep(0.1)  # a teacher stopped a moment ago may still be exiting
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        OwnerLock._held.append(self)
        return self

    def holder(self) -> int | None:
        """The pid written by the process holding the lock (None: unknown)."""
        try:
            return int(self.path.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self in OwnerLock._held:
            OwnerLock._held.remove(self)

    def _forget_in_child(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)  # the parent's descriptor keeps the lock
            except OSError:
                pass
            self._fd = None

    def __enter__(self) -> OwnerLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _close_owner_locks_in_child() -> None:
    for lock in OwnerLock._held:
        lock._forget_in_child()
    OwnerLock._held.clear()


os.register_at_fork(after_in_child=_close_owner_locks_in_child)


class JournalTail:
    """Reads a journal that another process appends to, incrementally (complete lines only)."""

    def __init__(self, path: str | os.PathLike | None):
        self.path = Path(path) if path else None
        self.state = JournalState()
        self._offset = 0
        self._partial = b""
        self._ino: int | None = None
        self._lineno = 0

    @property
    def committed(self) -> set[str]:
        return self.state.committed

    @property
    def lost(self) -> set[str]:
        return self.state.lost

    def poll(self) -> tuple[set[str], set[str]]:
        """Records appended since the last poll: (newly committed keys, newly lost keys). A file
        rewritten meanwhile (distill-reconcile, a repair) is read again from the start; what it
        still holds is not news."""
        new_c: set[str] = set()
        new_l: set[str] = set()
        if self.path is None or not self.path.exists():
            return new_c, new_l
        before = None
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_size < self._offset or st.st_ino != self._ino:
                    before = self.state
                    self.state, self._offset, self._partial, self._lineno = JournalState(), 0, b"", 0
                    self._ino = st.st_ino
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return new_c, new_l
        except OSError as e:
            raise JournalError(f"journal {str(self.path)!r} cannot be read: {e.strerror or e}") from None
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for raw in lines:
            self._lineno += 1
            c, lost = self.state.add_raw(raw, self._lineno)
            if c is not None:
                new_c.add(c)
                new_l.discard(c)
            if lost is not None:
                new_l.add(lost)
        if before is not None:
            new_c -= before.committed
            new_l -= before.lost
        return new_c, new_l


def stored_run_id(journal: Path | None) -> str | None:
    """The run id kept beside a journal (`<journal>.run`), made at the first start; None without a
    journal (no run identity: a restart could not keep it anyway)."""
    if journal is None:
        return None
    p = journal.with_name(journal.name + ".run")
    if p.exists():
        rid = p.read_text().strip()
        if rid:
            return rid
    rid = f"run-{secrets.token_hex(6)}"
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(rid + "\n")
    os.replace(tmp, p)
    return rid

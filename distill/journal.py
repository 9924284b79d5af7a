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
atomic rewrite (distill-reconcile) all live here.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

LOST = "!lost\t"


class JournalBusy(RuntimeError):
    """Another process holds the journal's lock."""


def check_key(key: str) -> None:
    if "\n" in key or "\t" in key or key.startswith("!"):
        raise ValueError(f"sample key {key!r} may not contain a newline or a tab, nor start with '!'")


@dataclass
class JournalState:
    committed: set[str] = field(default_factory=set)
    lost: set[str] = field(default_factory=set)  # lost and not committed since

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


class Journal:
    """The writer: an exclusive lock for as long as it is open, then appends (flushed per call)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._f = None

    def open(self, lock_wait_s: float = 10.0) -> Journal:
        """Open for appending and take the exclusive lock, waiting up to `lock_wait_s`.

        Raises:
            JournalBusy: another process (a teacher, distill-reconcile) holds it.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a", buffering=1)
        deadline = time.monotonic() + lock_wait_s
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() >= deadline:
                    f.close()
                    raise JournalBusy(
                        f"journal {str(self.path)!r} is in use by another process (a teacher running "
                        "with the same journal, or distill-reconcile); give each teacher its own"
                    ) from None
                time.sleep(0.1)  # a restarted teacher may find the previous engine still exiting
        self._f = f
        return self

    def append_committed(self, keys: Iterable[str]) -> None:
        self._write("".join(k + "\n" for k in keys))

    def append_lost(self, keys: Iterable[str]) -> None:
        self._write("".join(LOST + k + "\n" for k in keys))

    def _write(self, text: str) -> None:
        if text and self._f is not None:
            self._f.write(text)
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()  # also releases the lock
            self._f = None

    @staticmethod
    def read(path: str | os.PathLike) -> JournalState:
        """Everything recorded so far (an absent file is an empty journal)."""
        st = JournalState()
        p = Path(path)
        if p.exists():
            for line in p.read_text().splitlines():
                st.add_line(line)
        return st

    def replace_committed(self, committed: Iterable[str]) -> None:
        """(Held lock) Replace the file by these committed keys, atomically (temp file + rename)."""
        if self._f is None:
            raise RuntimeError("open() the journal first")
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with open(tmp, "w") as out:
            out.write("".join(k + "\n" for k in committed))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.path)  # the lock held on the old file keeps teachers out meanwhile


class JournalTail:
    """Reads a journal that another process appends to, incrementally (complete lines only)."""

    def __init__(self, path: str | os.PathLike | None):
        self.path = Path(path) if path else None
        self.state = JournalState()
        self._offset = 0
        self._partial = b""

    @property
    def committed(self) -> set[str]:
        return self.state.committed

    @property
    def lost(self) -> set[str]:
        return self.state.lost

    def poll(self) -> tuple[set[str], set[str]]:
        """Records appended since the last poll: (newly committed keys, newly lost keys)."""
        new_c: set[str] = set()
        new_l: set[str] = set()
        if self.path is None or not self.path.exists():
            return new_c, new_l
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < self._offset:  # rewritten (distill-reconcile): read it again
                self.state, self._offset, self._partial = JournalState(), 0, b""
            f.seek(self._offset)
            data = f.read()
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for raw in lines:
            c, lost = self.state.add_line(raw.decode())
            if c is not None:
                new_c.add(c)
                new_l.discard(c)
            if lost is not None:
                new_l.add(lost)
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

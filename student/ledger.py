"""The ledger: which sample keys were trained at which optimizer step, and the per-step metrics.

Saved with every checkpoint (`ledger.json`, student/checkpoint.py) beside the model and optimizer:
after a resume the student continues at the checkpoint's step and passes `keys()` as `skip_keys`
to the Subscriber (or the spool reader), so a sample trained before the checkpoint is never
trained again, even when the teacher redelivers it.

Every rank keeps the same global ledger: `merge` is called with the entries of all ranks (gathered)
before each checkpoint and at the end. Entries are (key, rank, step).

Memory: a run of days holds millions of entries on every rank, so merged entries are kept in
columns (the keys' UTF-8 bytes in one buffer, ranks and steps in typed arrays): about the key's
length + 14 bytes an entry, not ~180 for a list of three objects. `HashSet` is the same idea for
the 64-bit key hashes the training loop checks every sample against.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np


class Ledger:
    def __init__(self) -> None:
        self.step = 0  # optimizer steps done
        self.history: list[dict[str, Any]] = []  # one metrics record per optimizer step
        self.local: list[list] = []  # this rank's entries not yet merged (until the next checkpoint)
        self._blob = bytearray()  # merged keys, UTF-8, back to back
        self._ends = array("Q")  # end offset of each merged key in _blob
        self._ranks = array("H")
        self._steps = array("L")

    def __len__(self) -> int:
        """Merged entries (every rank's, as of the last merge)."""
        return len(self._ends)

    def record(self, keys: list[str], rank: int, step: int) -> None:
        self.local.extend([k, rank, step] for k in keys)

    def merge(self, gathered: Iterable) -> None:
        """Add the gathered (all-rank) unmerged entries; clears this rank's buffer."""
        for key, rank, step in gathered:
            self._blob += str(key).encode()
            self._ends.append(len(self._blob))
            self._ranks.append(int(rank))
            self._steps.append(int(step))
        self.local = []

    def entries(self) -> Iterator[tuple[str, int, int]]:
        """(key, rank, step) of every merged entry, in merge order."""
        start = 0
        for end, rank, step in zip(self._ends, self._ranks, self._steps, strict=True):
            yield self._blob[start:end].decode(), rank, step
            start = end

    @property
    def trained(self) -> list[list]:
        """Every merged entry as [key, rank, step] (a new list: for outputs, not for the loop)."""
        return [[k, r, s] for k, r, s in self.entries()]

    def keys(self) -> set[str]:
        return {k for k, _, _ in self.entries()} | {e[0] for e in self.local}

    def state_dict(self) -> dict[str, Any]:
        """What `distill.checkpoint_layout.write_ledger` saves ("trained": an iterator of the entries)."""
        return {"step": self.step, "trained": self.entries(), "history": self.history}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.__init__()
        self.step = int(state["step"])
        self.history = list(state["history"])
        self.merge(state["trained"])


class HashSet:
    """A set of signed 64-bit ints in ~8 bytes each: a sorted array plus a small set of recent
    additions, folded into the array once it holds `fold` of them. `in`, `add`, `update`, `|=`,
    `len`."""

    def __init__(self, items: Iterable[int] = (), fold: int = 1 << 16):
        self._sorted = np.unique(np.fromiter(items, dtype=np.int64))
        self._recent: set[int] = set()
        self._fold = fold

    def __contains__(self, h: int) -> bool:
        if h in self._recent:
            return True
        i = int(np.searchsorted(self._sorted, h))
        return i < len(self._sorted) and int(self._sorted[i]) == h

    def __len__(self) -> int:
        return len(self._sorted) + len(self._recent)

    def add(self, h: int) -> None:
        if h not in self:
            self._recent.add(h)
            if len(self._recent) >= self._fold:
                self._sorted = np.union1d(self._sorted, np.fromiter(self._recent, dtype=np.int64))
                self._recent.clear()

    def update(self, items: Iterable[int]) -> None:
        for h in items:
            self.add(h)

    def __ior__(self, items: Iterable[int]) -> HashSet:
        self.update(items)
        return self

"""The ledger: which sample keys were trained at which optimizer step, and the per-step metrics.

Registered with `accelerator.register_for_checkpointing`, so `save_state` / `load_state` carry it
with the model and optimizer: after a resume the student continues at the checkpoint's step and
passes `keys()` as `skip_keys` to the Subscriber (or the spool reader), so a sample trained before
the checkpoint is never trained again, even when the teacher redelivers it.

Every rank keeps the same global ledger: `merge` is called with the entries of all ranks (gathered)
before each checkpoint and at the end. Entries are (key, rank, step).
"""

from __future__ import annotations

from typing import Any


class Ledger:
    def __init__(self) -> None:
        self.step = 0  # optimizer steps done
        self.trained: list[list] = []  # [key, rank, step] of every trained sample, all ranks
        self.history: list[dict[str, Any]] = []  # one metrics record per optimizer step
        self.local: list[list] = []  # this rank's entries not yet merged into `trained`

    def record(self, keys: list[str], rank: int, step: int) -> None:
        self.local.extend([k, rank, step] for k in keys)

    def merge(self, gathered: list[list]) -> None:
        """Add the gathered (all-rank) unmerged entries; clears this rank's buffer."""
        self.trained.extend(gathered)
        self.local = []

    def keys(self) -> set[str]:
        return {e[0] for e in self.trained} | {e[0] for e in self.local}

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "trained": self.trained, "history": self.history}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.trained = [list(e) for e in state["trained"]]
        self.history = list(state["history"])
        self.local = []

"""The layout of a student checkpoints folder: the one place both the student and distill-reconcile
read it from (this module imports neither torch nor Accelerate).

    <checkpoint_dir>/step_0000012/   one checkpoint: Accelerate's save_state files (model, optimizer,
                                     RNG states, scheduler) and
        ledger.json                  the ledger: {"step", "trained": [[key, rank, step], ...], "history"}
        .complete                    written once every rank's files are in
    <checkpoint_dir>/latest          the name of the newest complete step folder (replaced atomically)
    <checkpoint_dir>/.step_0000012.partial/   a checkpoint being written: renamed to step_0000012 once
                                     every rank's files and the ledger are in (never a `step_*` folder
                                     before that); removed when a write fails, and by the next save
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

LATEST = "latest"
COMPLETE = ".complete"
LEDGER = "ledger.json"


def step_folder(ckpt_dir: str | os.PathLike, step: int) -> Path:
    return Path(ckpt_dir) / f"step_{step:07d}"


def step_of(folder: str | os.PathLike) -> int | None:
    """The optimizer step of a `step_*` folder name, None for any other name."""
    m = re.fullmatch(r"step_(\d+)", Path(folder).name)
    return int(m.group(1)) if m else None


def latest(ckpt_dir: str | os.PathLike) -> Path | None:
    """The step folder `<ckpt_dir>/latest` names, None when there is no `latest`."""
    pointer = Path(ckpt_dir) / LATEST
    return Path(ckpt_dir) / pointer.read_text().strip() if pointer.is_file() else None


def point_latest(ckpt_dir: str | os.PathLike, folder: Path) -> None:
    """Make `latest` name `folder` (atomic: a reader sees the old name or the new one)."""
    tmp = Path(ckpt_dir) / f".{LATEST}.tmp"
    tmp.write_text(folder.name)
    os.replace(tmp, Path(ckpt_dir) / LATEST)


def write_ledger(folder: Path, state: dict) -> None:
    """`state` as JSON in `folder`; its "trained" entries (any iterable of (key, rank, step)) are
    written a chunk at a time, never all as Python lists at once."""
    tmp = folder / f".{LEDGER}.tmp"
    head = {k: v for k, v in state.items() if k != "trained"}
    with open(tmp, "w") as f:
        f.write(json.dumps(head)[:-1] + (", " if head else "") + '"trained": [')
        chunk: list[list] = []
        sep = ""
        for e in state.get("trained", ()):
            chunk.append(list(e))
            if len(chunk) == 4096:
                f.write(sep + json.dumps(chunk)[1:-1])
                chunk, sep = [], ", "
        if chunk:
            f.write(sep + json.dumps(chunk)[1:-1])
        f.write("]}")
    os.replace(tmp, folder / LEDGER)


def read_ledger(folder: str | os.PathLike) -> dict:
    """The ledger saved in a step folder (FileNotFoundError when it has none)."""
    return json.loads((Path(folder) / LEDGER).read_text())

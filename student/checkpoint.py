"""Student checkpoints: where they are kept, which one a run resumes from, saving one.

A checkpoint is a `step_*` folder (distill/checkpoint_layout.py: the layout, also read by
distill-reconcile): Accelerate's `save_state` (model, optimizer, RNG states, the scheduler) plus the
ledger of trained keys in `ledger.json`, marked `.complete` once every rank's files are in, and
`latest` pointing at it.

Storage: `probe_storage` finds whether the nodes share checkpoint_dir (a probe file per node, seen by
all or only by its own); without shared storage every node saves the whole checkpoint (Accelerate's
save_on_each_node) and keeps its own `latest`. `local_checkpoints` lists the complete checkpoints
this rank can load; ranks resume from the newest step that every rank has, or refuse with one line.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import uuid
from pathlib import Path

from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import broadcast_object_list, gather_object

from distill.checkpoint_layout import (
    COMPLETE,
    LEDGER,
    latest,
    point_latest,
    read_ledger,
    step_folder,
    step_of,
    write_ledger,
)
from distill.spool import disk_room
from student.config import StudentConfig
from student.errors import CheckpointError, StudentError
from student.ledger import Ledger

logger = get_logger(__name__)


def flatten(gathered: list) -> list:
    """gather_object([entries]) returns one entry list per rank; concatenate them."""
    return [e for per_rank in gathered for e in per_rank]


def probe_storage(accelerator: Accelerator, ckpt_dir: Path) -> bool:
    """Whether every node keeps checkpoints on storage of its own (True) or all share one (False).

    Each node's local main process writes a probe file into checkpoint_dir; a node that sees only
    its own probe has private storage. Mixed answers (some nodes share, some do not) are an error."""
    world = accelerator.num_processes
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nodes = max(1, world // max(1, local_world))
    if nodes <= 1:
        return False
    token = broadcast_object_list([uuid.uuid4().hex if accelerator.is_main_process else None])[0]
    probe = ckpt_dir / f".probe-{token}-{accelerator.process_index}"
    if accelerator.is_local_main_process:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        probe.write_text(socket.gethostname())
    accelerator.wait_for_everyone()
    seen = len(list(ckpt_dir.glob(f".probe-{token}-*"))) if accelerator.is_local_main_process else -1
    counts = [c for c in gather_object([seen]) if c >= 0]
    accelerator.wait_for_everyone()
    if accelerator.is_local_main_process:
        probe.unlink(missing_ok=True)
    if all(c == nodes for c in counts):
        return False
    if all(c == 1 for c in counts):
        return True
    raise StudentError(
        f"student.checkpoint_dir {ckpt_dir} is shared by some nodes but not by others (each node's "
        f"local main process sees {counts} of {nodes} probe files): use shared storage on every node or on none"
    )


def needed_files(path: Path, rank: int) -> list[str]:
    """Files rank `rank` loads from a checkpoint folder that are missing there."""
    missing = []
    if not ((path / "model.safetensors").is_file() or (path / "pytorch_model.bin").is_file()):
        missing.append("model.safetensors")
    for name in ("optimizer.bin", "custom_checkpoint_0.pkl", f"random_states_{rank}.pkl", LEDGER):
        if not (path / name).is_file():
            missing.append(name)
    return missing


def local_checkpoints(ckpt_dir: Path, rank: int) -> dict[int, str]:
    """{step: folder name} of complete checkpoints this rank can load from its own storage: a
    folder marked complete (or the one `latest` names) holding every file the rank needs."""
    out: dict[int, str] = {}
    if not ckpt_dir.is_dir():
        return out
    named = latest(ckpt_dir)
    for p in ckpt_dir.glob("step_*"):
        step = step_of(p)
        if step is None or not p.is_dir():
            continue
        if ((p / COMPLETE).is_file() or (named is not None and p.name == named.name)) and not needed_files(
            p, rank
        ):
            out[step] = p.name
    return out


def choose_resume(per_rank: list[dict[int, str]], where: list[str]) -> tuple[int | None, str | None]:
    """(step, None) to resume from (None: fresh start, no rank has a checkpoint), or (None, why)
    when some ranks have checkpoints but no step is complete on every rank."""
    if not any(per_rank):
        return None, None
    common = set.intersection(*(set(c) for c in per_rank))
    if common:
        return max(common), None
    detail = "; ".join(
        f"rank {r} on {w}: {', '.join(f'step_{s:07d}' for s in sorted(c)[-3:]) or 'none'}"
        for r, (c, w) in enumerate(zip(per_rank, where, strict=True))
    )
    return None, (
        "cannot resume: no checkpoint is complete on every rank (" + detail + "). Each node must "
        "see the checkpoints its ranks saved: use the same student.checkpoint_dir on every node (a "
        "shared filesystem, or each node's own disk as written by this version), or start afresh "
        "without student.resume_from"
    )


def resolve_resume(cfg: StudentConfig, rank: int, world: int, where: list[str]) -> Path | None:
    """The checkpoint folder this rank loads (collective when world > 1; the same step on every rank).

    "latest": the newest step that is complete on every rank's own storage (shared or per node);
    a fresh start when no rank has one; StudentError (one line) when some ranks have checkpoints
    but no step is complete on all of them. A folder: every rank must find the files it needs."""
    if cfg.resume_from is None:
        return None
    ckpt_dir = Path(cfg.ckpt_dir)
    if cfg.resume_from == "latest":
        mine = local_checkpoints(ckpt_dir, rank)
        per_rank = gather_object([mine]) if world > 1 else [mine]
        step, why = choose_resume(per_rank, where)
        if why:
            raise StudentError(why)
        return None if step is None else ckpt_dir / per_rank[rank][step]
    p = Path(cfg.resume_from)
    missing = needed_files(p, rank) if p.is_dir() else ["the folder"]
    per_rank = gather_object([missing]) if world > 1 else [missing]
    bad = [f"rank {r} on {where[r]} lacks {', '.join(m)}" for r, m in enumerate(per_rank) if m]
    if bad:
        raise StudentError(
            f"cannot resume from {cfg.resume_from!r}: {'; '.join(bad)} (without a shared filesystem "
            "each node must hold the whole checkpoint: resume_from: latest finds it)"
        )
    return p


def load_checkpoint(accelerator: Accelerator, ledger: Ledger, folder: Path) -> None:
    """Model, optimizer, RNG states and scheduler (Accelerate's load_state), then the ledger."""
    accelerator.load_state(str(folder))
    ledger.load_state_dict(read_ledger(folder))


def save_checkpoint(
    accelerator: Accelerator, ledger: Ledger, ckpt_dir: Path, step: int, keep: int, per_node: bool = False
) -> Path:
    """save_state (model, optimizer, RNG, scheduler) and the ledger into a hidden temporary folder,
    mark it complete and rename it to its `step_*` name once every rank's files are in, then point
    `latest` at it atomically. per_node: no shared storage; every node's local main process saves
    the model, optimizer and ledger (save_on_each_node), renames, points and prunes on its node.

    A write that fails (a full disk) on any rank: the temporary folder is removed on every node
    and every rank raises the same CheckpointError (one line naming the folder and the disk), so
    no half checkpoint is ever taken for a good one and no rank blames another for leaving."""
    ledger.merge(flatten(gather_object([ledger.local])))  # every rank now holds every rank's keys
    path = step_folder(ckpt_dir, step)
    tmp = ckpt_dir / f".{path.name}.partial"
    saver = accelerator.is_local_main_process if per_node else accelerator.is_main_process
    if saver:
        for old in ckpt_dir.glob(".step_*.partial"):  # left by a run that died while saving
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    err = attempt(lambda: accelerator.save_state(str(tmp)), accelerator)
    errs = gather_object([err]) if accelerator.num_processes > 1 else [err]
    if not any(errs) and saver:
        err = attempt(lambda: _complete(ckpt_dir, tmp, path, ledger), accelerator)
    errs = gather_object([err]) if accelerator.num_processes > 1 else [err]
    if any(errs):
        if saver:
            shutil.rmtree(tmp, ignore_errors=True)
        why = [e for e in errs if e][0]
        raise CheckpointError(_save_failed(ckpt_dir, path, why), f"checkpoint_{full_or_failed(why)}")
    if saver:
        logger.info("checkpoint %s (%d samples in the ledger)", path, len(ledger))
        if keep:  # only after `latest` points at the new one
            for old in sorted(ckpt_dir.glob("step_*"))[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return path


def full_or_failed(why: str) -> str:
    """ "disk_full" when `why` (an `attempt` line) says the disk was full, else "failed"."""
    full = any(w in why for w in ("No space left", "unexpected pos", "os error 28", "Disk quota"))
    return "disk_full" if full else "failed"


def attempt(fn, accelerator: Accelerator) -> str:
    """Run `fn`; '' when it worked, else why (rank, host, the error) in one line. Any failure is
    caught so that every rank reaches the gather that follows (a disk error raised on one rank
    would otherwise leave the others waiting in a collective and blaming it as lost)."""
    try:
        fn()
        return ""
    except Exception as e:  # torch / safetensors wrap the OS error of a failed write
        text = (getattr(e, "strerror", None) or str(e) or type(e).__name__).splitlines()[0]
        if not _disk_full(e):
            logger.error("checkpoint save failed", exc_info=True, main_process_only=False)
        return f"rank {accelerator.process_index} on {socket.gethostname()}: {text}"


def _disk_full(e: BaseException) -> bool:
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(e)
    return "No space left" in text or "unexpected pos" in text or "os error 28" in text


def _complete(ckpt_dir: Path, tmp: Path, path: Path, ledger: Ledger) -> None:
    """(The saving process, every rank's files in) the ledger, `.complete`, the rename, `latest`."""
    write_ledger(tmp, ledger.state_dict())
    (tmp / COMPLETE).write_text("")
    if path.exists():  # an older run's folder of the same step (not the one it resumed from)
        shutil.rmtree(path)
    os.replace(tmp, path)
    point_latest(ckpt_dir, path)


def room(folder: Path) -> str:
    """' (F of T MB free)' of the filesystem holding `folder`, or ''."""
    du = disk_room(folder)
    return f" ({du[2]})" if du else ""


def _save_failed(ckpt_dir: Path, path: Path, why: str) -> str:
    kept = latest(ckpt_dir)
    newest = f"the newest complete one is {kept}" if kept is not None else "there is no complete one yet"
    return (
        f"cannot write checkpoint {path} (student.checkpoint_dir {ckpt_dir}{room(ckpt_dir)}): {why}; nothing of "
        f"it was kept, {newest}. Free space there or set student.checkpoint_dir to a larger disk, "
        f"then restart with --set student.resume_from=latest (the teacher sends what no checkpoint "
        f"covers again)"
    )

"""distill-reconcile: make the teacher send again what a student checkpoint lacks.

Since protocol version 2 a teacher journals a key only once a student checkpoint covers it (students
with `student.checkpoint_every` send COMMIT after each checkpoint; without checkpoints an ack is the
commit), and the keys of a student session that ended uncommitted are generated again by the
running teacher: after a crash nothing needs this tool. It remains for two cases: resuming students
from a checkpoint OLDER than the one that committed (`student.resume_from: <step folder>`), and
journals written by earlier releases, which recorded keys at the ack.

This tool removes those keys from the teacher's journal. The next `distill-teacher` run (which
skips the keys in its journal and in its spool folder) generates them again, and the students,
resumed from that checkpoint (`student.resume_from: latest`), train each of them once.

    distill-reconcile --journal runs/journal.txt --checkpoint runs/student/checkpoints
    distill-reconcile ... --dry-run        # only report

Order: stop the teacher (the journal is locked while a teacher writes it), reconcile, start the
teacher, start the students. `--checkpoint` takes the checkpoints folder (its `latest` is used),
`latest` itself, or one `step_*` folder: use the one the students will resume from. One journal per
student job: keys acknowledged by students that are not part of this checkpoint's job would be
sent again too. The original journal is kept next to it as `<journal>.bak-<time>`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

from distill.checkpoint_layout import LATEST, LEDGER, latest, read_ledger
from distill.errors import JournalBusy, ReconcileError
from distill.journal import Journal


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A `step_*` folder from a checkpoints folder (its `latest`), `latest` itself or a step folder."""
    p = Path(path)
    if p.is_dir() and latest(p) is not None:
        p = latest(p)
    elif p.is_file() and p.name == LATEST:
        p = latest(p.parent)
    if not p.is_dir():
        raise ReconcileError(
            f"checkpoint {str(path)!r} is not a folder (nor a checkpoints folder with 'latest')"
        )
    if not (p / LEDGER).is_file():
        raise ReconcileError(f"{str(p)!r} is not a student checkpoint: it has no {LEDGER}")
    return p


def checkpoint_ledger(ckpt: Path) -> tuple[int, set[str]]:
    """(optimizer step, trained keys) of the ledger saved in a student checkpoint."""
    try:
        state = read_ledger(ckpt)
        return int(state["step"]), {str(e[0]) for e in state["trained"]}
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise ReconcileError(f"unreadable ledger {str(ckpt / LEDGER)!r}: {e}") from None


def reconcile(journal: str | os.PathLike, checkpoint: str | os.PathLike, *, dry_run: bool = False) -> dict:
    """Drop from `journal` every key that `checkpoint`'s ledger lacks. Returns what it found/did."""
    jpath = Path(journal)
    if not jpath.is_file():
        raise ReconcileError(f"journal {str(jpath)!r} does not exist")
    ckpt = resolve_checkpoint(checkpoint)
    step, trained = checkpoint_ledger(ckpt)
    j = Journal(jpath)
    try:
        j.open(lock_wait_s=0.0)
    except JournalBusy:
        raise ReconcileError(
            f"journal {str(jpath)!r} is in use (a teacher is running with it): stop it first"
        ) from None
    try:
        keys = Journal.read(jpath).committed
        keep = sorted(keys & trained)
        dropped = sorted(keys - trained)
        result = {
            "journal": str(jpath),
            "checkpoint": str(ckpt),
            "step": step,
            "journal_keys": len(keys),
            "checkpoint_keys": len(trained),
            "dropped": len(dropped),
            "dropped_keys": dropped,
            "backup": None,
        }
        if dropped and not dry_run:
            backup = jpath.with_name(f"{jpath.name}.bak-{time.strftime('%Y%m%d-%H%M%S')}")
            shutil.copy2(jpath, backup)
            j.replace_committed(keep)  # atomic; lost records go too (those keys are not committed)
            result["backup"] = str(backup)
    finally:
        j.close()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="distill-reconcile",
        description="Remove from a teacher's journal the keys a student checkpoint did not train, "
        "so the next distill-teacher run sends them again.",
    )
    ap.add_argument("--journal", required=True, help="the teacher's journal (teacher.journal)")
    ap.add_argument(
        "--checkpoint",
        required=True,
        help="the students' checkpoints folder (uses its 'latest'), 'latest', or a step_* folder",
    )
    ap.add_argument("--dry-run", action="store_true", help="report only; leave the journal as it is")
    args = ap.parse_args(argv)
    try:
        r = reconcile(args.journal, args.checkpoint, dry_run=args.dry_run)
    except ReconcileError as e:
        print(f"distill-reconcile: {e}", file=sys.stderr)
        return 2
    print(
        f"distill-reconcile: journal {r['journal_keys']} keys; checkpoint {r['checkpoint']} (step {r['step']}) "
        f"trained {r['checkpoint_keys']}; {r['dropped']} acknowledged after it"
    )
    if r["dropped"] and args.dry_run:
        print("distill-reconcile: dry run: journal unchanged")
    elif r["dropped"]:
        print(
            f"distill-reconcile: removed them from the journal (original: {r['backup']}); start distill-teacher "
            "to send them again, then resume the students from this checkpoint"
        )
    else:
        print("distill-reconcile: nothing to do: the checkpoint holds every acknowledged key")
    return 0


if __name__ == "__main__":
    sys.exit(main())

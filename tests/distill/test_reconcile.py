"""distill-reconcile: after a student crash, keys acknowledged after the last checkpoint go back to
the teacher (removed from its journal), so they are trained once instead of never.

The checkpoint is a real one, written by the student's own `save_checkpoint` (Accelerate's
`save_state` and the ledger in ledger.json, `latest` pointing at it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distill.config import SpoolConfig, TransportConfig
from distill.errors import ReconcileError
from distill.reconcile import reconcile
from distill.transport import Publisher, TransportError

REPO = Path(__file__).resolve().parents[2]


def _checkpoint(root: Path, trained: list[str], step: int) -> Path:
    from accelerate import Accelerator

    from student.checkpoint import save_checkpoint
    from student.ledger import Ledger

    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ledger = Ledger()
    ledger.record(trained, rank=0, step=step)
    ledger.step = step
    model, opt = acc.prepare(model, opt)
    acc.register_for_checkpointing(sched)
    ckpts = root / "checkpoints"
    save_checkpoint(acc, ledger, ckpts, step, keep=2)
    return ckpts


def test_keys_acked_after_the_checkpoint_leave_the_journal(tmp_path):
    ckpts = _checkpoint(tmp_path, [f"k{i}" for i in range(6)] + ["only-in-ledger"], step=3)
    journal = tmp_path / "journal.txt"
    original = "".join(f"k{i}\n" for i in range(10))
    journal.write_text(original)

    dry = reconcile(journal, ckpts, dry_run=True)
    assert dry["dropped_keys"] == ["k6", "k7", "k8", "k9"] and dry["step"] == 3
    assert journal.read_text() == original and dry["backup"] is None

    r = reconcile(journal, ckpts)  # the checkpoints folder: its `latest` is used
    assert r["dropped"] == 4 and r["checkpoint_keys"] == 7 and r["journal_keys"] == 10
    assert journal.read_text() == "".join(f"k{i}\n" for i in range(6))
    assert Path(r["backup"]).read_text() == original
    # What a restarted teacher skips now: the checkpoint's keys only, so k6..k9 are sent again.
    assert Publisher.journal_keys(journal) == {f"k{i}" for i in range(6)}
    # Idempotent.
    assert reconcile(journal, ckpts / "latest")["dropped"] == 0


def test_a_running_teacher_holds_its_journal(tmp_path):
    ckpts = _checkpoint(tmp_path, ["a"], step=1)
    journal = tmp_path / "journal.txt"
    journal.write_text("a\nb\n")
    cfg = TransportConfig(bind=[f"ipc://{tmp_path}/t.sock"], shm="off")
    with Publisher(cfg, SpoolConfig(dir=str(tmp_path / "spool")), journal=str(journal)):
        with pytest.raises(ReconcileError, match="in use"):
            reconcile(journal, ckpts)
        cfg2 = TransportConfig(bind=[f"ipc://{tmp_path}/t2.sock"], shm="off")
        with pytest.raises(TransportError, match="in use by another process"):
            Publisher(
                cfg2, SpoolConfig(dir=str(tmp_path / "spool2")), journal=str(journal), journal_lock_wait_s=0.5
            ).start()
    assert journal.read_text() == "a\nb\n"
    assert reconcile(journal, ckpts)["dropped"] == 1  # teacher stopped: the lock is gone


def test_cli_reports_and_rejects_bad_input(tmp_path):
    ckpts = _checkpoint(tmp_path, ["a"], step=2)
    journal = tmp_path / "journal.txt"
    journal.write_text("a\nb\n")

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "distill.reconcile", *args], cwd=REPO, capture_output=True, text=True
        )

    ok = cli("--journal", str(journal), "--checkpoint", str(ckpts))
    assert ok.returncode == 0 and "1 acknowledged after it" in ok.stdout, ok.stdout + ok.stderr
    assert journal.read_text() == "a\n"

    bad = cli("--journal", str(journal), "--checkpoint", str(tmp_path / "nope"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "is not a folder" in bad.stderr
    notckpt = cli("--journal", str(journal), "--checkpoint", str(tmp_path))
    assert notckpt.returncode == 2 and "not a student checkpoint" in notckpt.stderr
    missing = cli("--journal", str(tmp_path / "none.txt"), "--checkpoint", str(ckpts))
    assert missing.returncode == 2 and "does not exist" in missing.stderr

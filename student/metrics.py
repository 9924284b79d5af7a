"""Per-step metrics: token-weighted loss terms summed on the device, read a step late, and metrics.json.

A micro-batch adds its terms (weighted by its tokens) to a device tensor: no host synchronisation
per micro-step. At the optimizer step the sums are all-reduced (one collective per step) and queued;
`publish` turns a queued step into a record (ledger.history, log line, tracker) once its copy to the
host is done, so the host never waits for the GPU to finish the step it just queued.
`publish(everything=True)` before a checkpoint and at the end makes `ledger.history` complete.
"""

from __future__ import annotations

import collections
import json
import math
import os
import time
from pathlib import Path

import torch
from accelerate.logging import get_logger

from student.ledger import Ledger
from student.recipes import TERMS, recipe_for

logger = get_logger(__name__)

# What a step's all-reduced tensor holds, by name: the token-weighted sums of every term and of the
# loss, then the seconds every rank waited for the teacher.
FIELDS = (*TERMS, "loss", "wait_s")
AT = {name: i for i, name in enumerate(FIELDS)}


class StepMetrics:
    # Steps whose sums may still be on their way from the GPU: reading a step's metrics waits for
    # its GPU work, so the host may run this many optimizer steps ahead of the GPU (it collates and
    # launches the next steps meanwhile). 2 leaves the GPU queued work while the host has a slow
    # step (a long collate, the Subscriber's thread busy).
    LAG = 2

    def __init__(self, accelerator, cfg, ledger: Ledger, bar):
        self.accelerator, self.cfg, self.ledger, self.bar = accelerator, cfg, ledger, bar
        self.world = accelerator.num_processes
        self.device = accelerator.device
        self.on_gpu = self.device.type != "cpu"
        self.sums = self._zeros()  # this step's token-weighted sums (every field but wait_s)
        self.in_flight: collections.deque = collections.deque()  # (host tensor, event, record) per step
        self.t_log, self.tok_log, self.smp_log = time.perf_counter(), 0.0, 0.0

    def _zeros(self) -> torch.Tensor:
        return torch.zeros(AT["wait_s"], dtype=torch.float64, device=self.device)

    def add(self, loss: torch.Tensor, terms: dict[str, torch.Tensor], tokens: int) -> None:
        """One micro-batch's loss and terms, weighted by its tokens (on the device, no sync)."""
        zero = loss.new_zeros(())
        self.sums += torch.stack([terms.get(k, zero) for k in TERMS] + [loss]).double() * tokens

    def end_step(self, rec: dict, wait_s: float) -> None:
        """Collective: all-reduce this step's sums (and the wait) and queue them with `rec`."""
        # (torch.full: a fill on the device; copying a host tensor would synchronise)
        tot = torch.cat([self.sums, torch.full((1,), wait_s, dtype=torch.float64, device=self.device)])
        tot = self.accelerator.reduce(tot, "sum") if self.world > 1 else tot
        event = None
        if self.on_gpu:
            tot = tot.to("cpu", non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self.in_flight.append((tot, event, rec))
        self.sums = self._zeros()

    def publish(self, everything: bool = False) -> None:
        """Turn finished steps' metrics into ledger records, progress and log lines, in step order."""
        while self.in_flight and (
            everything
            or len(self.in_flight) > self.LAG
            or self.in_flight[0][1] is None
            or self.in_flight[0][1].query()
        ):
            tot, event, rec = self.in_flight.popleft()
            if event is not None:
                event.synchronize()
            self._record(rec, tot)

    def _record(self, rec: dict, tot: torch.Tensor) -> None:
        cfg = self.cfg
        n_tok = rec["tokens"] or 1.0
        rec["loss"] = float(tot[AT["loss"]]) / n_tok
        rec.update({k: float(tot[AT[k]]) / n_tok for k in recipe_for(cfg).reported_terms(cfg)})
        rec["wait_s"] = float(tot[AT["wait_s"]]) / self.world
        self.ledger.history.append(rec)
        self.tok_log += rec["tokens"]
        self.smp_log += rec["samples"]
        self.bar.set_postfix(loss=f"{rec['loss']:.4f}")
        if rec["step"] % cfg.log_every == 0:
            dt = max(time.perf_counter() - self.t_log, 1e-9)
            terms_txt = " ".join(f"{k}={rec[k]:.4f}" for k in TERMS if k in rec)
            logger.info(
                "step %d loss=%.4f %s | %.1f samples/s %.0f tokens/s | waiting for teacher %.2fs/step",
                rec["step"],
                rec["loss"],
                terms_txt,
                self.smp_log / dt,
                self.tok_log / dt,
                rec["wait_s"],
            )
            self.t_log, self.tok_log, self.smp_log = time.perf_counter(), 0.0, 0.0
        if cfg.trackers:
            self.accelerator.log(
                {f"train/{k}": v for k, v in rec.items() if k not in ("step", "time")}, step=rec["step"]
            )


def write_metrics(path: Path, ledger: Ledger, world: int, source_stats: list[dict]) -> None:
    """metrics.json: a summary, one record per optimizer step, and every trained (key, rank, step)."""
    hist = ledger.history
    first = [h["loss"] for h in hist[: max(1, len(hist) // 10)]]
    last = [h["loss"] for h in hist[-max(1, len(hist) // 10) :]]
    summary = {
        "steps": ledger.step,
        "samples": len(ledger),
        "tokens": sum(h["tokens"] for h in hist),
        "wait_s": sum(h["wait_s"] for h in hist),
        "loss_first": sum(first) / len(first) if hist else math.nan,
        "loss_last": sum(last) / len(last) if hist else math.nan,
        "world_size": world,
        "source_stats": source_stats,  # per rank: the Subscriber's counters (empty for spool)
    }
    data = {
        "exit_code": 0,
        "exit_reason": "done",
        "summary": summary,
        "steps": hist,
        "trained": ledger.trained,
    }
    _write_json(path, data)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def write_exit(cfg, progress, code: int, reason: str, message: str) -> None:
    """metrics.json of a stopped run: `accelerate launch` exits 1 whatever happened, so the rank's
    own exit code, a reason token (teacher_gone, peer_lost, checkpoint_disk_full, error) and its
    one line are here for scripts, with what this job trained (no `steps` / `trained`: the ranks
    did not gather them). Never raises (the output folder's disk may be the one that is full)."""
    data = {
        "exit_code": code,
        "exit_reason": reason,
        "exit_message": message,
        "summary": {
            "samples": progress.trained,
            "checkpoint": progress.ckpt,
            "checkpoint_samples": progress.ckpt_samples,
            "world_size": progress.world,
            "rank": progress.rank,
        },
    }
    path = Path(cfg.output_dir) / "metrics.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_json(path, data)
    except OSError as e:
        logger.warning("cannot write %s: %s", path, e, main_process_only=False)

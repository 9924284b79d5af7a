"""The training loop: one iteration = one collective micro-step, the same collectives on every rank.

Every rank receives its own disjoint share of samples (its own Subscriber; or files r, r+W, ... of a
spool folder), so ranks hold different numbers of samples at different times. `Trainer.run` agrees
on every step collectively; each iteration:

1. `fill`: every rank fills a micro-batch from its own source (possibly empty); stale shared-memory
   samples are discarded, not acked. With `student.fill_ahead` this runs in a thread of its own,
   started once the previous iteration's step 3 has settled its inputs, while steps 4-6 run here.
2. `agree_flags` (collective 1): one small all-gather says who proposes samples, who is finished,
   idle or failed, who has uncommitted acks, a backlog, or heard END. Any rank heard END: every rank
   stops. A rank failed: every rank stops (teacher gone: exit 3; another error: exit 2).
3. `agree_keys` (collective 2, when anyone has samples): every rank's key hashes and token counts,
   from which every rank computes the same decision (`agree`): a key any rank trained before, or
   that a lower rank proposes now, is dropped.
4. `forward_backward`: each rank's loss weighted by its share of the step's tokens (DDP's mean over
   ranks is then the token-weighted mean); a rank without data runs a zero-weight step on a
   one-token padding batch so DDP's gradient all-reduce still matches up.
5. `optimizer_step`: after grad_accum_steps micro-batches, or earlier when no rank had data or all
   are done. Only then are the step's samples acknowledged to the teacher; the metrics are
   all-reduced; a checkpoint every checkpoint_every steps commits what it covers.
6. `settle`: acks for dropped duplicates once nothing is accumulated; the drain checkpoint (every
   rank idle with the teacher draining and acks no checkpoint covers: the teacher sends END only
   once everything is committed).

After the loop, `wind_down` checkpoints once more (the teacher may record everything acked as done)
or, when the teacher is gone, saves what was trained and raises TeacherGone (with the samples trained); `finish` gives unacked
samples back, gathers the ledger and saves the student.
"""

from __future__ import annotations

import contextlib
import enum
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import gather_object

from distill.errors import TeacherGone
from distill.protocol import Sample
from student.checkpoint import attempt, flatten, full_or_failed, room, save_checkpoint
from student.config import StudentConfig
from student.data import (
    Batch,
    StudentError,
    TokenBudgetBatcher,
    agree,
    check_sample,
    collate,
    empty_batch,
    idle_wait_s,
    key_hash,
    next_micro_batch,
    select,
    unused_layers_hint,
)
from student.errors import CheckpointError
from student.ledger import HashSet, Ledger
from student.metrics import StepMetrics, write_metrics
from student.recipes import Built

logger = get_logger(__name__)
CAPPED_HINT_AFTER = 20  # micro-batches cut short by the credit window before the hint is logged


class Col(enum.IntEnum):
    """The columns of the flags every rank gathers each iteration (collective 1)."""

    SAMPLES = 0  # samples proposed
    DONE = 1  # source exhausted, nothing in the batcher
    ERROR = 2  # 0, or Fault
    IDLE = 3  # the teacher is draining and this rank holds nothing
    UNCOMMITTED = 4  # acks that no checkpoint covers yet
    BACKLOG = 5  # the micro-batch was full (or no more could come)
    ENDED = 6  # heard END: every key of the run is committed


class Fault(enum.IntEnum):
    STUDENT = 1  # StudentError: stop with its line (exit 2)
    TEACHER_GONE = 2  # distill.errors.TeacherGone: stop, exit 3


@dataclass
class Micro:
    """This rank's part of one micro-step."""

    samples: list[Sample] = field(default_factory=list)
    batch: Batch | None = None  # the collated samples (host)
    error: str = ""
    fault: int = 0
    tokens: int = 0  # this rank's tokens after the key agreement
    global_tokens: int = 0  # every rank's
    global_samples: int = 0

    def keep(self, rows: list[int]) -> None:
        self.samples = [self.samples[i] for i in rows]
        self.batch = select(self.batch, rows) if rows else None

    def drop(self) -> None:
        self.samples, self.batch = [], None


@dataclass
class Flags:
    """What every rank knows after collective 1."""

    proposed: list[int]  # samples each rank proposes
    all_done: bool  # every rank's source is exhausted
    drain: bool  # every rank idle with the teacher draining, and some acks are uncommitted
    idle_here: bool  # this rank is idle with the teacher draining (computed before the step)


@dataclass
class Progress:
    """What the one line of a stopped run says, filled in as the run goes (read by train.run)."""

    world: int = 1
    rank: int = 0
    peers: object = None  # multinode.PeerTable
    trained: int = 0  # samples covered by this job's completed optimizer steps
    ckpt: str | None = None  # the newest checkpoint this job saved or resumed from
    ckpt_samples: int = 0
    exporter: object = None  # student.exporter.StudentMetrics when student.metrics_port is set


class Trainer:
    """The loop's state: what is accumulated, held, acked and trained, and the steps that change it."""

    def __init__(
        self,
        accelerator: Accelerator,
        cfg: StudentConfig,
        built: Built,
        model,
        optimizer,
        scheduler,
        ledger: Ledger,
        source,
        *,
        credit: int | None,
        ctl_group,
        ckpt_dir: Path,
        per_node: bool,
        progress: Progress,
        bar,
    ):
        self.accelerator, self.cfg, self.built, self.model = accelerator, cfg, built, model
        self.optimizer, self.scheduler, self.ledger, self.source = optimizer, scheduler, ledger, source
        self.credit, self.ctl_group, self.ckpt_dir, self.per_node = credit, ctl_group, ckpt_dir, per_node
        self.progress, self.bar = progress, bar
        self.rank, self.world = accelerator.process_index, accelerator.num_processes
        self.device = accelerator.device
        on_gpu = self.device.type != "cpu"
        # Host batches: page-locked on a GPU (asynchronous copies). PyTorch's cuDNN attention builds a
        # plan for every new batch shape (~12 ms forward + ~19 ms backward of CPU per layer on an
        # H200): off by default, SDPA then takes the flash / memory-efficient kernels, which need none.
        # With it on, lengths are rounded up to 64 by default (fewer distinct shapes).
        self.pin = on_gpu
        # Host-to-device copies on their own stream: a batch uploads while the previous step computes.
        self.upload_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.pad_to = cfg.pad_to_multiple_of or (64 if on_gpu and cfg.cudnn_attention else 1)
        window = cfg.length_window if credit is None else min(cfg.length_window, credit // 2)
        self.pack = cfg.batch_layout == "packed"  # no padding: the window is not used
        self.batcher = TokenBudgetBatcher(
            cfg.max_tokens_per_batch, cfg.max_samples_per_batch, window, packed=self.pack
        )
        self.metrics = StepMetrics(accelerator, cfg, ledger, bar)

        self.step = self.last_ckpt = ledger.step
        # Every rank keeps the same sets of 64-bit key hashes: `trained_h` (covered by a completed
        # optimizer step, any rank, including the checkpoint's ledger) and `claimed_h` (accepted in
        # the current gradient accumulation). A key in either is never trained again, by any rank.
        self.trained_h = HashSet(key_hash(k) for k in ledger.keys())
        self.claimed_h: set[int] = set()
        self.pending: list[Sample] = []  # samples whose gradients are accumulated; acked after the step
        self.in_hand: list[Sample] = []  # this micro-batch's samples until forward_backward
        self.dup_wait: list[Sample] = []  # dropped duplicates: acked after the next step, never trained
        self.micro = 0  # micro-batches accumulated since the last optimizer step
        self.synced = True  # was the last backward outside no_sync (gradients all-reduced)?
        self.step_tokens = self.step_samples = 0  # counted on the host
        self.wait_mark = source.wait_s
        self.anyone_backlogged = False  # last iteration: decides whether a rank may wait for samples
        self.gone: str | None = None  # why the teacher is gone (some rank heard nothing)
        self.counts = {"stale": 0, "duplicates": 0, "ahead": 0}  # ahead: micro-batches filled ahead
        self.trained_here = self.tokens_here = 0  # this rank, this process (student/exporter.py)
        self.layers_noted = False  # the unused-layers hint is logged once
        self.capped_said = False  # and the credit-window hint
        self.ahead: Ahead | None = None  # the next micro-batch's fill, running (student.fill_ahead)
        self.stopping = False  # the loop ended: a fill running ahead waits for no more samples

    # --- the loop ------------------------------------------------------------------------------------

    def run(self) -> None:
        """Train until every rank is done, max_steps, or a failure; every rank takes the same path."""
        cfg = self.cfg
        stop = cfg.max_steps is not None and self.step >= cfg.max_steps
        try:
            while not stop:
                mb = self.take_ahead()  # 1. this rank's micro-batch (possibly empty): filled ahead,
                mb = mb if mb is not None else self.fill()  # or now
                flags = self.agree_flags(mb)  # 2. collective: proposals, done, failed, idle, END
                if self.gone is not None:
                    break
                self.agree_keys(mb, flags)  # 3. collective when anyone proposes: who trains which key
                self.in_hand = mb.samples
                if cfg.fill_ahead and not flags.all_done:  # 1. of the next iteration, from now on
                    self.ahead = Ahead(self.fill, self.device)
                if mb.global_tokens:
                    self.forward_backward(mb)  # 4. DDP all-reduces at the accumulation boundary
                self.in_hand = []
                if self.micro and (
                    self.micro >= cfg.grad_accum_steps or not mb.global_tokens or flags.all_done
                ):
                    self.optimizer_step()  # 5. then acks, metrics, a checkpoint every N steps
                    if cfg.max_steps is not None and self.step >= cfg.max_steps:
                        break
                self.settle(flags)  # 6. acks of dropped duplicates; drain checkpoint or commit
                if flags.all_done:
                    break
        finally:
            # Stopping (max_steps, a failure): a fill running ahead returns at its next check (it
            # must end before the source closes); what it took stays unacked, and the teacher
            # sends it again (to this run or the next).
            self.end_ahead()
        self.wind_down()

    def take_ahead(self) -> Micro | None:
        """The micro-batch a fill running ahead made (None: none runs)."""
        ahead, self.ahead = self.ahead, None
        if ahead is None:
            return None
        self.counts["ahead"] += 1
        return ahead.result()

    def end_ahead(self) -> None:
        """The loop ended: a fill running ahead returns at its next check; it is over before the
        source closes (a fill reading ring slots after the unmap would crash)."""
        if self.ahead is not None:
            self.stopping = True
            self.ahead.join()
            self.ahead = None

    def unacked(self) -> int:
        """Samples this rank holds outside the batcher and has not acked: what they take of the
        credit window. A fill running ahead asks again at every check (this thread acks meanwhile)."""
        return len(self.pending) + len(self.dup_wait) + len(self.in_hand)

    # --- 1. fill -------------------------------------------------------------------------------------

    def fill(self) -> Micro:
        """This rank's micro-batch. It waits (up to idle_flush_s) unless some rank had a backlog last
        time; then it goes with what has arrived. A failure is reported, not raised: every rank
        must learn of it in collective 1."""
        b = self.built
        try:
            wait = idle_wait_s(self.cfg.idle_flush_s, self.anyone_backlogged)
            stop = lambda: self.stopping  # noqa: E731
            mb = Micro(next_micro_batch(self.source, self.batcher, wait, self.unacked, self.credit, stop))
            for s in mb.samples:
                check_sample(s, b.layer_ids, b.teacher_hidden, partial_ok=b.recipe.partial_positions)
            if mb.samples and not self.layers_noted:
                self.layers_noted = True
                hint = unused_layers_hint(mb.samples[0].layers, b.layer_ids)
                if hint:
                    logger.info(hint)
            if mb.samples:
                mb.batch = collate(
                    mb.samples,
                    b.layer_ids,
                    pin_memory=self.pin,
                    pad_to_multiple_of=self.pad_to,
                    threads=self.cfg.collate_threads,
                    pack=self.pack,
                )
                self.drop_stale(mb)
        except TeacherGone as e:
            mb = Micro(error=str(e), fault=Fault.TEACHER_GONE)
        except StudentError as e:
            mb = Micro(error=str(e), fault=Fault.STUDENT)
        return mb

    def drop_stale(self, mb: Micro) -> None:
        """Copy first (collate), then ask whether the memory was still the sample's: a shared-memory
        slot is reused once the teacher declared this student gone. Stale samples are discarded,
        not acked; the teacher sends them again."""
        ok = [self.source.valid(s) for s in mb.samples]
        if not all(ok):
            self.source.discard([s for s, v in zip(mb.samples, ok, strict=True) if not v])
            self.counts["stale"] += ok.count(False)
            mb.keep([i for i, v in enumerate(ok) if v])

    # --- 2. agree on the flags (collective 1) --------------------------------------------------------

    def agree_flags(self, mb: Micro) -> Flags | None:
        src = self.source
        done_here = src.exhausted and not self.batcher.pending
        idle_here = src.draining and not self.batcher.pending and not mb.samples and self.micro == 0
        uncommitted = self.cfg.checkpoint_every > 0 and src.uncommitted > 0
        ended = int(src.run_ended)
        mine = [len(mb.samples), done_here, int(mb.fault), idle_here, uncommitted, self.batcher.filled, ended]
        info = self.gather_ctl(torch.tensor(mine, dtype=torch.int64))
        if int(info[:, Col.ENDED].max()) > 0:
            # Some rank heard END: every teacher has every key committed, so the run is complete. A
            # rank that missed it (its host was away when END was sent) holds only copies of
            # committed keys: it drops them and stops with the others instead of waiting for a
            # teacher that has left.
            if mb.samples:
                src.discard(mb.samples)
                self.counts["stale"] += len(mb.samples)
            mb.drop()
            mb.fault = 0
            info[:, Col.SAMPLES] = 0
            info[:, Col.DONE] = 1
            info[:, Col.ERROR] = 0
        worst = int(info[:, Col.ERROR].max())
        if worst == Fault.TEACHER_GONE:
            self.gone = mb.error or "another rank heard nothing from the teacher"
            return None
        if worst == Fault.STUDENT:
            raise StudentError(mb.error or "another rank stopped with an error (see its message above)")
        self.anyone_backlogged = int(info[:, Col.BACKLOG].sum()) > 0
        return Flags(
            proposed=info[:, Col.SAMPLES].tolist(),
            all_done=int(info[:, Col.DONE].sum()) == self.world,
            drain=int(info[:, Col.IDLE].sum()) == self.world and int(info[:, Col.UNCOMMITTED].sum()) > 0,
            idle_here=idle_here,
        )

    # --- 3. agree on the keys (collective 2) ---------------------------------------------------------

    def agree_keys(self, mb: Micro, flags: Flags) -> None:
        """Every rank's key hashes and token counts; every rank computes the same decision."""
        world, n_max = self.world, max(flags.proposed)
        tokens_per_rank = [0] * world
        samples_per_rank = [0] * world
        if n_max:
            vec = torch.zeros(2 * n_max, dtype=torch.int64)
            vec[: len(mb.samples)] = torch.tensor([key_hash(s.key) for s in mb.samples], dtype=torch.int64)
            vec[n_max : n_max + len(mb.samples)] = torch.tensor([s.num_tokens for s in mb.samples])
            allv = self.gather_ctl(vec)
            proposals = [allv[r, : flags.proposed[r]].tolist() for r in range(world)]
            keep_all = agree(proposals, (self.trained_h, self.claimed_h))
            for r in range(world):
                kept = [i for i, k in enumerate(keep_all[r]) if k]
                tokens_per_rank[r] = int(allv[r, n_max:][kept].sum()) if kept else 0
                samples_per_rank[r] = len(kept)
                self.claimed_h.update(proposals[r][i] for i in kept)
            mine = keep_all[self.rank]
            if not all(mine):
                self.dup_wait.extend(s for s, k in zip(mb.samples, mine, strict=True) if not k)
                self.counts["duplicates"] += mine.count(False)
                mb.keep([i for i, k in enumerate(mine) if k])
        mb.tokens, mb.global_tokens = tokens_per_rank[self.rank], sum(tokens_per_rank)
        mb.global_samples = sum(samples_per_rank)

    # --- 4. forward / backward -----------------------------------------------------------------------

    def forward_backward(self, mb: Micro) -> None:
        """Weighted by this rank's share of the step's tokens; a rank without data weighs 0."""
        b = self.built
        batch = mb.batch if mb.batch is not None else empty_batch(b.layer_ids, b.teacher_hidden)
        boundary = self.micro + 1 >= self.cfg.grad_accum_steps
        weight = mb.tokens * self.world / mb.global_tokens
        loss, terms = self.backward(batch.to(self.device, stream=self.upload_stream), weight, sync=boundary)
        self.synced = boundary
        self.micro += 1
        self.pending.extend(mb.samples)
        if mb.tokens:  # device-side sums: no host synchronisation here
            self.metrics.add(loss, terms, mb.tokens)
        self.step_tokens += mb.global_tokens
        self.step_samples += mb.global_samples

    def backward(self, batch: Batch, weight: float, sync: bool):
        # DDP all-reduces gradients on a backward outside no_sync; inside, they accumulate locally.
        acc = self.accelerator
        with contextlib.nullcontext() if sync else acc.no_sync(self.model):
            with acc.autocast():
                b = self.built
                loss, terms = b.recipe.loss(self.model, b.head, batch, self.cfg, b.teacher_last)
            acc.backward(loss * weight)
        return loss.detach(), terms

    # --- 5. the optimizer step -----------------------------------------------------------------------

    def optimizer_step(self) -> None:
        """Step (early when no rank had data: holding samples unacked would starve the teacher's
        credit), then acknowledge the step's samples, queue its metrics, checkpoint every N."""
        cfg, b = self.cfg, self.built
        if not self.synced:  # the last backward was local: a zero-weight synced one all-reduces the sum
            self.backward(empty_batch(b.layer_ids, b.teacher_hidden).to(self.device), 0.0, sync=True)
        if self.micro > 1:  # mean over micro-batches
            torch._foreach_div_([p.grad for p in self.model.parameters() if p.grad is not None], self.micro)
        if cfg.max_grad_norm > 0:
            self.accelerator.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.acknowledge()
        # Metrics: global token-weighted means (one all-reduce per step, read a step later).
        wait = self.source.wait_s - self.wait_mark
        self.wait_mark = self.source.wait_s
        rec = {"step": self.step, "samples": self.step_samples, "tokens": self.step_tokens}
        rec.update(lr=self.scheduler.get_last_lr()[0], time=time.time())
        self.metrics.end_step(rec, wait)
        self.ledger.step = self.step
        self.step_tokens = self.step_samples = 0
        if self.batcher.capped >= CAPPED_HINT_AFTER and not self.capped_said and self.credit is not None:
            self.capped_said = True
            logger.warning(
                "%d micro-batches in %d steps on rank %d ended early because it held its whole credit "
                "(transport.credit_samples %d) before max_tokens_per_batch was reached: a larger "
                "credit window gives fuller batches and keeps the teacher ahead",
                self.batcher.capped,
                self.step,
                self.rank,
                self.credit,
                main_process_only=False,
            )
        self.bar.update(1)
        self.metrics.publish()
        if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
            self.checkpoint()

    def acknowledge(self) -> None:
        """Only now may the teacher forget the step's samples (and the duplicates this rank
        dropped): the step that used them is done."""
        self.source.ack(self.pending + self.dup_wait)
        self.ledger.record([s.key for s in self.pending], self.rank, self.step)
        self.trained_here += len(self.pending)
        self.tokens_here += sum(s.num_tokens for s in self.pending)
        self.trained_h |= self.claimed_h
        self.claimed_h.clear()
        self.progress.trained = len(self.trained_h)
        self.pending, self.dup_wait, self.micro, self.synced = [], [], 0, True

    def checkpoint(self) -> None:
        """Collective: save, then tell the teacher that everything acked so far is covered.

        Without a step since the last checkpoint (or the resumed one), that checkpoint already
        covers every key acked since (only keys of completed steps are acked): commit only, and
        never write into the folder `latest` points at."""
        self.metrics.publish(everything=True)  # the ledger's history is saved with the checkpoint
        if self.step > self.last_ckpt:
            path = self.save()
            self.last_ckpt = self.step
            self.progress.ckpt, self.progress.ckpt_samples = str(path), len(self.ledger)
        self.source.commit()  # every rank passed save_checkpoint's final barrier: the save is complete

    def save(self) -> Path:
        cfg = self.cfg
        return save_checkpoint(
            self.accelerator, self.ledger, self.ckpt_dir, self.step, cfg.checkpoint_keep, self.per_node
        )

    # --- 6. settle -----------------------------------------------------------------------------------

    def settle(self, flags: Flags) -> None:
        cfg = self.cfg
        if self.micro == 0 and self.dup_wait:
            # Nothing is accumulated: every key in trained_h is covered by a completed step.
            self.source.ack(self.dup_wait)
            self.dup_wait = []
        if cfg.checkpoint_every and flags.drain and not flags.all_done:
            logger.info("teacher draining: checkpoint at step %d to commit what was acknowledged", self.step)
            self.checkpoint()
        elif cfg.checkpoint_every and flags.idle_here and self.step == self.last_ckpt:
            # No step since the last checkpoint: it covers everything acked here, including
            # redelivered copies of trained keys the Subscriber acked by itself (not counted in
            # `uncommitted`). Local and cheap: nothing is sent when there is nothing to commit.
            self.source.commit()

    # --- the end -------------------------------------------------------------------------------------

    def wind_down(self) -> None:
        """Stopping for good (max_steps, end of stream): a checkpoint covers every trained step, so
        the teacher can record everything acked as done (a resumed run would skip nothing else).
        Teacher gone: save what was trained (nobody to commit to) and raise TeacherGone."""
        cfg = self.cfg
        self.metrics.publish(everything=True)  # every step's record in the ledger before it is saved
        if cfg.checkpoint_every and self.gone is None:
            self.checkpoint()
        if self.gone is not None:
            if cfg.checkpoint_every and self.step > self.last_ckpt:  # saved, not committed
                self.save()
            raise TeacherGone(self.gone, len(self.trained_h))

    def finish(self) -> None:
        """Unacked samples go back to the teacher; the ledger is gathered; the student is saved."""
        acc, counts = self.accelerator, self.counts
        if counts["stale"] or counts["duplicates"]:
            logger.info(
                "rank %d dropped %d stale and %d duplicate samples (not trained)",
                self.rank,
                counts["stale"],
                counts["duplicates"],
            )
        self.source.close()
        self.ledger.merge(flatten(gather_object([self.ledger.local])))
        stats = {
            **self.source.stats(),
            "dropped_stale": counts["stale"],
            "dropped_duplicates": counts["duplicates"],
            "filled_ahead": counts["ahead"],
        }
        source_stats = gather_object([stats])  # one dict per rank
        acc.wait_for_everyone()
        self.save_outputs(source_stats)
        # Leave together: a rank that destroys the process group while the main one is still saving
        # can leave the main one hanging at exit (seen with gloo).
        acc.wait_for_everyone()
        acc.end_training()

    def save_outputs(self, source_stats: list[dict]) -> None:
        """(Collective) The main process saves the student and metrics.json; a write that fails (a
        full output disk) stops every rank with the same line, the half-written model removed."""
        acc, out_dir = self.accelerator, Path(self.cfg.output_dir)
        err = ""
        if acc.is_main_process:
            err = attempt(lambda: self._write_outputs(out_dir, source_stats), acc)
            if err:
                shutil.rmtree(out_dir / "model", ignore_errors=True)
        errs = gather_object([err]) if self.world > 1 else [err]
        why = next((e for e in errs if e), "")
        if why:
            ckpt = (
                f"checkpoint {self.progress.ckpt}"
                if self.progress.ckpt
                else "no checkpoint (checkpoint_every is 0)"
            )
            raise CheckpointError(
                f"cannot write the final student to {out_dir / 'model'} (student.output_dir {out_dir}"
                f"{room(out_dir)}): {why}; the training is in {ckpt}. Free space there or set "
                f"student.output_dir to a larger disk",
                f"output_{full_or_failed(why)}",
            )

    def _write_outputs(self, out_dir: Path, source_stats: list[dict]) -> None:
        self.built.recipe.save(self.accelerator, self.model, self.cfg, out_dir / "model")
        write_metrics(out_dir / "metrics.json", self.ledger, self.world, source_stats)
        logger.info(
            "saved the student to %s (%d steps, %d samples)",
            out_dir / "model",
            self.step,
            len(self.ledger),
        )

    def gather_ctl(self, t: torch.Tensor) -> torch.Tensor:
        """All-gather a small int64 CPU tensor (same length on every rank) -> [world, len]."""
        if self.world == 1:
            return t.view(1, -1)
        if self.ctl_group is None:
            return self.accelerator.gather(t.to(self.device)).cpu().view(self.world, -1)
        out = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(out, t, group=self.ctl_group)
        return torch.stack(out)


def cuda_index(device: torch.device) -> int | None:
    """The CUDA device a helper thread sets before it allocates (None: not CUDA). Plain "cuda" (one
    process without a launcher) is the calling thread's current device: set_device refuses it."""
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


class Ahead:
    """`fill` in a thread of its own (`student.fill_ahead`): `result()` waits for its micro-batch
    and raises what it raised; `join()` only waits. A daemon thread: a fill waits for samples for
    at most idle_flush_s at a time, and nothing of the run's state outlives the process."""

    def __init__(self, fill, device: torch.device):
        self._out: Micro | None = None
        self._err: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(fill, cuda_index(device)), name="distill-fill-ahead", daemon=True
        )
        self._thread.start()

    def _run(self, fill, index: int | None) -> None:
        try:
            if index is not None:  # pinned buffers from this rank's device, not a context on GPU 0
                torch.cuda.set_device(index)
            self._out = fill()
        except BaseException as e:  # handed to the loop's thread by result()
            self._err = e

    def join(self) -> None:
        self._thread.join()

    def result(self) -> Micro:
        self.join()
        if self._err is not None:
            raise self._err
        assert self._out is not None
        return self._out

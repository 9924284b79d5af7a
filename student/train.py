"""Student worker: distil a transformers causal LM from a teacher's hidden states, under Accelerate.

    accelerate launch student.py --config configs/student_tiny.yaml [--set student.max_steps=50]
    # CPU, several processes: accelerate launch --multi_gpu --num_processes 2 student.py --config ...

Every rank receives its own disjoint share of samples (its own Subscriber; or files r, r+W, ... of a
spool folder), so ranks hold different numbers of samples at different times. The loop therefore
agrees on every step collectively: each iteration, every rank fills a micro-batch (possibly empty),
then one small all-gather says who has samples, who is finished, idle or failed, and a second one
(when anyone has samples) carries every rank's key hashes and token counts, from which every rank
computes the same decision: which keys each rank trains (a key any rank trained before, or that a
lower rank proposes now, is dropped). A rank without data runs a zero-weight step on a one-token
padding batch so DDP's gradient all-reduce still matches up. Samples are acknowledged to the
teacher only after the optimizer step that used them; with checkpoints they are committed after the
checkpoint that covers them; the ledger of trained keys is checkpointed with the model.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import math
import os
import shutil
import socket
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator, DistributedDataParallelKwargs, InitProcessGroupKwargs
from accelerate.logging import get_logger
from accelerate.utils import ProjectConfiguration, broadcast_object_list, gather_object, set_seed
from tqdm.auto import tqdm
from transformers import get_scheduler

from distill.config import ConfigError
from student import losses
from student.config import StudentConfig, load_student_config
from student.data import (
    Batch,
    SpoolSource,
    StreamSource,
    StudentError,
    TeacherGoneError,
    TokenBudgetBatcher,
    agree,
    check_sample,
    collate,
    empty_batch,
    idle_wait_s,
    key_hash,
    next_micro_batch,
    select,
)
from student.ledger import Ledger
from student.model import DistillModel, TeacherHead, load_student, teacher_config
from student.multinode import (
    COMPLETE,
    PeerTable,
    choose_resume,
    first_line,
    is_peer_failure,
    local_address,
    local_checkpoints,
    needed_files,
    set_gloo_ifname,
)

logger = get_logger(__name__)
TERMS = ("mse", "cosine", "nmse", "kl", "ce")
EXIT_PEER_LOST = 4  # a peer rank (another node) is gone: every surviving rank exits with this code


# What a surviving rank needs to say when a peer is gone (filled in by training_function).
_RUN: dict = {}


def compute_loss(model, head: TeacherHead | None, batch: Batch, cfg: StudentConfig, teacher_last: int | None):
    """Weighted sum of the configured loss terms on one micro-batch.

    Hidden-state terms are averaged over layer pairs with the pairs' weights. Teacher states come in
    the dtype the teacher sent (bf16 from a bf16 teacher) and are upcast to fp32 here, on the
    device, per layer used. Returns the loss and a dict of the unweighted terms (detached).
    """
    if batch.lengths is not None:  # a packed host batch (collate): pad it where it is
        batch = batch.to(batch.input_ids.device)
    logits, mapped = model(batch.input_ids, batch.mask)
    w = cfg.losses
    pos = {lid: i for i, lid in enumerate(batch.layer_ids)}  # teacher layer id -> index in batch.teacher
    terms: dict[str, torch.Tensor] = {}
    pair_total = sum(p.weight for p in cfg.layer_map) or 1.0
    for name, fn in (("mse", losses.mse), ("cosine", losses.cosine), ("nmse", losses.nmse)):
        if getattr(w, name) > 0:
            terms[name] = (
                sum(
                    p.weight * fn(h.float(), batch.teacher[:, :, pos[p.teacher_layer]].float(), batch.mask)
                    for p, h in zip(cfg.layer_map, mapped, strict=True)
                )
                / pair_total
            )
    if w.kl > 0:
        teacher_logits = head(batch.teacher[:, :, pos[teacher_last]].float())
        terms["kl"] = losses.kl(logits, teacher_logits, batch.mask, cfg.temperature)
    if w.ce > 0:
        terms["ce"] = losses.ce(logits, batch.input_ids, batch.mask)
    loss = sum(getattr(w, k) * v for k, v in terms.items())
    return loss, {k: v.detach() for k, v in terms.items()}


def unused_parameters(cfg: StudentConfig, model: DistillModel) -> bool:
    """Whether some trainable parameter can get no gradient (DDP then needs find_unused_parameters).

    The logits (kl, ce) reach every student parameter; without them the final norm, the LM head
    and the layers above the deepest mapped one get none. Projections get one from a hidden-state
    term (mse, cosine, nmse) only."""
    w = cfg.losses
    uses_logits = w.kl > 0 or w.ce > 0
    hidden_terms = w.mse + w.cosine + w.nmse > 0
    return not uses_logits or (len(model.projections) > 0 and not hidden_terms)


def build_optimizer(cfg: StudentConfig, params):
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


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


def training_function(cfg: StudentConfig, run, args) -> None:
    # cpu=True on a machine without CUDA is what makes `--multi_gpu --num_processes N` join a gloo
    # group (student/README.md). DDP's find_unused_parameters is set below, once the model is known.
    ddp_kwargs = DistributedDataParallelKwargs(find_unused_parameters=True)
    # Multi-node: gloo binds to the interface of the route to the main process unless
    # GLOO_SOCKET_IFNAME says otherwise (the hostname may resolve to 127.0.0.1).
    if os.environ.get("LOCAL_RANK", "0") == "0":
        set_gloo_ifname(lambda m: print(f"student: {m}", file=sys.stderr, flush=True))
    else:
        set_gloo_ifname(lambda m: None)
    collective_timeout = timedelta(seconds=cfg.collective_timeout_s)
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),
        mixed_precision=cfg.mixed_precision,
        log_with=list(cfg.trackers) or None,
        project_config=ProjectConfiguration(project_dir=cfg.output_dir),
        kwargs_handlers=[ddp_kwargs, InitProcessGroupKwargs(timeout=collective_timeout)],
    )
    rank, world = accelerator.process_index, accelerator.num_processes
    device = accelerator.device
    on_gpu = device.type != "cpu"
    # Who is where: the line a surviving rank prints names the host that is gone.
    me = (rank, socket.gethostname(), local_address())
    peers = PeerTable(gather_object([me]) if world > 1 else [me])
    where = [f"{h} ({a})" for _, h, a in peers.entries]
    progress = {"trained": 0, "ckpt": None, "ckpt_samples": 0}
    _RUN.update(peers=peers, rank=rank, world=world, cfg=cfg, args=args, progress=progress)
    # The loop's control collectives (flags, key hashes) carry a few integers: on a GPU they go
    # through a gloo group on the CPU, so that agreeing on the next micro-batch never waits for
    # the GPU to finish the current step (an NCCL gather read back with .cpu() would).
    ctl_group = dist.new_group(backend="gloo", timeout=collective_timeout) if on_gpu and world > 1 else None
    set_seed(cfg.seed)
    out_dir = Path(cfg.output_dir)
    ckpt_dir = Path(cfg.ckpt_dir)
    # Without a shared filesystem every node saves the whole checkpoint and keeps its own `latest`.
    per_node = probe_storage(accelerator, ckpt_dir) if world > 1 else False
    accelerator.project_configuration.save_on_each_node = per_node
    if per_node and accelerator.is_local_main_process:
        logger.info(
            "checkpoint_dir %s is not shared between nodes: every node saves whole checkpoints",
            ckpt_dir,
            main_process_only=False,
        )

    # --- model: student, projections, frozen teacher head ---
    tconf = teacher_config(cfg)
    teacher_hidden = tconf.hidden_size if tconf is not None else cfg.teacher_hidden_size
    teacher_last = tconf.num_hidden_layers if tconf is not None else None
    for p in cfg.layer_map:
        if teacher_last is not None and p.teacher_layer > teacher_last:
            raise StudentError(
                f"layer_map names teacher layer {p.teacher_layer}; the teacher has ids 0..{teacher_last}"
            )
    student = load_student(cfg)
    model = DistillModel(
        student, [(p.student_layer, p.teacher_layer) for p in cfg.layer_map], teacher_hidden, cfg.projection
    )
    head = None
    if cfg.losses.kl > 0:
        head = TeacherHead.from_checkpoint(cfg.teacher_model).to(accelerator.device)
        if head.lm_head.out_features != student.config.vocab_size:
            raise StudentError(
                f"KL needs one vocabulary: teacher vocab {head.lm_head.out_features}, student "
                f"{student.config.vocab_size}"
            )
    # Teacher layer ids every batch carries: the mapped ones, plus the last one for KL.
    layer_ids = sorted({p.teacher_layer for p in cfg.layer_map} | ({teacher_last} if head else set()))
    ddp_kwargs.find_unused_parameters = (
        cfg.find_unused_parameters
        if cfg.find_unused_parameters is not None
        else unused_parameters(cfg, model)
    )
    # Host batches: page-locked on a GPU (asynchronous copies). PyTorch's cuDNN attention builds a
    # plan for every new batch shape (~12 ms forward + ~19 ms backward of CPU per layer on an H200):
    # off by default, SDPA then takes the flash / memory-efficient kernels, which need none. With
    # it on, lengths are rounded up to 64 by default (fewer distinct shapes).
    pin = on_gpu
    if on_gpu:
        torch.backends.cuda.enable_cudnn_sdp(cfg.cudnn_attention)
    pad_to = cfg.pad_to_multiple_of or (64 if on_gpu and cfg.cudnn_attention else 1)

    optimizer = build_optimizer(cfg, model.parameters())
    scheduler = get_scheduler(
        cfg.lr_schedule if cfg.warmup_steps == 0 or cfg.lr_schedule != "constant" else "constant_with_warmup",
        optimizer,
        num_warmup_steps=cfg.warmup_steps,
        num_training_steps=cfg.max_steps or 0,
    )
    model, optimizer = accelerator.prepare(model, optimizer)
    # The scheduler is not prepared: Accelerate's wrapper steps it num_processes times per optimizer
    # step (it assumes a sharded dataloader). We step it by hand once per step and checkpoint it.
    ledger = Ledger()
    accelerator.register_for_checkpointing(scheduler, ledger)

    resume = resolve_resume(cfg, rank, world, where)
    if resume is not None:
        accelerator.load_state(str(resume))
        progress.update(ckpt=str(resume), ckpt_samples=len(ledger.trained))
        if accelerator.is_local_main_process:  # one line per node: each may read its own storage
            logger.info(
                "resumed from %s at step %d (%d samples trained)",
                resume,
                ledger.step,
                len(ledger.trained),
                main_process_only=False,
            )
    step = ledger.step
    if cfg.max_steps is not None and step >= cfg.max_steps:
        logger.info("checkpoint is already at max_steps=%d", cfg.max_steps)

    if cfg.trackers:
        accelerator.init_trackers(
            "distill_student",
            config={
                "lr": cfg.lr,
                "grad_accum_steps": cfg.grad_accum_steps,
                "max_tokens_per_batch": cfg.max_tokens_per_batch,
                "world_size": world,
            },
        )

    # --- data: this rank's share of the stream or of the spool folder ---
    # With checkpoints, an ack only returns credit; the teacher records a key as done (COMMIT) once a
    # checkpoint covers it. Without, every ack is also a commit.
    if cfg.mode == "spool":
        source = SpoolSource(cfg.spool_dir or run.spool.dir, rank, world, ledger.keys(), cfg.spool_layers)
    else:
        source = StreamSource(run.transport, ledger.keys(), commit_on_ack=cfg.checkpoint_every == 0)
    batcher = TokenBudgetBatcher(cfg.max_tokens_per_batch, cfg.max_samples_per_batch)

    # --- the loop: one iteration = one collective micro-step ---
    # Every rank keeps the same sets of 64-bit key hashes: `trained_h` (covered by a completed
    # optimizer step, any rank, including the checkpoint's ledger) and `claimed_h` (accepted in the
    # current gradient accumulation). A key in either is never trained again, by any rank.
    trained_h = {key_hash(k) for k in ledger.keys()}
    claimed_h: set[int] = set()
    pending = []  # samples whose gradients are accumulated; acked after the optimizer step
    dup_wait = []  # this rank's dropped duplicates: acked after the next optimizer step, never trained
    micro = 0  # micro-batches accumulated since the last optimizer step
    synced = True  # was the last backward outside no_sync (gradients all-reduced)?
    # Token-weighted sums of the terms and the loss over the step's micro-batches, on the device:
    # no host synchronisation per micro-step. Tokens and samples are counted on the host.
    acc = torch.zeros(len(TERMS) + 1, dtype=torch.float64, device=device)
    step_tokens = step_samples = 0
    wait_mark = source.wait_s
    t_log, tok_log, smp_log = time.perf_counter(), 0.0, 0.0
    # Steps whose metrics are still on their way to the host: (step, host tensor, event, record).
    # A step's metrics are read one step later (or when its copy is done), so the host never waits
    # for the GPU to finish the step it just queued; `publish(everything=True)` before checkpoints
    # and at the end makes `ledger.history` complete.
    in_flight: collections.deque = collections.deque()
    bar = tqdm(
        total=cfg.max_steps, initial=step, disable=not accelerator.is_local_main_process, desc="student"
    )
    stop = cfg.max_steps is not None and step >= cfg.max_steps
    error, gone = "", None
    anyone_backlogged = False  # in the previous iteration: decides whether a rank may wait for samples
    # The most unacked samples the teachers let this rank hold (a micro-batch cannot grow beyond it).
    credit = run.transport.credit_samples * len(run.transport.connect) if cfg.mode == "stream" else None
    last_ckpt = step
    counts = {"stale": 0, "duplicates": 0}

    def backward(batch: Batch, weight: float, sync: bool):
        # DDP all-reduces gradients on a backward outside no_sync; inside, they accumulate locally.
        ctx = contextlib.nullcontext() if sync else accelerator.no_sync(model)
        with ctx:
            with accelerator.autocast():
                loss, terms = compute_loss(model, head, batch, cfg, teacher_last)
            accelerator.backward(loss * weight)
        return loss.detach(), terms

    def gather_ctl(t: torch.Tensor) -> torch.Tensor:
        """All-gather a small int64 CPU tensor (same length on every rank) -> [world, len]."""
        if world == 1:
            return t.view(1, -1)
        if ctl_group is None:
            return accelerator.gather(t.to(device)).cpu().view(world, -1)
        out = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(out, t, group=ctl_group)
        return torch.stack(out)

    def publish(everything: bool = False) -> None:
        """Turn finished steps' metrics into ledger records, progress and log lines, in step order."""
        nonlocal t_log, tok_log, smp_log
        while in_flight and (
            everything or len(in_flight) > 1 or in_flight[0][2] is None or in_flight[0][2].query()
        ):
            _, tot, event, rec = in_flight.popleft()
            if event is not None:
                event.synchronize()
            n_tok = rec["tokens"] or 1.0
            rec["loss"] = float(tot[len(TERMS)]) / n_tok
            rec.update({k: float(tot[i]) / n_tok for i, k in enumerate(TERMS) if getattr(cfg.losses, k) > 0})
            rec["wait_s"] = float(tot[-1]) / world
            ledger.history.append(rec)
            tok_log += rec["tokens"]
            smp_log += rec["samples"]
            bar.set_postfix(loss=f"{rec['loss']:.4f}")
            if rec["step"] % cfg.log_every == 0:
                dt = max(time.perf_counter() - t_log, 1e-9)
                terms_txt = " ".join(f"{k}={rec[k]:.4f}" for k in TERMS if k in rec)
                logger.info(
                    "step %d loss=%.4f %s | %.1f samples/s %.0f tokens/s | waiting for teacher %.2fs/step",
                    rec["step"],
                    rec["loss"],
                    terms_txt,
                    smp_log / dt,
                    tok_log / dt,
                    rec["wait_s"],
                )
                t_log, tok_log, smp_log = time.perf_counter(), 0.0, 0.0
            if cfg.trackers:
                accelerator.log(
                    {f"train/{k}": v for k, v in rec.items() if k not in ("step", "time")}, step=rec["step"]
                )

    def checkpoint() -> None:
        """Collective: save, then tell the teacher that everything acked so far is covered.

        Without a step since the last checkpoint (or the resumed one), that checkpoint already
        covers every key acked since (only keys of completed steps are acked): commit only, and
        never write into the folder `latest` points at."""
        nonlocal last_ckpt
        publish(everything=True)  # the ledger's history is saved with the checkpoint
        if step > last_ckpt:
            save_checkpoint(accelerator, ledger, ckpt_dir, step, cfg.checkpoint_keep, per_node)
            last_ckpt = step
            progress.update(ckpt=str(ckpt_dir / f"step_{step:07d}"), ckpt_samples=len(ledger.trained))
        source.commit()  # every rank passed save_checkpoint's final barrier: the save is complete

    try:
        while not stop:
            # 1. Every rank fills a micro-batch from its own source. It waits (up to idle_flush_s)
            #    unless some rank had a backlog last time; then it goes with what has arrived.
            samples, batch, code = [], None, 0
            try:
                held = len(pending) + len(dup_wait)  # unacked samples outside the batch
                samples = next_micro_batch(
                    source, batcher, idle_wait_s(cfg.idle_flush_s, anyone_backlogged), held, credit
                )
                for s in samples:
                    check_sample(s, layer_ids, teacher_hidden)
                if samples:
                    # Copy first, then ask whether the memory was still the sample's (a shared-memory
                    # slot is reused once the teacher declared this student gone): stale samples are
                    # discarded, not acked; the teacher sends them again.
                    batch = collate(samples, layer_ids, pin_memory=pin, pad_to_multiple_of=pad_to)
                    ok = [source.valid(s) for s in samples]
                    if not all(ok):
                        source.discard([s for s, v in zip(samples, ok, strict=True) if not v])
                        counts["stale"] += ok.count(False)
                        keep = [i for i, v in enumerate(ok) if v]
                        samples = [samples[i] for i in keep]
                        batch = select(batch, keep) if keep else None
            except TeacherGoneError as e:
                error, code, samples, batch = str(e), 2, [], None
            except StudentError as e:
                error, code, samples, batch = str(e), 1, [], None
            done_here = source.exhausted and not batcher.pending
            idle_here = source.draining and not batcher.pending and not samples and micro == 0
            uncommitted = cfg.checkpoint_every > 0 and source.uncommitted > 0

            # 2. Agree (collective 1): samples proposed, finished, failed, idle, uncommitted acks,
            #    backlog, END heard.
            ended = int(source.run_ended)
            info = [len(samples), done_here, code, idle_here, uncommitted, batcher.filled, ended]
            info = gather_ctl(torch.tensor(info, dtype=torch.int64))
            if int(info[:, 6].max()) > 0:
                # Some rank heard END: every teacher has every key committed, so the run is complete.
                # A rank that missed it (its host was away when END was sent) holds only copies of
                # committed keys: it drops them and stops with the others instead of waiting for a
                # teacher that has left.
                if samples:
                    source.discard(samples)
                    counts["stale"] += len(samples)
                samples, batch, code = [], None, 0
                info[:, 0] = 0
                info[:, 1] = 1
                info[:, 2] = 0
            if int(info[:, 2].max()) > 0:
                if int(info[:, 2].max()) == 2:
                    gone = error or "another rank heard nothing from the teacher"
                    break
                raise StudentError(error or "another rank stopped with an error (see its message above)")
            all_done = int(info[:, 1].sum()) == world
            n_max = int(info[:, 0].max())
            anyone_backlogged = int(info[:, 5].sum()) > 0

            # 3. Agree on keys (collective 2, only when some rank has samples): each rank's key
            #    hashes and token counts; every rank computes the same decision (`agree`).
            tokens_per_rank = [0] * world
            samples_per_rank = [0] * world
            if n_max:
                vec = torch.zeros(2 * n_max, dtype=torch.int64)
                vec[: len(samples)] = torch.tensor([key_hash(s.key) for s in samples], dtype=torch.int64)
                vec[n_max : n_max + len(samples)] = torch.tensor([s.num_tokens for s in samples])
                allv = gather_ctl(vec)
                proposals = [allv[r, : int(info[r, 0])].tolist() for r in range(world)]
                keep_all = agree(proposals, (trained_h, claimed_h))
                for r in range(world):
                    kept = [i for i, k in enumerate(keep_all[r]) if k]
                    tokens_per_rank[r] = int(allv[r, n_max:][kept].sum()) if kept else 0
                    samples_per_rank[r] = len(kept)
                    claimed_h.update(proposals[r][i] for i in kept)
                mine = keep_all[rank]
                if not all(mine):
                    dup_wait.extend(s for s, k in zip(samples, mine, strict=True) if not k)
                    counts["duplicates"] += mine.count(False)
                    keep = [i for i, k in enumerate(mine) if k]
                    samples = [samples[i] for i in keep]
                    batch = select(batch, keep) if keep else None
            tokens, global_tokens = tokens_per_rank[rank], sum(tokens_per_rank)
            any_data = global_tokens > 0

            # 4. Forward/backward. Each rank's loss is weighted by its share of the step's tokens, so
            #    DDP's mean over ranks is the token-weighted mean; a rank without data weighs 0.
            if any_data:
                if batch is None:
                    batch = empty_batch(layer_ids, teacher_hidden)
                boundary = micro + 1 >= cfg.grad_accum_steps
                weight = tokens * world / global_tokens
                loss, terms = backward(batch.to(device), weight, sync=boundary)
                synced = boundary
                micro += 1
                pending.extend(samples)
                if tokens:  # device-side sums: no host synchronisation here
                    zero = loss.new_zeros(())
                    acc += torch.stack([terms.get(k, zero) for k in TERMS] + [loss]).double() * tokens
                step_tokens += global_tokens
                step_samples += sum(samples_per_rank)

            # 5. Optimizer step: after grad_accum_steps micro-batches, or earlier when no rank had data
            #    (idle teacher, end of stream): holding samples unacked would starve the teacher's credit.
            if micro and (micro >= cfg.grad_accum_steps or not any_data or all_done):
                if not synced:  # the last backward was local: a zero-weight synced one all-reduces the sum
                    backward(empty_batch(layer_ids, teacher_hidden).to(device), 0.0, sync=True)
                if micro > 1:  # mean over micro-batches
                    torch._foreach_div_([p.grad for p in model.parameters() if p.grad is not None], micro)
                if cfg.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                # Only now may the teacher forget these samples (and the duplicates this rank
                # dropped): the step that used them is done.
                source.ack(pending + dup_wait)
                ledger.record([s.key for s in pending], rank, step)
                trained_h |= claimed_h
                claimed_h.clear()
                progress["trained"] = len(trained_h)
                pending, dup_wait, micro, synced = [], [], 0, True

                # Metrics: global token-weighted means (one all-reduce per step, queued on the device;
                # the host reads them a step later, in `publish`).
                wait = source.wait_s - wait_mark
                wait_mark = source.wait_s
                # (torch.full: a fill on the device; copying a host tensor would synchronise)
                tot = torch.cat([acc, torch.full((1,), wait, dtype=torch.float64, device=device)])
                tot = accelerator.reduce(tot, "sum") if world > 1 else tot
                event = None
                if on_gpu:
                    tot = tot.to("cpu", non_blocking=True)
                    event = torch.cuda.Event()
                    event.record()
                rec = {"step": step, "samples": step_samples, "tokens": step_tokens}
                rec.update(lr=scheduler.get_last_lr()[0], time=time.time())
                in_flight.append((step, tot, event, rec))
                ledger.step = step
                acc = torch.zeros_like(acc)
                step_tokens = step_samples = 0
                bar.update(1)
                publish()
                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                    checkpoint()
                if cfg.max_steps is not None and step >= cfg.max_steps:
                    break
            if micro == 0 and dup_wait:
                # Nothing is accumulated: every key in trained_h is covered by a completed step.
                source.ack(dup_wait)
                dup_wait = []
            # Drain checkpoint: every rank idle with the teacher draining, and acks that no
            # checkpoint covers yet: the teacher sends END only once everything is committed.
            if (
                cfg.checkpoint_every
                and int(info[:, 3].sum()) == world
                and int(info[:, 4].sum()) > 0
                and not all_done
            ):
                logger.info("teacher draining: checkpoint at step %d to commit what was acknowledged", step)
                checkpoint()
            elif cfg.checkpoint_every and idle_here and step == last_ckpt:
                # No step since the last checkpoint: it covers everything acked here, including
                # redelivered copies of trained keys the Subscriber acked by itself (not counted in
                # `uncommitted`). Local and cheap: nothing is sent when there is nothing to commit.
                source.commit()
            if all_done:
                break
        publish(everything=True)  # every step's record in the ledger before it is saved
        # Stopping for good (max_steps, end of stream): a checkpoint covers every trained step, so
        # the teacher can record everything acked as done (a resumed run would skip nothing else).
        if cfg.checkpoint_every and gone is None:
            checkpoint()
        if gone is not None:
            if cfg.checkpoint_every and step > last_ckpt:  # saved, not committed: no teacher to tell
                save_checkpoint(accelerator, ledger, ckpt_dir, step, cfg.checkpoint_keep, per_node)
            raise TeacherGoneError(gone_message(gone, len(trained_h), cfg, run, args))
    except BaseException:
        source.close()  # says BYE: the teacher redelivers what this rank held, at once
        raise
    finally:
        bar.close()  # before any error message, so it starts on a line of its own
    if counts["stale"] or counts["duplicates"]:
        logger.info(
            "rank %d dropped %d stale and %d duplicate samples (not trained)",
            rank,
            counts["stale"],
            counts["duplicates"],
        )

    # --- the end: unacked samples go back to the teacher, the student is saved ---
    source.close()
    ledger.merge(flatten(gather_object([ledger.local])))
    source_stats = gather_object(
        [{**source.stats(), "dropped_stale": counts["stale"], "dropped_duplicates": counts["duplicates"]}]
    )  # one dict per rank
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        final = out_dir / "model"
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.student.save_pretrained(final)
        unwrapped.save_projections(final)
        copy_tokenizer(cfg, final)
        write_metrics(out_dir / "metrics.json", ledger, world, source_stats)
        logger.info("saved the student to %s (%d steps, %d samples)", final, step, len(ledger.trained))
    # Leave together: a rank that destroys the process group while the main one is still saving
    # can leave the main one hanging at exit (seen with gloo).
    accelerator.wait_for_everyone()
    accelerator.end_training()
    # Returned so that the caller holds them until it exits: freeing the DDP model here would
    # destroy gloo's process group, which can deadlock (see main()).
    return accelerator, model, optimizer


def gone_message(why: str, trained: int, cfg: StudentConfig, run, args) -> str:
    """The one line a student prints when its teacher is gone (exit code 3)."""
    conf = args.config
    latest = Path(cfg.ckpt_dir) / "latest"
    ckpt = (
        f"checkpoint {Path(cfg.ckpt_dir) / latest.read_text().strip()}"
        if latest.is_file()
        else "no checkpoint"
    )
    return (
        f"{why}; trained {trained} samples ({ckpt}); the rest is with the teacher: its spool folder "
        f"{run.spool.dir} and the rows its journal does not list; to finish the job restart the teacher "
        f"(`distill-teacher --config {conf}`), then the students with your launch command and "
        f"resume_from: latest (`accelerate launch student.py --config {conf} --set student.resume_from=latest`)"
    )


def restart_command(args) -> str:
    sets = "".join(f" --set {s}" for s in args.set if not s.startswith("student.resume_from="))
    return (
        f"accelerate launch <the same launch options> student.py --config {args.config}{sets} "
        f"--set student.resume_from=latest"
    )


def peer_lost_message(exc: BaseException) -> str:
    """The one line a surviving rank prints when another rank is gone (exit code 4)."""
    peers, rank, cfg, prog = _RUN["peers"], _RUN["rank"], _RUN["cfg"], _RUN["progress"]
    ckpt = (
        f"{prog['ckpt_samples']} of them in checkpoint {prog['ckpt']}"
        if prog["ckpt"]
        else "none in a checkpoint" + ("" if cfg.checkpoint_every else " (student.checkpoint_every is 0)")
    )
    return (
        f"rank {rank}: lost {peers.gone(exc, rank)}: {first_line(exc)}; this job trained "
        f"{prog['trained']} samples, {ckpt}; the teacher sends the rest again: restart the students on "
        f"every node with `{restart_command(_RUN['args'])}`"
    )


def flatten(gathered: list) -> list:
    """gather_object([entries]) returns one entry list per rank; concatenate them."""
    return [e for per_rank in gathered for e in per_rank]


def save_checkpoint(
    accelerator: Accelerator, ledger: Ledger, ckpt_dir: Path, step: int, keep: int, per_node: bool = False
) -> None:
    """save_state (model, optimizer, RNG, scheduler, ledger), mark the folder complete and point
    `latest` at it atomically. per_node: no shared storage; every node's local main process saves
    the model, optimizer and ledger (save_on_each_node), marks, points and prunes on its node."""
    ledger.merge(flatten(gather_object([ledger.local])))  # every rank now holds every rank's keys
    path = ckpt_dir / f"step_{step:07d}"
    accelerator.save_state(str(path))
    accelerator.wait_for_everyone()
    if accelerator.is_local_main_process if per_node else accelerator.is_main_process:
        (path / COMPLETE).write_text("")  # every rank's files are in (the barrier above)
        tmp = ckpt_dir / ".latest.tmp"
        tmp.write_text(path.name)
        os.replace(tmp, ckpt_dir / "latest")
        logger.info("checkpoint %s (%d samples in the ledger)", path, len(ledger.trained))
        if keep:  # only after `latest` points at the new one
            for old in sorted(ckpt_dir.glob("step_*"))[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def copy_tokenizer(cfg: StudentConfig, dest: Path) -> None:
    """Copy tokenizer files from the student checkpoint, else the teacher's (ids come from it)."""
    for src in (cfg.model, cfg.teacher_model):
        if src is None:
            continue
        files = [
            p
            for p in Path(src).glob("*")
            if p.name.startswith(("tokenizer", "special_tokens", "vocab", "merges"))
        ]
        if files:
            for p in files:
                shutil.copy(p, dest / p.name)
            return


def write_metrics(path: Path, ledger: Ledger, world: int, source_stats: list[dict]) -> None:
    """metrics.json: a summary, one record per optimizer step, and every trained (key, rank, step)."""
    hist = ledger.history
    first = [h["loss"] for h in hist[: max(1, len(hist) // 10)]]
    last = [h["loss"] for h in hist[-max(1, len(hist) // 10) :]]
    summary = {
        "steps": ledger.step,
        "samples": len(ledger.trained),
        "tokens": sum(h["tokens"] for h in hist),
        "wait_s": sum(h["wait_s"] for h in hist),
        "loss_first": sum(first) / len(first) if hist else math.nan,
        "loss_last": sum(last) / len(last) if hist else math.nan,
        "world_size": world,
        "source_stats": source_stats,  # per rank: the Subscriber's counters (empty for spool)
    }
    data = {"summary": summary, "steps": hist, "trained": ledger.trained}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Distillation student (run under `accelerate launch`).")
    parser.add_argument("--config", required=True, help="run file (YAML) with a student section")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. student.lr=3e-4"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    code = 0
    try:
        cfg, run = load_student_config(args.config, args.set)
        keep_alive = training_function(cfg, run, args)  # noqa: F841 (held until os._exit)
    except TeacherGoneError as e:
        # Every rank stops with code 3; only the main one says why, in one line.
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"student stopped: {e}", file=sys.stderr, flush=True)
        keep_alive = e  # noqa: F841
        code = 3
    except (ConfigError, StudentError) as e:
        print(f"student error: {e}", file=sys.stderr, flush=True)
        keep_alive = e  # noqa: F841 (its traceback holds the training frame's objects)
        code = 2
    except Exception as e:
        # A collective failed because another rank (node) is gone: one line on every surviving
        # rank, exit 4; the documented restart finishes the job. Anything else: a traceback.
        if not (_RUN.get("world", 1) > 1 and is_peer_failure(e)):
            raise
        print(f"student stopped: {peer_lost_message(e)}", file=sys.stderr, flush=True)
        keep_alive = e  # noqa: F841
        code = EXIT_PEER_LOST
    # Leave without the interpreter's teardown. Freeing the DDP model destroys gloo's process group,
    # whose destructor joins worker threads while holding the GIL; a worker that needs the GIL to
    # release a tensor then deadlocks it (seen in CI: ~ProcessGroupGloo -> thread::join, worker in
    # gil_scoped_acquire). Everything is saved and every rank passed the final barrier by now.
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)

"""Student worker: distil a transformers causal LM from a teacher's hidden states, under Accelerate.

    accelerate launch student.py --config configs/student_tiny.yaml [--set student.max_steps=50]
    # CPU, several processes: accelerate launch --multi_gpu --num_processes 2 student.py --config ...

`main` -> `run` (config, training, the one line and exit code of a stopped run) ->
`training_function`: `setup` (Accelerator, model, optimizer, resume, source), then the loop
(student/loop.py: one collective micro-step per iteration; acks after the optimizer step, commits
after checkpoints), then `Trainer.finish` (the final save). Samples are acknowledged to the teacher
only after the optimizer step that used them; with checkpoints they are committed after the
checkpoint that covers them; the ledger of trained keys is checkpointed with the model.

Exit codes: 0 done; 2 a user error (one line: `student error: ...`); 3 the teacher is gone (one line
on rank 0 that says how to finish); 4 a peer rank (another node) is gone (one line on every
surviving rank).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator, DistributedDataParallelKwargs, InitProcessGroupKwargs
from accelerate.logging import get_logger
from accelerate.utils import ProjectConfiguration, gather_object, set_seed
from tqdm.auto import tqdm
from transformers import get_scheduler

from distill.checkpoint_layout import latest
from distill.config import RunFile
from distill.errors import ConfigError, TeacherGone
from student.checkpoint import load_checkpoint, probe_storage, resolve_resume
from student.config import StudentConfig, load_student_config
from student.errors import StudentError
from student.exporter import StudentMetrics
from student.ledger import Ledger
from student.loop import Progress, Trainer
from student.metrics import write_exit
from student.multinode import PeerTable, first_line, is_peer_failure, local_address, set_gloo_ifname
from student.recipes import recipe_for
from student.recipes.base import build_optimizer
from student.sources import SpoolSource, StreamSource

logger = get_logger(__name__)
EXIT_USER_ERROR, EXIT_TEACHER_GONE, EXIT_PEER_LOST = 2, 3, 4


def make_accelerator(cfg: StudentConfig) -> tuple[Accelerator, DistributedDataParallelKwargs]:
    # cpu=True on a machine without CUDA is what makes `--multi_gpu --num_processes N` join a gloo
    # group (student/README.md). DDP's find_unused_parameters is set once the model is known.
    ddp_kwargs = DistributedDataParallelKwargs(find_unused_parameters=True)
    # Multi-node: gloo binds to the interface of the route to the main process unless
    # GLOO_SOCKET_IFNAME says otherwise (the hostname may resolve to 127.0.0.1).
    if os.environ.get("LOCAL_RANK", "0") == "0":
        set_gloo_ifname(lambda m: print(f"student: {m}", file=sys.stderr, flush=True))
    else:
        set_gloo_ifname(lambda m: None)
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),
        mixed_precision=cfg.mixed_precision,
        log_with=list(cfg.trackers) or None,
        project_config=ProjectConfiguration(project_dir=cfg.output_dir),
        kwargs_handlers=[
            ddp_kwargs,
            InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.collective_timeout_s)),
        ],
    )
    return accelerator, ddp_kwargs


def training_function(cfg: StudentConfig, run: RunFile, progress: Progress | None = None):
    """Train to the end (or max_steps). Returns what the caller must hold until it exits: freeing
    the DDP model here would destroy gloo's process group, which can deadlock (see main())."""
    progress = progress if progress is not None else Progress()
    accelerator, ddp_kwargs = make_accelerator(cfg)
    world = accelerator.num_processes
    # Who is where: the line a surviving rank prints names the host that is gone.
    me = (accelerator.process_index, socket.gethostname(), local_address())
    peers = PeerTable(gather_object([me]) if world > 1 else [me])
    progress.world, progress.rank, progress.peers = world, accelerator.process_index, peers
    # The loop's control collectives (flags, key hashes) carry a few integers: on a GPU they go
    # through a gloo group on the CPU, so that agreeing on the next micro-batch never waits for
    # the GPU to finish the current step (an NCCL gather read back with .cpu() would).
    on_gpu = accelerator.device.type != "cpu"
    timeout = timedelta(seconds=cfg.collective_timeout_s)
    ctl_group = dist.new_group(backend="gloo", timeout=timeout) if on_gpu and world > 1 else None
    set_seed(cfg.seed)
    trainer = setup(accelerator, ddp_kwargs, cfg, run, progress, ctl_group)
    try:
        trainer.run()
    except BaseException:
        trainer.source.close()  # says BYE: the teacher redelivers what this rank held, at once
        raise
    finally:
        trainer.bar.close()  # before any error message, so it starts on a line of its own
    trainer.finish()
    return accelerator, trainer.model, trainer.optimizer


def setup(
    accelerator: Accelerator, ddp_kwargs, cfg: StudentConfig, run: RunFile, progress: Progress, ctl_group
):
    """Checkpoint storage, model, optimizer, the resumed state, this rank's source: a Trainer."""
    rank, world = accelerator.process_index, accelerator.num_processes
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
    built = recipe_for(cfg).build(cfg, accelerator.device)
    ddp_kwargs.find_unused_parameters = (
        cfg.find_unused_parameters
        if cfg.find_unused_parameters is not None
        else built.recipe.unused_parameters(cfg, built.model)
    )
    if accelerator.device.type != "cpu":
        torch.backends.cuda.enable_cudnn_sdp(cfg.cudnn_attention)
    optimizer = build_optimizer(cfg, built.model.parameters())
    scheduler = get_scheduler(
        cfg.lr_schedule if cfg.warmup_steps == 0 or cfg.lr_schedule != "constant" else "constant_with_warmup",
        optimizer,
        num_warmup_steps=cfg.warmup_steps,
        num_training_steps=cfg.max_steps or 0,
    )
    model, optimizer = accelerator.prepare(built.model, optimizer)
    # The scheduler is not prepared: Accelerate's wrapper steps it num_processes times per optimizer
    # step (it assumes a sharded dataloader). We step it by hand once per step and checkpoint it.
    accelerator.register_for_checkpointing(scheduler)
    ledger = resume(accelerator, cfg, progress)
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
    # This rank's share of the stream or of the spool folder. With checkpoints, an ack only returns
    # credit; the teacher records a key as done (COMMIT) once a checkpoint covers it. Without, every
    # ack is also a commit.
    if cfg.mode == "spool":
        source = SpoolSource(cfg.spool_dir or run.spool.dir, rank, world, ledger.keys(), cfg.spool_layers)
    else:
        source = StreamSource(run.transport, ledger.keys(), commit_on_ack=cfg.checkpoint_every == 0)
    # The most unacked samples the teachers let this rank hold (a micro-batch cannot grow beyond it).
    credit = source.credit_window
    bar = tqdm(
        total=cfg.max_steps,
        initial=ledger.step,
        disable=not accelerator.is_local_main_process,
        desc="student",
    )
    trainer = Trainer(
        accelerator, cfg, built, model, optimizer, scheduler, ledger, source,
        credit=credit, ctl_group=ctl_group, ckpt_dir=ckpt_dir, per_node=per_node, progress=progress, bar=bar,
    )  # fmt: skip
    if progress.exporter is not None:
        progress.exporter.trainer = trainer  # the endpoint reads its counters from here on
    return trainer


def resume(accelerator: Accelerator, cfg: StudentConfig, progress: Progress) -> Ledger:
    """The ledger (and, loaded into the prepared objects, the state) of the checkpoint this run
    resumes from; an empty ledger for a fresh start. Collective when world > 1."""
    ledger = Ledger()
    where = [f"{h} ({a})" for _, h, a in progress.peers.entries]
    folder = resolve_resume(cfg, accelerator.process_index, accelerator.num_processes, where)
    if folder is not None:
        load_checkpoint(accelerator, ledger, folder)
        progress.ckpt, progress.ckpt_samples = str(folder), len(ledger)
        if accelerator.is_local_main_process:  # one line per node: each may read its own storage
            logger.info(
                "resumed from %s at step %d (%d samples trained)",
                folder,
                ledger.step,
                len(ledger),
                main_process_only=False,
            )
    if cfg.max_steps is not None and ledger.step >= cfg.max_steps:
        logger.info("checkpoint is already at max_steps=%d", cfg.max_steps)
    return ledger


# --- the one line of a stopped run ----------------------------------------------------------------


def gone_message(why: str, trained: int, cfg: StudentConfig, run: RunFile, config: str) -> str:
    """The one line a student prints when its teacher is gone (exit code 3)."""
    folder = latest(cfg.ckpt_dir)
    ckpt = f"checkpoint {folder}" if folder is not None else "no checkpoint"
    return (
        f"{why}; trained {trained} samples ({ckpt}); the rest is with the teacher: its spool folder "
        f"{run.spool.dir} and the rows its journal does not list; to finish the job restart the teacher "
        f"(`distill-teacher --config {config}`), then the students with your launch command and "
        f"resume_from: latest (`accelerate launch student.py --config {config} --set student.resume_from=latest`)"
    )


def restart_command(config: str, sets: list[str]) -> str:
    kept = "".join(f" --set {s}" for s in sets if not s.startswith("student.resume_from="))
    return (
        f"accelerate launch <the same launch options> student.py --config {config}{kept} "
        f"--set student.resume_from=latest"
    )


def peer_lost_message(exc: BaseException, progress: Progress, cfg: StudentConfig, restart: str) -> str:
    """The one line a surviving rank prints when another rank is gone (exit code 4)."""
    ckpt = (
        f"{progress.ckpt_samples} of them in checkpoint {progress.ckpt}"
        if progress.ckpt
        else "none in a checkpoint" + ("" if cfg.checkpoint_every else " (student.checkpoint_every is 0)")
    )
    return (
        f"rank {progress.rank}: lost {progress.peers.gone(exc, progress.rank)}: {first_line(exc)}; this job "
        f"trained {progress.trained} samples, {ckpt}; the teacher sends the rest again: restart the "
        f"students on every node with `{restart}`"
    )


# --- entry points ---------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Distillation student (run under `accelerate launch`).")
    parser.add_argument("--config", required=True, help="run file (YAML) with a student section")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. student.lr=3e-4"
    )
    return parser.parse_args(argv)


def run(argv: list[str] | None = None, hold: list | None = None) -> int:
    """Load the config and train; returns the exit code after printing the one line of a stopped
    run (a user error, the teacher gone, a lost peer) and writing it to metrics.json (`exit_code`,
    `exit_reason`, `exit_message`). Anything else raises. Callable in-process (world 1: no process
    group); `hold` receives what must outlive the call (see main())."""
    args = parse_args(argv)
    hold = [] if hold is None else hold
    progress = Progress()
    rank = int(os.environ.get("RANK", "0"))
    cfg = None
    try:
        cfg, runfile = load_student_config(args.config, args.set)
        if cfg.metrics_port:  # before the process group: a port in use is one line, exit 2
            credit = runfile.transport.credit_window if cfg.mode == "stream" else None
            progress.exporter = StudentMetrics(cfg.metrics_port, rank, credit)
            hold.append(progress.exporter.start())
        hold.append(training_function(cfg, runfile, progress))
        return 0
    except TeacherGone as e:  # raised by the loop once every rank saved what it trained
        # Every rank stops with code 3; only the main one says why, in one line.
        trained = e.trained if e.trained is not None else progress.trained
        line = gone_message(e.why, trained, cfg, runfile, args.config)
        if rank == 0:
            say(f"student stopped: {line}")
            write_exit(cfg, progress, EXIT_TEACHER_GONE, "teacher_gone", line)
        hold.append(e)  # its traceback holds the training frame's objects
        return EXIT_TEACHER_GONE
    except (ConfigError, StudentError) as e:
        say(f"student error: {e}")
        if rank == 0 and cfg is not None:
            write_exit(cfg, progress, EXIT_USER_ERROR, getattr(e, "reason", "error"), str(e))
        hold.append(e)
        return EXIT_USER_ERROR
    except Exception as e:
        # A collective failed because another rank (node) is gone: one line on every surviving
        # rank, exit 4; the documented restart finishes the job. Anything else: a traceback.
        if not (progress.world > 1 and is_peer_failure(e)):
            raise
        restart = restart_command(args.config, args.set)
        line = peer_lost_message(e, progress, cfg, restart)
        say(f"student stopped: {line}")
        if os.environ.get("LOCAL_RANK", "0") == "0":  # rank 0 may be the one that is gone
            write_exit(cfg, progress, EXIT_PEER_LOST, "peer_lost", line)
        hold.append(e)
        return EXIT_PEER_LOST


def say(line: str) -> None:
    """Write one line to stderr in one write: the ranks share it, and print() writes the text and
    its newline apart, so two ranks' lines could run into each other."""
    sys.stderr.flush()
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # stderr replaced by something without a file
        print(line, file=sys.stderr, flush=True)
        return
    data = (line + "\n").encode("utf-8", "replace")
    while data:
        data = data[os.write(fd, data) :]


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    hold: list = []  # what training leaves behind, held until os._exit
    code = run(argv, hold)
    # Leave without the interpreter's teardown. Freeing the DDP model destroys gloo's process group,
    # whose destructor joins worker threads while holding the GIL; a worker that needs the GIL to
    # release a tensor then deadlocks it (seen in CI: ~ProcessGroupGloo -> thread::join, worker in
    # gil_scoped_acquire). Everything is saved and every rank passed the final barrier by now.
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)

"""`distill-teacher --config configs/<file>.yaml [--set section.key=value ...]`

A run is a loop of two phases; it ends when every sample of the dataset is COMMITTED by students
(trained, and with checkpointing covered by a checkpoint), or with a non-zero exit code that says
what is left and where it is.

GENERATE  rows that are neither committed (journal) nor in the spool go through vLLM with our
          connector (teacher/connector.py). Its Publisher lives in vLLM's worker process and
          streams to students (or spools when none is connected / memory is full); it never sends
          END. Keys that students lose meanwhile (their session ended without committing them:
          `!lost` records in the journal) are generated again. When the last window is done the
          engine is shut down at once (frees the GPU); its Publisher waits at most
          `teacher.drain_timeout_s` for acks and spools the rest.
SERVE     this process starts its own Publisher (auto_end=False) on the same endpoints; it replays
          the spool (files of the engine phase and of earlier runs) until every key is committed
          in the journal, then sends END, waits briefly and exits 0. Keys lost while serving
          (`Publisher.take_lost`) or missing (neither committed nor spooled nor held by anyone)
          send the loop back to GENERATE (the serve Publisher is closed first: same endpoints).
          The wait shows progress every `teacher.progress_every_s` and is bounded by
          `teacher.student_wait_s` without student progress (exit 3).

`teacher.after_generation: exit` skips SERVE: generate now, train offline later (everything not
committed is in the spool; a later `distill-teacher` with the same config serves it).

Everything that can be wrong with the config, model folder, layer ids, dataset (every row: JSON,
key, field, text, chat messages, token ids; with on_too_long=fail also the length), the journal's
lock or the endpoints is checked before vLLM is imported (one line each, exit 2).

Exit codes: 0 every sample committed (after_generation=exit: everything generated and spooled);
1 the vLLM engine died, or samples are missing (one line with counts; END is never sent); 2 config
or usage error (before vLLM starts); 3 no student progress for `teacher.student_wait_s` with
samples left (they are in the spool; the printed command finishes the job); 4 finished as 0 but
dataset rows were skipped (teacher.on_bad_row / on_too_long: skip; listed in
`<journal>.skipped.jsonl`, counted in the summary); 5 the live probe (teacher.verify_every,
verify_fail=stop; teacher/verify.py) found a delivered sample that transformers does not reproduce
(no END); 130 SIGINT/SIGTERM.
Every exit after the config check writes `teacher.summary_path` (default `<journal>.summary.json`).

How this process knows what students finished: the Publisher of the GENERATE phase lives in vLLM's
worker process, not here; the journal (committed and lost keys, appended by whichever Publisher
runs) and the spool folder are the channel back, and both are also the resume record.

Signals: SIGTERM (or SIGINT) to this process: GENERATE stops after the current window (the engine
shutdown spools what students have not acked), SERVE closes its Publisher (spools what is in
flight); exit 130. Ctrl-C in a terminal also reaches vLLM's engine processes: they stop at once and
this process reports and exits 130. A second signal aborts. Spool files are atomic (never
partial); what was not committed is served or generated again on restart.

vLLM engine death (an exception out of `llm.generate`, or the engine core process killed): vLLM's
SyncMPClient output thread exits on the engine monitor's shutdown without waking `get_output`, so
`llm.generate` would wait forever (vLLM 0.32 `core_client.py`, SyncMPClient.process_outputs_socket);
a watchdog thread here posts EngineDeadError into its queue when the monitor marks the engine dead.
"""

from __future__ import annotations

import argparse
import fcntl
import itertools
import json
import logging
import os
import shlex
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distill.config import ConfigError, SpoolConfig, TransportConfig, load_run_file, parse_override
from distill.journal import Journal, JournalTail
from distill.spool import list_spool, remove_spool_file, spool_name
from teacher.config import (
    ConnectorConfig,
    TeacherConfig,
    check_layer_ids,
    extraction_engine_args,
    load_teacher_config,
    model_config,
    model_dtype,
    model_num_layers,
)
from teacher.data import BadRow, check_dataset, iter_rows

log = logging.getLogger("distill.teacher")

EXIT_OK, EXIT_MISSING, EXIT_CONFIG, EXIT_STUDENTS_GONE, EXIT_SIGNAL = 0, 1, 2, 3, 130
EXIT_SKIPPED = 4  # finished (every usable sample committed / generated), but dataset rows were skipped
EXIT_VERIFY = 5  # the live probe found a mismatch with teacher.verify_fail=stop (no END sent)
SPOOL_MARGIN_S = 60.0  # engine shutdown: time to spool what is in memory, beyond drain_timeout_s


class Stop:
    """SIGINT/SIGTERM: the first asks to stop (after the current window / at the next check), the
    second aborts."""

    def __init__(self):
        self.requested = False

    def __call__(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        log.warning("%s: stopping (again to abort)", signal.Signals(signum).name)


def report_bad_row(bad: BadRow) -> None:
    print(f"distill-teacher: bad row: {bad.line()}", file=sys.stderr, flush=True)


def preflight(cfg: TeacherConfig) -> tuple[list[str], list[BadRow]]:
    """Checks that need no vLLM. Returns the dataset keys the run must deliver and the bad rows
    skipped (teacher.on_bad_row=skip). Raises ConfigError."""
    num_layers = model_num_layers(cfg.model)
    check_layer_ids(cfg.layer_ids, num_layers)
    length = None
    if cfg.on_too_long == "fail":  # every row tokenized now, so a long one fails before vLLM
        from teacher.data import Prompter

        prompter = Prompter(cfg)
        length = lambda row: len(prompter.token_ids(row))  # noqa: E731
    keys, bad = check_dataset(cfg, report=report_bad_row, length=length)
    if cfg.idle_timeout_s is not None:
        log.warning("teacher.idle_timeout_s is deprecated and ignored (see teacher.student_wait_s)")
    return keys, bad


def check_journal_free(path: str, wait_s: float = 10.0) -> None:
    """A second teacher on the same journal would lose committed keys: refuse before vLLM starts
    (the previous teacher's engine may still be exiting: wait up to `wait_s`)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "a") as f:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)
                return
            except OSError:
                if time.monotonic() >= deadline:
                    raise ConfigError(
                        f"teacher.journal: {path!r} is in use by another process (a teacher running "
                        "with the same journal, or distill-reconcile); give each teacher its own"
                    ) from None
                time.sleep(0.1)


def check_endpoints_free(transport: TransportConfig, wait_s: float = 3.0) -> None:
    """Bind and release every endpoint once, so a port in use fails before vLLM starts. Waits up to
    `wait_s` for it: a Publisher closed moments ago (the serve phase, before generating lost keys
    again) lets go of its listener asynchronously, after its linger."""
    import zmq

    ctx = zmq.Context()  # own context, terminated here: nothing of it survives into vLLM's forks
    deadline = time.monotonic() + wait_s
    try:
        for ep in transport.bind:
            while True:
                sock = ctx.socket(zmq.ROUTER)
                sock.setsockopt(zmq.LINGER, 0)
                try:
                    sock.bind(ep)
                    break
                except zmq.ZMQError as e:
                    if time.monotonic() >= deadline:
                        raise ConfigError(
                            f"transport.bind: cannot bind {ep!r}: {e} (another teacher on this port?)"
                        ) from None
                    time.sleep(0.2)
                finally:
                    sock.close(0)
    finally:
        ctx.term()


def build_llm(cfg: TeacherConfig, conn: ConnectorConfig):
    """The vLLM engine with extraction and our connector (spawns the engine processes)."""
    if cfg.cpu_kvcache_space_gib is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.cpu_kvcache_space_gib)
    # vLLM gives its workers VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (default 5) to exit before SIGTERM,
    # then SIGKILL: the connector's shutdown (drain_timeout_s, then spooling what is in memory) must
    # fit, or samples held in the worker's memory are lost (the serve phase would generate them again).
    need = int(cfg.drain_timeout_s + SPOOL_MARGIN_S)
    try:
        have = int(os.environ.get("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "5"))
    except ValueError:
        have = 5
    if have < need:
        os.environ["VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"] = str(need)
    from vllm import LLM

    args = dict(
        model=cfg.model,
        dtype=cfg.dtype,
        max_model_len=cfg.max_model_len,
        tensor_parallel_size=cfg.tensor_parallel_size,
        enforce_eager=cfg.enforce_eager,
        enable_chunked_prefill=False,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        load_format=cfg.load_format,
        seed=cfg.seed,
        **extraction_engine_args(cfg.layer_ids, conn.model_dump(mode="json")),
    )
    args.update(cfg.engine_args)
    return LLM(**args)


def shutdown_llm(llm, timeout_s: float) -> None:
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        try:
            core.shutdown(timeout=timeout_s)
        except TypeError:  # older vLLM: no timeout argument
            core.shutdown()


class EngineWatchdog:
    """Turns a dead engine core into an exception out of `llm.generate` instead of a hang.

    vLLM 0.32's engine monitor marks the client dead and shuts its output thread down, but that
    thread exits without posting anything, so `SyncMPClient.get_output` (a blocking queue.get)
    never returns. Every 0.5 s this checks `resources.engine_dead` and posts EngineDeadError.
    """

    def __init__(self, llm):
        self._stop = threading.Event()
        self.fired = False
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        self._res = getattr(core, "resources", None)
        self._queue = getattr(core, "outputs_queue", None)
        self._thread = None
        if self._res is not None and self._queue is not None:
            self._thread = threading.Thread(target=self._loop, name="distill-engine-watchdog", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            if getattr(self._res, "engine_dead", False):
                try:
                    from vllm.v1.engine.exceptions import EngineDeadError

                    err: Exception = EngineDeadError()
                except Exception:  # another vLLM layout
                    err = RuntimeError("vLLM engine core died")
                self.fired = True
                self._queue.put_nowait(err)
                return

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)


class EngineDied(Exception):
    """The vLLM engine failed (start or mid-run): exit 1, never END."""


class ServeFailed(Exception):
    """The serve phase could not start its Publisher: exit 1."""


@dataclass
class Run:
    """What one `distill-teacher` invocation did; written as the summary JSON."""

    cfg: TeacherConfig
    transport: TransportConfig
    spool: SpoolConfig
    keys: list[str]
    command: str
    t0: float = field(default_factory=time.monotonic)
    base_tid: str = ""
    committed_at_start: int = 0
    generated: int = 0  # samples that went through vLLM (this invocation, all rounds)
    tokens: int = 0
    nbytes: int = 0
    generate_s: float = 0.0
    too_long: set[str] = field(default_factory=set)
    bad_rows: list = field(default_factory=list)  # BadRow skipped before vLLM (on_bad_row=skip)
    truncated: int = 0  # rows cut to max_model_len - max_tokens (on_too_long=truncate)
    verifier: Any = None  # teacher.verify.Verifier when teacher.verify_every > 0
    submitted: int = 0  # requests handed to vLLM (the probe marks every verify_every-th)
    lost: int = 0  # lost records seen (keys whose student session ended uncommitted)
    regenerated: int = 0  # samples generated more than once by this invocation (lost or missing)
    generated_keys: set[str] = field(default_factory=set)
    students_max: int = 0
    phases: list[dict] = field(default_factory=list)
    interrupted: bool = False
    reason: str = ""

    @property
    def spool_dir(self) -> Path:
        return Path(self.spool.dir)

    @property
    def required(self) -> set[str]:
        return set(self.keys) - self.too_long

    def spooled_names(self) -> set[str]:
        return {p.name for p in list_spool(self.spool_dir)}

    def committed(self) -> set[str]:
        return Journal.read(self.cfg.journal).committed

    def state(self) -> dict:
        committed = self.committed() & self.required
        names = self.spooled_names()
        left = [k for k in self.required if k not in committed]
        in_spool = sum(1 for k in left if spool_name(k) in names)
        return {
            "total": len(self.required),
            "committed": len(committed),
            "not_committed": len(left),
            "spooled": in_spool,
            "missing": len(left) - in_spool,  # neither committed nor in the spool
        }

    @property
    def verify_dir(self) -> Path:
        return Path(f"{self.cfg.journal}.verify")

    def verify_stop(self) -> bool:
        return self.verifier is not None and self.verifier.failed.is_set()

    def skipped_path(self) -> Path:
        """Skipped rows of this invocation, one JSON object a line: key, where, reason."""
        return Path(f"{self.cfg.journal}.skipped.jsonl")

    def start_skipped_file(self) -> None:
        p = self.skipped_path()
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "w") as f:
            for b in self.bad_rows:
                f.write(json.dumps(b.record()) + "\n")

    def skip_too_long(self, key: str, n: int) -> None:
        self.too_long.add(key)
        limit = self.cfg.max_model_len - self.cfg.max_tokens
        reason = f"{n} prompt tokens > max_model_len - max_tokens = {limit}"
        print(f"distill-teacher: skipped row {key!r}: {reason}", file=sys.stderr, flush=True)
        with open(self.skipped_path(), "a") as f:
            f.write(json.dumps({"key": key, "where": None, "reason": reason}) + "\n")

    @property
    def skipped(self) -> int:
        return len(self.bad_rows) + len(self.too_long)

    def summary_path(self) -> Path:
        return Path(self.cfg.summary_path or f"{self.cfg.journal}.summary.json")

    def finish(self, rc: int) -> int:
        if rc == EXIT_OK and self.skipped:
            rc = EXIT_SKIPPED
            self.reason += f"; {self.skipped} rows skipped (see {self.skipped_path()})"
        st = self.state()
        elapsed = time.monotonic() - self.t0
        gen_s = max(self.generate_s, 1e-9)
        summary = {
            "exit_code": rc,
            "reason": self.reason,
            **st,
            "samples": self.generated,
            "tokens": self.tokens,
            "bytes": self.nbytes,
            "generate_s": round(self.generate_s, 3),
            "wall_s": round(elapsed, 3),
            "tokens_per_s": round(self.tokens / gen_s, 1) if self.generated else 0.0,
            "committed_at_start": self.committed_at_start,
            "lost": self.lost,
            "regenerated": self.regenerated,
            "too_long": len(self.too_long),
            "skipped": self.skipped,
            "skipped_bad_rows": len(self.bad_rows),
            "skipped_too_long": len(self.too_long),
            "truncated": self.truncated,
            "skipped_file": str(self.skipped_path()),
            "verify": (
                {"every": self.cfg.verify_every, **self.verifier.summary()}
                if self.verifier is not None
                else None
            ),
            "students_max": self.students_max,
            "interrupted": self.interrupted,
            "spool_dir": str(self.spool_dir),
            "spool_bytes": _spool_bytes(self.spool_dir),
            "journal": self.cfg.journal,
            "teacher_id": self.base_tid,
            "phases": self.phases,
            "command": self.command,
        }
        path = self.summary_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(summary, indent=1) + "\n")
            os.replace(tmp, path)
        except OSError as e:
            log.error("cannot write the summary %s: %s", path, e)
        print(
            # For humans; scripts read the summary JSON.
            f"distill-teacher: {self.generated} samples, {self.tokens} tokens, {self.nbytes / 1e9:.3f} GB "
            f"generated in {self.generate_s:.1f}s ({self.tokens / gen_s:.0f} tok/s); "
            f"committed {st['committed']}/{st['total']} after {elapsed:.1f}s, "
            f"spooled {st['spooled']} ({_spool_bytes(self.spool_dir) / 1e6:.1f} MB in {self.spool_dir}), "
            f"already done {self.committed_at_start}, skipped {self.skipped} (bad {len(self.bad_rows)}, "
            f"too long {len(self.too_long)}), truncated {self.truncated}, "
            f"lost {self.lost}, regenerated {self.regenerated}; exit {rc}; summary {path}",
            file=sys.stderr,
        )
        return rc


def run(
    cfg: TeacherConfig,
    transport: TransportConfig,
    spool: SpoolConfig,
    keys: list[str],
    command: str,
    bad_rows: list[BadRow] = (),
) -> int:
    r = Run(cfg, transport, spool, keys, command, bad_rows=list(bad_rows))
    r.start_skipped_file()
    if cfg.verify_every:
        from teacher.verify import Verifier

        dtype = cfg.dtype if cfg.dtype != "auto" else model_dtype(cfg.model)
        r.verifier = Verifier(
            cfg.model,
            r.verify_dir,
            dtype,
            tol=cfg.verify_tol,
            device=cfg.verify_device,
            fail=cfg.verify_fail,
            include_output_tokens=cfg.include_output_tokens,
        )
    r.base_tid = transport.teacher_id or f"{socket.gethostname()}-{os.getpid()}"
    r.committed_at_start = len(r.committed() & set(keys))
    stop = Stop()
    old_int = signal.signal(signal.SIGINT, stop)
    old_term = signal.signal(signal.SIGTERM, stop)
    fruitless = 0  # rounds that regenerated samples without any new commit
    try:
        rnd = 0
        regenerate = True  # round 0 generates whatever is neither committed nor spooled
        while True:
            if stop.requested:
                r.interrupted = True
                r.reason = "signal"
                return r.finish(EXIT_SIGNAL)
            committed = r.committed()
            names = r.spooled_names()
            todo = [
                k for k in keys if k not in committed and k not in r.too_long and spool_name(k) not in names
            ]
            committed_before = len(committed & r.required)
            if todo and regenerate:
                if rnd > 0:
                    log.warning("generating %d samples again (lost or missing)", len(todo))
                again = generate(r, todo, stop, rnd)
                if r.verifier is not None:
                    r.verifier.drain()  # the engine is down: every copy is written
                if r.verify_stop():
                    return verify_failed(r)
                if stop.requested:
                    r.interrupted = True
                    r.reason = "signal"
                    return r.finish(EXIT_SIGNAL)
                if again:  # keys lost while the engine shut down: generate them again first
                    rnd += 1
                    continue
            regenerate = False
            st = r.state()
            if st["not_committed"] == 0:
                if not r.phases:
                    print(
                        f"distill-teacher: nothing to do: all {st['total']} samples are committed "
                        f"in {cfg.journal}"
                        + (
                            "" if cfg.after_generation == "exit" else "; telling students the run is complete"
                        ),
                        file=sys.stderr,
                    )
                if cfg.after_generation == "exit":
                    r.reason = "done"
                    return r.finish(EXIT_OK)
                # Students of the engine phase (or of an earlier run) wait for END: the serve phase
                # sends it to every student that (re)connects within a short linger.
            if cfg.after_generation == "exit":
                r.reason = "after_generation=exit"
                if st["missing"]:
                    print(
                        f"distill-teacher: {st['missing']} samples neither committed nor spooled; "
                        f"run again to generate them: {command}",
                        file=sys.stderr,
                    )
                    return r.finish(EXIT_MISSING)
                print(
                    f"distill-teacher: generation done; {st['spooled']} samples wait in the spool "
                    f"{r.spool_dir} (after_generation: exit). Serve them to students with: {command} "
                    "--set teacher.after_generation=serve",
                    file=sys.stderr,
                )
                return r.finish(EXIT_OK)
            outcome, lost_keys = serve(r, stop, rnd)
            if outcome == "done":
                r.reason = "done"
                return r.finish(EXIT_OK)
            if outcome == "signal":
                r.interrupted = True
                r.reason = "signal"
                return r.finish(EXIT_SIGNAL)
            if outcome == "gone":
                st = r.state()
                r.reason = "students gone"
                wait = cfg.student_wait_s
                print(
                    f"distill-teacher: no student progress for {wait:.0f}s: {st['not_committed']} of "
                    f"{st['total']} samples not trained ({st['spooled']} in the spool {r.spool_dir}, "
                    f"{st['missing']} to generate). Finish the job with: {command}",
                    file=sys.stderr,
                )
                return r.finish(EXIT_STUDENTS_GONE)
            # outcome == "lost": generate them (and anything else missing) again
            log.warning("%d samples lost or missing while serving: generating them again", len(lost_keys))
            if len(r.committed() & r.required) == committed_before:
                fruitless += 1
            else:
                fruitless = 0
            if fruitless >= 3:
                st = r.state()
                r.reason = "no progress: the same samples keep getting lost"
                print(
                    f"distill-teacher: samples keep getting lost without any commit (3 rounds); "
                    f"{st['not_committed']} of {st['total']} not trained ({st['spooled']} in the spool "
                    f"{r.spool_dir}). Finish the job with: {command}",
                    file=sys.stderr,
                )
                return r.finish(EXIT_STUDENTS_GONE)
            rnd += 1
            regenerate = True
    except EngineDied as e:
        r.reason = f"engine died: {e}"
        st = r.state()
        print(
            f"distill-teacher: the vLLM engine died ({e}); {st['not_committed']} of "
            f"{st['total']} samples not committed ({st['spooled']} in the spool "
            f"{r.spool_dir}, {st['missing']} to generate); no END was sent. "
            f"Restart to finish: {command}",
            file=sys.stderr,
        )
        return r.finish(EXIT_MISSING)
    except ServeFailed as e:
        r.reason = str(e)
        st = r.state()
        print(
            f"distill-teacher: {e}; {st['not_committed']} of {st['total']} samples not committed "
            f"({st['spooled']} in the spool {r.spool_dir}). Restart to finish: {command}",
            file=sys.stderr,
        )
        return r.finish(EXIT_MISSING)
    except KeyboardInterrupt:
        r.interrupted = True
        r.reason = "aborted by a second signal"
        log.warning("aborted: samples not committed are served or generated again on restart")
        return r.finish(EXIT_SIGNAL)
    finally:
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)


def verify_failed(r: Run) -> int:
    v = r.verifier.summary()
    first = v["mismatched"][0] if v["mismatched"] else {}
    r.reason = f"verify mismatch (teacher.verify_fail=stop): {first.get('key')!r}: {first.get('problem')}"
    st = r.state()
    print(
        f"distill-teacher: the live probe found {v['mismatches']} mismatching of {v['probed']} probed "
        f"samples (first {first.get('key')!r}: {first.get('problem')}); generation stopped, no END was "
        f"sent; {st['not_committed']} of {st['total']} samples not committed",
        file=sys.stderr,
    )
    return r.finish(EXIT_VERIFY)


def generate(r: Run, todo: list[str], stop: Stop, rnd: int) -> bool:
    """GENERATE phase: run `todo` (and keys lost meanwhile) through vLLM, then shut it down.

    Returns True when keys were lost after the last window (the caller generates them again).
    Raises EngineDied when the engine failed (nothing is sent as END; the caller exits 1).
    """
    from teacher.data import Prompter

    cfg = r.cfg
    conn = ConnectorConfig(
        mode=cfg.connector_mode,
        transport=r.transport.model_copy(update={"teacher_id": f"{r.base_tid}-gen{rnd}"}),
        spool=r.spool,
        journal=cfg.journal,
        include_output_tokens=cfg.include_output_tokens,
        queue_samples=cfg.queue_samples,
        pinned_buffers=cfg.pinned_buffers,
        copy_threads=cfg.copy_threads,
        drain_timeout_s=cfg.drain_timeout_s,  # one drain setting (teacher and connector)
        verify_dir=str(r.verify_dir) if r.verifier is not None else None,
        # No caller reads the returned paths while we run: skip the per-request lock files (a file
        # create + flock + unlink on the engine step for each request); spooled files still get one.
        use_lock=False,
    )
    try:
        check_journal_free(cfg.journal)
        if cfg.connector_mode == "stream":
            check_endpoints_free(r.transport, wait_s=15.0)
    except ConfigError as e:  # free at start; taken since (another process)
        raise ServeFailed(f"cannot generate (round {rnd}): {e}") from None
    tail = JournalTail(cfg.journal)
    tail.poll()  # history: lost records of earlier runs are in `todo` already
    pending: set[str] = set(todo)
    order = {k: i for i, k in enumerate(r.keys)}
    phase = {"phase": "generate", "round": rnd, "todo": len(todo), "samples": 0, "lost": 0}
    r.phases.append(phase)
    t_phase = time.monotonic()

    def take_lost() -> None:
        _, new_lost = tail.poll()
        for k in new_lost:
            r.lost += 1
            phase["lost"] += 1
            if k in order and k not in tail.committed:
                pending.add(k)

    def rows():
        """Rows whose key is pending, in dataset order; passes again while lost keys come back."""
        while pending:
            for k, row in iter_rows(cfg):
                if k in pending:
                    pending.discard(k)
                    yield k, row

    prompter = Prompter(cfg)
    from vllm import SamplingParams

    def prepare(window):
        """Token ids and sampling params of one window (runs while the previous one generates)."""
        prompts, params, keys, n_long = [], [], [], 0
        for key, row in window:
            ids = prompter.token_ids(row)
            limit = cfg.max_model_len - cfg.max_tokens
            if len(ids) > limit:
                if cfg.on_too_long == "truncate":
                    log.warning("truncating %r: %d prompt tokens to %d", key, len(ids), limit)
                    ids = ids[:limit]
                    r.truncated += 1
                elif cfg.on_too_long == "skip":
                    n_long += 1
                    r.skip_too_long(key, len(ids))
                    continue
                else:  # fail: checked before vLLM started; the dataset changed since
                    raise ConfigError(
                        f"teacher.dataset: row {key!r}: {len(ids)} prompt tokens > max_model_len - "
                        f"max_tokens = {limit} (teacher.on_too_long=fail)"
                    )
            kv = {
                "sample_key": key,
                "meta": {"prompt_tokens": len(ids)},
                "include_output_tokens": cfg.include_output_tokens,
            }
            if r.verifier is not None and r.submitted % cfg.verify_every == 0:
                kv["verify"] = True
                r.verifier.expect(key, ids)
            r.submitted += 1
            prompts.append({"prompt_token_ids": ids})
            params.append(
                SamplingParams(
                    max_tokens=cfg.max_tokens,
                    temperature=cfg.temperature,
                    extra_args={"kv_transfer_params": kv},
                )
            )
            keys.append(key)
        return len(window), prompts, params, keys

    it = rows()

    def next_window():
        return prepare(list(itertools.islice(it, cfg.window)))

    # Find the first window with something to run before starting vLLM (rows may all be too long).
    first = next_window()
    while first[0] and not first[1]:
        first = next_window()
    if not first[0]:
        phase["seconds"] = round(time.monotonic() - t_phase, 3)
        return False

    from tqdm import tqdm

    hidden = int(model_config(cfg.model)["hidden_size"])
    dtype = cfg.dtype if cfg.dtype != "auto" else model_dtype(cfg.model)
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    bytes_per_token = len(cfg.layer_ids) * hidden * itemsize
    spool_dir = r.spool_dir
    llm = None
    watchdog = None
    dead: str | None = None
    prefetch = ThreadPoolExecutor(1, thread_name_prefix="distill-prefetch")  # next window's token ids
    bar = tqdm(total=len(todo), unit="sample", dynamic_ncols=True)
    t0 = time.monotonic()
    try:
        try:
            llm = build_llm(cfg, conn)
        except Exception as e:
            if stop.requested:
                return False
            raise EngineDied(f"engine start failed: {type(e).__name__}: {e}") from e
        watchdog = EngineWatchdog(llm)
        t0 = time.monotonic()
        nxt = None
        cur = first
        while True:
            n_rows, prompts, params, keys = cur
            if n_rows == 0:
                take_lost()
                if not pending:
                    break
                it = rows()  # lost keys came back after the last pass
                cur = next_window()
                continue
            if stop.requested or r.verify_stop():
                break
            nxt = prefetch.submit(next_window)
            try:
                outs = llm.generate(prompts, params, use_tqdm=False) if prompts else []
            except Exception as e:
                if stop.requested:
                    # Ctrl-C reached the engine processes too: they are gone (see module docstring).
                    log.warning("engine stopped by the signal (%s)", type(e).__name__)
                    break
                dead = f"{type(e).__name__}: {e}".rstrip(": ")
                break
            for key, out in zip(keys, outs, strict=True):
                n = len(out.prompt_token_ids)
                if cfg.include_output_tokens:
                    n += len(out.outputs[0].token_ids) - 1
                r.tokens += n
                r.nbytes += n * bytes_per_token
                r.generated += 1
                phase["samples"] += 1
                if key in r.generated_keys:
                    r.regenerated += 1
                else:
                    r.generated_keys.add(key)
            bar.update(n_rows)
            dt = max(time.monotonic() - t0, 1e-9)
            bar.set_postfix_str(
                f"{phase['samples'] / dt:.1f} samples/s, {r.tokens / dt:.0f} tok/s, "
                f"committed {len(tail.committed)}, spool {_spool_bytes(spool_dir) / 1e6:.1f} MB"
            )
            take_lost()
            cur = nxt.result()
            nxt = None
    except KeyboardInterrupt:
        stop.requested = True
        raise
    finally:
        bar.close()
        r.generate_s += time.monotonic() - t0
        if nxt is not None:
            nxt.cancel()
        prefetch.shutdown(wait=True, cancel_futures=True)
        if watchdog is not None:
            watchdog.close()
        if llm is not None:
            # Frees the GPU now: the serve phase needs no engine. The connector waits at most
            # drain_timeout_s for acks, then spools what is unacked.
            t_sd = time.monotonic()
            shutdown_llm(llm, timeout_s=cfg.drain_timeout_s + SPOOL_MARGIN_S + 30)
            log.info("engine shut down in %.1fs", time.monotonic() - t_sd)
            del llm
        phase["seconds"] = round(time.monotonic() - t_phase, 3)
    if dead is not None:
        raise EngineDied(dead)
    # Lost while the engine shut down (or just before): generate those again.
    take_lost()
    # (Every spool file got its `<file>.lock` from distill.spool.write_sample.)
    return bool(pending) and not stop.requested


def serve(r: Run, stop: Stop, rnd: int) -> tuple[str, set[str]]:
    """SERVE phase: replay the spool to students until every required key is committed.

    Returns ("done" | "lost" | "gone" | "signal", keys to generate again).
    """
    from distill.transport import Publisher

    cfg = r.cfg
    transport = r.transport.model_copy(update={"teacher_id": f"{r.base_tid}-serve{rnd}"})
    phase = {"phase": "serve", "round": rnd, "served": 0, "lost": 0}
    r.phases.append(phase)
    t_phase = time.monotonic()
    required = r.required
    tail = JournalTail(cfg.journal)
    tail.poll()
    committed0 = len(tail.committed & required)
    if not r.spool.keep:
        # Spool files of committed keys (a crash between the commit and the unlink) are delivered:
        # remove them rather than replay them (students would only skip them).
        names = r.spooled_names()
        for k in tail.committed & required:
            f = r.spool_dir / spool_name(k)
            if f.name in names:
                remove_spool_file(f)
    pub = Publisher(transport, r.spool, journal=cfg.journal, auto_end=False)
    try:
        pub.start()
    except Exception as e:
        raise ServeFailed(f"cannot start the serve Publisher on {transport.bind}: {e}") from e
    lost: set[str] = set()
    outcome = "gone"
    grace = max(5.0, 2 * transport.heartbeat_timeout_s)
    try:
        pub.close_input()
        now = time.monotonic()
        last_progress = now
        last_print = now - cfg.progress_every_s  # a first line at once
        last_rate = (now, committed0)
        last_marks = None
        idle_missing_since = None
        while True:
            time.sleep(0.2)
            now = time.monotonic()
            if stop.requested:
                outcome = "signal"
                break
            tail.poll()
            committed = tail.committed & required
            left = len(required) - len(committed)
            st = pub.stats()
            students = int(st.get("students", 0))
            r.students_max = max(r.students_max, students)
            for k in pub.take_lost():
                r.lost += 1
                phase["lost"] += 1
                if k in required and k not in committed:
                    lost.add(k)
            lost -= committed
            marks = (len(committed), st.get("acked", 0), st.get("sent", 0), st.get("committed", 0), students)
            if marks != last_marks:
                if last_marks is None or marks[:4] != last_marks[:4] or students > last_marks[4]:
                    last_progress = now
                last_marks = marks
            if now - last_print >= cfg.progress_every_s:
                t_prev, c_prev = last_rate
                rate = (len(committed) - c_prev) / max(now - t_prev, 1e-9)
                last_rate = (now, len(committed))
                last_print = now
                waiting = f", no progress for {now - last_progress:.0f}s" if now - last_progress > 10 else ""
                print(
                    f"distill-teacher: serving: committed {len(committed)}/{len(required)}, "
                    f"in spool {len(list_spool(r.spool_dir))}, in flight {st.get('inflight', 0)}, "
                    f"students {students}, {rate:.1f} samples/s{waiting}",
                    file=sys.stderr,
                    flush=True,
                )
            if left == 0:
                outcome = "done"
                break
            idle = not (st.get("pending", 0) or st.get("inflight", 0) or st.get("spool_files", 0))
            if lost and idle:
                outcome = "lost"
                break
            if idle and not st.get("uncommitted", 0) and not lost:
                names = r.spooled_names()
                missing = {k for k in required - committed if spool_name(k) not in names}
                if missing:
                    idle_missing_since = idle_missing_since or now
                    if now - idle_missing_since > grace:
                        log.warning(
                            "%d samples are neither committed nor spooled nor held by a student; "
                            "generating them again",
                            len(missing),
                        )
                        lost |= missing
                        outcome = "lost"
                        break
                else:
                    idle_missing_since = None
            else:
                idle_missing_since = None
            if cfg.student_wait_s and now - last_progress > cfg.student_wait_s:
                outcome = "gone"
                break
        if outcome == "done":
            pub.end()  # END goes out once nothing is waiting or in flight
            end_wait = max(10.0, 2 * transport.heartbeat_timeout_s)
            if pub.wait_done(timeout=end_wait):
                # Students of the engine's Publisher (closed moments ago) reconnect within a few
                # heartbeats (RESET -> HELLO); each gets END on arrival. Then END must reach them.
                linger = max(3.0, 4 * transport.heartbeat_interval_s)
                t_end = time.monotonic()
                while time.monotonic() - t_end < linger and not stop.requested:
                    time.sleep(0.1)
            else:
                st = pub.stats()
                log.warning(
                    "every sample is committed, but END was not sent within %.0fs (%d spool files of "
                    "keys outside this dataset still wait, %d in flight): students may wait for a "
                    "teacher until their transport.teacher_wait_s",
                    end_wait,
                    st.get("spool_files", 0) + st.get("pending", 0),
                    st.get("inflight", 0),
                )
    except KeyboardInterrupt:
        outcome = "signal"
        raise
    finally:
        pub.close()
        tail.poll()
        phase["served"] = len(tail.committed & required) - committed0
        phase["seconds"] = round(time.monotonic() - t_phase, 3)
        phase["outcome"] = outcome
    return outcome, lost


def _spool_bytes(d: Path) -> int:
    total = 0
    for p in list_spool(d):
        try:
            total += p.stat().st_size
        except FileNotFoundError:
            pass
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="distill-teacher", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="YAML run file (teacher, transport, spool sections)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. teacher.max_samples=8"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    command = shlex.join(
        [
            "distill-teacher",
            "--config",
            args.config,
            *itertools.chain.from_iterable(("--set", s) for s in args.set),
        ]
    )
    try:
        overrides = dict(parse_override(s) for s in args.set)
        runfile = load_run_file(args.config, overrides)
        cfg = load_teacher_config(runfile.teacher)
        keys, bad_rows = preflight(cfg)
        check_journal_free(cfg.journal)
        if cfg.connector_mode == "stream" or cfg.after_generation == "serve":
            check_endpoints_free(runfile.transport)
    except ConfigError as e:
        print(f"distill-teacher: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        return run(cfg, runfile.transport, runfile.spool, keys, command, bad_rows)
    except ConfigError as e:
        print(f"distill-teacher: error: {e}", file=sys.stderr)
        return EXIT_CONFIG


if __name__ == "__main__":  # vLLM spawns its engine processes: keep the entry point guarded
    sys.exit(main())

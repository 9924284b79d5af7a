"""`distill-teacher --config configs/<file>.yaml [--set section.key=value ...]`

A run is a loop of two phases; it ends when every sample of the dataset is COMMITTED by students
(trained, and with checkpointing covered by a checkpoint), or with a non-zero exit code that says
what is left and where it is.

GENERATE  rows that are neither committed (journal) nor in the spool go through vLLM with our
          connector (teacher/connector/plugin.py). Its Publisher lives in vLLM's worker process and
          streams to students (or spools when none is connected / memory is full); it never sends
          END. Keys that students lose meanwhile (their session ended without committing them:
          `!lost` records in the journal) are generated again. When the last window is done the
          engine is shut down at once (frees the GPU); its Publisher waits at most
          `teacher.drain_timeout_s` for acks and spools the rest.
SERVE     once the engine phase's Publisher has released the journal (teacher/run/serve.py waits for
          it while it is one of this teacher's processes, at most drain_timeout_s + 90 s), this
          process starts its own Publisher (auto_end=False) on the same endpoints; it replays
          the spool (files of the engine phase and of earlier runs) until every key is committed
          in the journal, then sends END, waits briefly and exits 0. Keys lost while serving
          (`Publisher.take_lost`) or missing (neither committed nor spooled nor held by anyone)
          send the loop back to GENERATE (the serve Publisher is closed first: same endpoints).
          The wait shows progress every `teacher.progress_every_s` and is bounded by
          `teacher.student_wait_s` without student progress (exit 3).

`teacher.after_generation: exit` skips SERVE: generate now, train offline later (everything not
committed is in the spool; a later `distill-teacher` with the same config serves it).

Everything that can be wrong with the config, model folder, layer ids, dataset (every row: UTF-8,
JSON, a field twice, key, field, text, chat messages, token ids; with on_too_long=fail also the
length), the journal's lock or the endpoints is checked before vLLM is imported (one line each,
exit 2).

One teacher per journal: this process holds `<journal>.lock` (distill.journal.OwnerLock) from the
config check to its exit, across every phase; a second `distill-teacher` on the same journal is
refused (exit 2, one line naming this one's pid, no summary: the summary is this one's). The
journal's own lock is held by whichever phase's Publisher appends. A torn last line or damaged
lines of the journal are set aside when it is first opened (one log line; those keys count as not
committed); a journal that cannot be read or repaired is one line naming it, exit 2 at start and
1 mid-run, with the summary written.

Exit codes: 0 every sample committed (after_generation=exit: everything generated and spooled);
1 the vLLM engine died, the serve phase's publisher failed, the journal could not be read, or
samples are missing (one line with counts and the command that finishes the job; END is never
sent); 2 config or usage error (before vLLM starts; also teacher.metrics_port in use); 3 no student progress for
`teacher.student_wait_s` with samples left (they are in the spool; the printed command finishes the
job); 6 finished as 0 but
dataset rows were skipped (teacher.on_bad_row / on_too_long: skip; listed in
`<journal>.skipped.jsonl`, counted in the summary); 5 the live probe (teacher.verify_every,
verify_fail=stop; teacher/verify.py) found a delivered sample that transformers does not reproduce
(no END); 130 SIGINT/SIGTERM.
Every exit after the config check writes `teacher.summary_path` (default `<journal>.summary.json`),
except a refusal because another teacher holds the journal.

How this process knows what students finished: the Publisher of the GENERATE phase lives in vLLM's
worker process, not here; the journal (committed and lost keys, appended by whichever Publisher
runs) and the spool folder are the channel back, and both are also the resume record.

Signals: SIGTERM (or SIGINT) to this process: GENERATE stops after the current window (the engine
shutdown spools what students have not acked), SERVE closes its Publisher (spools what is in
flight); exit 130. Ctrl-C in a terminal also reaches vLLM's engine processes: they stop at once and
this process reports and exits 130. A second signal aborts. Spool files are atomic (never
partial); what was not committed is served or generated again on restart.

vLLM engine death (an exception out of `llm.generate`, or the engine core process killed): exit 1,
no END (teacher/engine.py: the watchdog that keeps `llm.generate` from waiting forever).

Modules: teacher/run/preflight.py (the checks before vLLM), teacher/run/generate.py (GENERATE),
teacher/engine.py (vLLM start/stop/watchdog), teacher/run/serve.py (SERVE), teacher/run/results.py
(what a phase returns), teacher/run/state.py (the run, its summary JSON, exit codes); this file: the
command line and the round loop.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import shlex
import signal
import socket
import sys

from distill.config import SpoolConfig, TransportConfig, load_run_file, parse_override
from distill.errors import ConfigError, JournalError
from distill.journal import OwnerLock
from distill.metrics import check_port_free
from distill.spool import SPOOL_FULL_ADVICE, disk_room, spool_bytes
from teacher import reaper
from teacher.config import TeacherConfig, load_teacher_config, model_dtype
from teacher.data import BadRow
from teacher.errors import EngineDied, ServeFailed
from teacher.metrics import TeacherMetrics
from teacher.run.generate import generate
from teacher.run.preflight import check_endpoints_free, check_journal_free, preflight
from teacher.run.serve import serve
from teacher.run.state import (
    EXIT_CONFIG,
    EXIT_MISSING,
    EXIT_OK,
    EXIT_SIGNAL,
    EXIT_STUDENTS_GONE,
    EXIT_VERIFY,
    Run,
    Stop,
    say,
)

log = logging.getLogger("distill.teacher")

FRUITLESS_ROUNDS = 3  # serve -> generate rounds without a new commit before giving up (exit 3)


def run_teacher(
    cfg: TeacherConfig,
    transport: TransportConfig,
    spool: SpoolConfig,
    keys: list[str],
    command: str,
    bad_rows: list[BadRow] = (),
) -> int:
    """GENERATE -> SERVE rounds until every key is committed; returns the exit code (the summary
    JSON is written whatever happens)."""
    r = start_run(cfg, transport, spool, keys, command, bad_rows)
    stop = Stop()
    old_int = signal.signal(signal.SIGINT, stop)
    old_term = signal.signal(signal.SIGTERM, stop)
    try:
        return rounds(r, stop)
    except EngineDied as e:
        st = r.state()
        say(
            f"the vLLM engine died ({e}){spool_space_hint(r.spool_dir)}; {st['not_committed']} of "
            f"{st['total']} samples not committed ({st['spooled']} in the spool {r.spool_dir}, "
            f"{st['missing']} to generate); no END was sent. Restart to finish: {command}"
        )
        return r.finish(EXIT_MISSING, f"engine died: {e}")
    except ServeFailed as e:
        st = r.state()
        say(
            f"{e}; {st['not_committed']} of {st['total']} samples not committed "
            f"({st['spooled']} in the spool {r.spool_dir}). Restart to finish: {command}"
        )
        return r.finish(EXIT_MISSING, str(e))
    except JournalError as e:  # unreadable mid-run (a repairable one was repaired at the start)
        say(f"{e}; no END was sent. Fix it, then restart to finish: {command}")
        return r.finish(EXIT_MISSING, str(e))
    except KeyboardInterrupt:
        log.warning("aborted: samples not committed are served or generated again on restart")
        return interrupted(r, "aborted by a second signal")
    finally:
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)
        if r.metrics is not None:
            r.metrics.close()


def start_run(cfg, transport, spool, keys, command, bad_rows) -> Run:
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
            fp8=cfg.hidden_dtype == "fp8",
            device=cfg.verify_device,
            fail=cfg.verify_fail,
            include_output_tokens=cfg.include_output_tokens,
            every=cfg.verify_every,
        )
    r.base_tid = transport.teacher_id or f"{socket.gethostname()}-{os.getpid()}"
    r.committed_at_start = len(r.committed() & set(keys))
    if cfg.metrics_port:  # one endpoint for every phase (teacher/metrics.py)
        r.metrics = TeacherMetrics(r).start(cfg.metrics_port)
    return r


def rounds(r: Run, stop: Stop) -> int:
    """The loop: generate what is neither committed nor spooled, serve the spool, and again while
    keys get lost (at most FRUITLESS_ROUNDS rounds in a row without a new commit)."""
    rnd, regenerate, fruitless = 0, True, 0  # round 0 generates whatever is neither committed nor spooled
    while True:
        if stop.requested:
            return interrupted(r)
        committed = r.committed()
        todo = r.todo(committed)
        committed_before = len(committed & r.required)
        if todo and regenerate:
            if rnd > 0:
                log.warning("generating %d samples again (lost or missing)", len(todo))
            again = generate(r, todo, stop, rnd).again
            if r.verifier is not None:
                r.verifier.drain()  # the engine is down: every copy is written
            if r.verify_stop():
                return verify_failed(r)
            if stop.requested:
                return interrupted(r)
            if again:  # keys lost while the engine shut down: generate them again first
                rnd += 1
                continue
        regenerate = False
        st = r.state()
        if st["not_committed"] == 0 and not r.results:
            tell = "" if r.cfg.after_generation == "exit" else "; telling students the run is complete"
            say(f"nothing to do: all {st['total']} samples are committed in {r.cfg.journal}{tell}")
        if r.cfg.after_generation == "exit":
            return exit_after_generation(r, st)
        # Students of the engine phase (or of an earlier run) wait for END: the serve phase sends
        # it to every student that (re)connects within a short linger.
        served = serve(r, stop, rnd)
        if served.outcome != "lost":
            return serve_ended(r, served.outcome)
        log.warning("%d samples lost or missing while serving: generating them again", len(served.lost_keys))
        fruitless = fruitless + 1 if len(r.committed() & r.required) == committed_before else 0
        if fruitless >= FRUITLESS_ROUNDS:
            return keeps_getting_lost(r)
        rnd += 1
        regenerate = True


def spool_space_hint(spool_dir) -> str:
    """The likely cause when the engine died with spool.dir's filesystem (nearly) full: the
    connector's spool write failed in vLLM's worker, whose message only the log above shows."""
    room = disk_room(spool_dir)
    if room is None or room[0] >= max(64e6, 0.005 * room[1]):
        return ""
    return f", and spool.dir {spool_dir} is full ({room[2]}): the likely cause; {SPOOL_FULL_ADVICE}"


def interrupted(r: Run, reason: str = "signal") -> int:
    r.interrupted = True
    return r.finish(EXIT_SIGNAL, reason)


def exit_after_generation(r: Run, st: dict) -> int:
    """teacher.after_generation=exit: everything generated is committed or spooled; exit."""
    if st["not_committed"] == 0:
        return r.finish(EXIT_OK, "done")
    if st["missing"]:
        limit, used, n = r.spool.max_bytes, spool_bytes(r.spool_dir), st["spooled"]
        if limit and n and used + used / n > limit:  # one more sample of the mean size would not fit
            say(
                f"{st['missing']} samples neither committed nor spooled: spool.max_bytes ({limit} bytes) "
                f"is full and no student took samples (after_generation: exit). Raise spool.max_bytes, "
                f"or serve students while generating, and run again: {r.command}"
            )
        else:
            say(
                f"{st['missing']} samples neither committed nor spooled; run again to generate them: {r.command}"
            )
        return r.finish(EXIT_MISSING, "after_generation=exit")
    say(
        f"generation done; {st['spooled']} samples wait in the spool {r.spool_dir} (after_generation: "
        f"exit). Serve them to students with: {r.command} --set teacher.after_generation=serve"
    )
    return r.finish(EXIT_OK, "after_generation=exit")


def serve_ended(r: Run, outcome: str) -> int:
    """The serve phase ended with "done", "signal" or "gone"."""
    if outcome == "done":
        return r.finish(EXIT_OK, "done")
    if outcome == "signal":
        return interrupted(r)
    say(f"no student progress for {r.cfg.student_wait_s:.0f}s: {left_to_do(r)}")
    return r.finish(EXIT_STUDENTS_GONE, "students gone")


def keeps_getting_lost(r: Run) -> int:
    say(f"samples keep getting lost without any commit ({FRUITLESS_ROUNDS} rounds); {left_to_do(r)}")
    return r.finish(EXIT_STUDENTS_GONE, "no progress: the same samples keep getting lost")


def left_to_do(r: Run) -> str:
    """What a run that stops unfinished leaves, and the command that finishes it."""
    st = r.state()
    return (
        f"{st['not_committed']} of {st['total']} samples not trained ({st['spooled']} in the spool "
        f"{r.spool_dir}, {st['missing']} to generate). Finish the job with: {r.command}"
    )


def verify_failed(r: Run) -> int:
    v = r.verifier.summary()
    first = v["mismatched"][0] if v["mismatched"] else {}
    st = r.state()
    say(
        f"the live probe found {v['mismatches']} mismatching of {v['probed']} probed "
        f"samples (first {first.get('key')!r}: {first.get('problem')}); generation stopped, no END was "
        f"sent; {st['not_committed']} of {st['total']} samples not committed"
    )
    return r.finish(
        EXIT_VERIFY,
        f"verify mismatch (teacher.verify_fail=stop): {first.get('key')!r}: {first.get('problem')}",
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="distill-teacher", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="YAML run file (teacher, transport, spool sections)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. teacher.max_samples=8"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sets = itertools.chain.from_iterable(("--set", s) for s in args.set)
    command = shlex.join(["distill-teacher", "--config", args.config, *sets])
    try:
        overrides = dict(parse_override(s) for s in args.set)
        runfile = load_run_file(args.config, overrides)
        cfg = load_teacher_config(runfile.teacher)
        owner = take_owner_lock(cfg.journal)
    except ConfigError as e:
        print(f"distill-teacher: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    try:  # ours from here to the exit: no other distill-teacher runs on this journal meanwhile
        reaper.clean_leftovers(cfg.journal)  # engine processes and /dev/shm files of a dead teacher
        return checked_run(cfg, runfile, command)
    finally:
        owner.release()


def take_owner_lock(journal: str) -> OwnerLock:
    """`<journal>.lock` for the whole life of this process, across the engine -> serve switch (the
    journal's own lock is held only by the phase that appends). Raises ConfigError naming the
    holder's pid."""
    try:
        return OwnerLock(journal).acquire()
    except JournalError as e:
        raise ConfigError(f"teacher.journal: {e}") from None


def checked_run(cfg: TeacherConfig, runfile, command: str) -> int:
    keys: list[str] = []
    bad_rows: list[BadRow] = []
    try:
        keys, bad_rows = preflight(cfg)
        check_journal_free(cfg.journal)  # also sets aside a torn last line or damaged lines (one log line)
        if cfg.connector_mode == "stream" or cfg.after_generation == "serve":
            check_endpoints_free(runfile.transport)
        if cfg.metrics_port:
            check_port_free(cfg.metrics_port, "teacher.metrics_port")
        return run_teacher(cfg, runfile.transport, runfile.spool, keys, command, bad_rows)
    except ConfigError as e:
        print(f"distill-teacher: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except JournalError as e:  # before vLLM: unreadable or not repairable (JournalBusy: ConfigError)
        say(f"error: teacher.journal: {e}")
        r = Run(cfg, runfile.transport, runfile.spool, keys, command, bad_rows=list(bad_rows))
        return r.finish(EXIT_CONFIG, str(e))


if __name__ == "__main__":  # vLLM spawns its engine processes: keep the entry point guarded
    sys.exit(main())

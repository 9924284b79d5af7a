"""Checks of `distill-teacher` that need no vLLM (one line each, exit 2): the model folder and
layer ids, every dataset row, the journal's lock and the endpoints."""

from __future__ import annotations

import logging
import time

from distill.config import TransportConfig
from distill.errors import ConfigError, JournalBusy
from distill.journal import Journal
from teacher.config import TeacherConfig, check_layer_ids, model_config, model_dtype, model_num_layers
from teacher.data import BadRow, check_dataset
from teacher.run.state import say

log = logging.getLogger("distill.teacher")


def report_bad_row(bad: BadRow) -> None:
    say(f"bad row: {bad.line()}")


def preflight(cfg: TeacherConfig) -> tuple[list[str], list[BadRow]]:
    """Checks that need no vLLM. Returns the dataset keys the run must deliver and the bad rows
    skipped (teacher.on_bad_row=skip). Raises ConfigError."""
    num_layers = model_num_layers(cfg.model)
    check_layer_ids(cfg.layer_ids, num_layers)
    check_staging(cfg)
    length = None
    if cfg.on_too_long == "fail":  # every row tokenized now, so a long one fails before vLLM
        from teacher.data import Prompter

        prompter = Prompter(cfg)
        length = lambda row: len(prompter.token_ids(row))  # noqa: E731
    keys, bad = check_dataset(cfg, report=report_bad_row, length=length)
    if cfg.idle_timeout_s is not None:
        log.warning("teacher.idle_timeout_s is deprecated and ignored (see teacher.student_wait_s)")
    if cfg.connector_mode == "spool" and cfg.after_generation == "serve":
        log.warning(SPOOL_THEN_SERVE, cfg.student_wait_s)
    return keys, bad


def check_staging(cfg: TeacherConfig) -> None:
    """teacher.staging_bytes must hold two pieces of one token each (teacher/connector/staging.py)."""
    from teacher.connector.staging import check_staging_bytes, token_bytes

    hidden = model_config(cfg.model).get("hidden_size")
    if not isinstance(hidden, int) or isinstance(hidden, bool):
        return  # vLLM says what is wrong with the model
    dtype = model_dtype(cfg.model) if cfg.dtype == "auto" else cfg.dtype
    elem = 4 if dtype == "float32" else 2
    try:
        check_staging_bytes(
            cfg.staging_bytes, token_bytes(len(cfg.layer_ids), hidden, elem, cfg.hidden_dtype == "fp8")
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None


# connector_mode: spool spools everything, but after_generation: serve then waits for students.
SPOOL_THEN_SERVE = (
    "teacher.connector_mode is spool and teacher.after_generation is serve: once everything is "
    "spooled this teacher serves the spool to students, waiting up to %.0fs (teacher.student_wait_s) "
    "for them; to generate only, set teacher.after_generation=exit"
)


def check_journal_free(path: str, wait_s: float = 10.0) -> None:
    """A second teacher on the same journal would lose committed keys: refuse before vLLM starts
    (the previous teacher's engine may still be exiting: wait up to `wait_s`)."""
    try:
        Journal(path).open(wait_s).close()
    except JournalBusy as e:
        raise ConfigError(f"teacher.journal: {e}") from None


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

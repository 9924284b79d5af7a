"""GENERATE phase of `distill-teacher` (see teacher/cli.py): the rows that are neither committed
nor spooled (and keys lost meanwhile) go through vLLM with our connector, window by window; then
the engine is shut down (its Publisher drains, then spools what students did not ack)."""

from __future__ import annotations

import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from distill.errors import ConfigError
from distill.journal import JournalTail
from distill.spool import spool_bytes
from teacher.config import ConnectorConfig, TeacherConfig, model_config, model_dtype
from teacher.connector.parts import write_replay_keys
from teacher.data import iter_rows
from teacher.engine import EngineWatchdog, build_llm, shutdown_bound_s, shutdown_llm
from teacher.errors import EngineDied, ServeFailed
from teacher.metrics import read_stats_file
from teacher.run.preflight import check_endpoints_free, check_journal_free
from teacher.run.results import GenerateResult
from teacher.run.state import Run, Stop, say
from teacher.sizing import take_flow

log = logging.getLogger("distill.teacher")

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def connector_config(r: Run, rnd: int) -> ConnectorConfig:
    """The connector's config for round `rnd`: the run's transport (its own teacher id), spool and
    journal, and the teacher section's connector settings."""
    cfg = r.cfg
    return ConnectorConfig(
        mode=cfg.connector_mode,
        transport=r.transport.model_copy(update={"teacher_id": f"{r.base_tid}-gen{rnd}"}),
        spool=r.spool,
        journal=cfg.journal,
        include_output_tokens=cfg.include_output_tokens,
        verify_dir=str(r.verify_dir) if r.verifier is not None else None,
        stats_path=str(r.stats_path()) if cfg.connector_mode == "stream" else None,
        replay_keys_file=str(r.replay_keys_path()),
        # No caller reads the returned paths while we run: skip the per-request lock files (a file
        # create + flock + unlink on the engine step for each request); spooled files still get one.
        use_lock=False,
        **cfg.connector_tuning(),
    )


def bytes_per_token(cfg: TeacherConfig) -> int:
    """Bytes of extracted states per token (all layers), in the dtype they travel in."""
    hidden = int(model_config(cfg.model)["hidden_size"])
    dtype = cfg.dtype if cfg.dtype != "auto" else model_dtype(cfg.model)
    return len(cfg.layer_ids) * hidden * _ITEMSIZE[dtype]


class Windows:
    """The rows to generate, a window at a time, in dataset order: the keys of `todo` and keys that
    students lose meanwhile (`!lost` journal records), until none is pending."""

    def __init__(self, r: Run, todo: list[str], result: GenerateResult):
        from teacher.data import Prompter

        self.r, self.cfg, self.result = r, r.cfg, result
        self.tail = JournalTail(r.cfg.journal)
        self.tail.poll()  # history: lost records of earlier runs are in `todo` already
        self.pending: set[str] = set(todo)
        self._order = {k: i for i, k in enumerate(r.keys)}
        self._prompter = Prompter(r.cfg)
        self._it = self._rows()

    def take_lost(self) -> None:
        """Keys lost since the last look become pending again."""
        _, new_lost = self.tail.poll()
        for k in new_lost:
            self.result.lost += 1
            if k in self._order and k not in self.tail.committed:
                self.pending.add(k)

    def _rows(self):
        """Rows whose key is pending, in dataset order; passes again while lost keys come back."""
        while self.pending:
            for k, row in iter_rows(self.cfg):
                if k in self.pending:
                    self.pending.discard(k)
                    yield k, row

    def restart(self) -> None:
        """Lost keys came back after the last pass: read the dataset again."""
        self._it = self._rows()

    def next(self) -> tuple[int, list, list, list[str]]:
        """The next window: (rows read, prompts, sampling params, keys); rows too long for the model
        are skipped or truncated per teacher.on_too_long. Runs while the previous window generates."""
        window = list(itertools.islice(self._it, self.cfg.window))
        prompts, params, keys = [], [], []
        for key, row in window:
            ids = self._fit(key, self._prompter.token_ids(row))
            if ids is None:
                continue
            prompt, param = self._request(key, ids)
            prompts.append(prompt)
            params.append(param)
            keys.append(key)
        return len(window), prompts, params, keys

    def first(self) -> tuple[int, list, list, list[str]]:
        """The first window with something to run (rows may all be too long); rows read 0: none."""
        cur = self.next()
        while cur[0] and not cur[1]:
            cur = self.next()
        return cur

    def _fit(self, key: str, ids: list[int]) -> list[int] | None:
        limit = self.cfg.max_model_len - self.cfg.max_tokens
        if len(ids) <= limit:
            return ids
        if self.cfg.on_too_long == "truncate":
            log.warning("truncating %r: %d prompt tokens to %d", key, len(ids), limit)
            self.result.truncated += 1
            return ids[:limit]
        if self.cfg.on_too_long == "skip":
            self.result.too_long.add(key)
            self.r.note_too_long(key, len(ids))
            return None
        # fail: checked before vLLM started; the dataset changed since
        raise ConfigError(
            f"teacher.dataset: row {key!r}: {len(ids)} prompt tokens > max_model_len - "
            f"max_tokens = {limit} (teacher.on_too_long=fail)"
        )

    def _request(self, key: str, ids: list[int]):
        """One vLLM request: the prompt and its sampling params, whose kv_transfer_params tell the
        connector the sample's key, meta and options (the one place they are built)."""
        from vllm import SamplingParams

        cfg, r = self.cfg, self.r
        kv = {
            "sample_key": key,
            "meta": {"prompt_tokens": len(ids)},
            "include_output_tokens": cfg.include_output_tokens,
            "loss_spans": self._prompter.last_spans,  # the loss mask of the row token_ids() just read
        }
        if r.verifier is not None and r.verifier.offer(key, ids):
            kv["verify"] = True  # the connector writes a copy of this sample for the probe
        params = SamplingParams(
            max_tokens=cfg.max_tokens, temperature=cfg.temperature, extra_args={"kv_transfer_params": kv}
        )
        return {"prompt_token_ids": ids}, params


def generate(r: Run, todo: list[str], stop: Stop, rnd: int) -> GenerateResult:
    """GENERATE phase: run `todo` (and keys lost meanwhile) through vLLM, then shut it down.

    Returns what it did; its `again` is True when keys were lost after the last window (the caller
    generates them again). Raises EngineDied when the engine failed (nothing is sent as END; the
    caller exits 1).
    """
    cfg = r.cfg
    conn = connector_config(r, rnd)
    try:
        check_journal_free(cfg.journal)
        if cfg.connector_mode == "stream":
            check_endpoints_free(r.transport, wait_s=15.0)
    except ConfigError as e:  # free at start; taken since (another process)
        raise ServeFailed(f"cannot generate (round {rnd}): {e}") from None
    res = r.begin(GenerateResult(round=rnd, todo=len(todo), seen=r.generated_keys()))
    t_phase = time.monotonic()
    windows = Windows(r, todo, res)
    first = windows.first()
    if first[0]:
        # The engine's Publisher replays this run's spool files only (not another dataset's).
        write_replay_keys(r.replay_keys_path(), r.required - windows.tail.committed)
        take_flow(cfg.journal)  # a crashed engine's counters are not this phase's
        stats = r.stats_path()
        stats.unlink(missing_ok=True)  # an earlier round's or run's
        r.pub.live("generate", lambda: read_stats_file(stats))
        try:
            _run_engine(r, conn, windows, first, stop, len(todo))
        finally:  # the engine's connector wrote its Publisher's flow counters and last stats at shutdown
            flow = take_flow(cfg.journal)
            if flow is not None:
                res.note_flow(flow, r.phase_shares(flow))
                res.students = flow["student_names"]
            last = read_stats_file(stats) or {}
            r.pub.closed(last)
            res.sender_error, res.unplaced = last.get("sender_error"), int(last.get("sender_errors") or 0)
            stats.unlink(missing_ok=True)
    res.seconds = round(time.monotonic() - t_phase, 3)
    if not first[0]:
        return res
    # Lost while the engine shut down (or just before): generate those again.
    windows.take_lost()
    # (Every spool file got its `<file>.lock` from distill.spool.write_sample.)
    res.again = bool(windows.pending) and not stop.requested
    if res.sender_error is not None:
        # The sender failed after the engine's last step (no step was left to stop the engine with
        # it): those samples are neither streamed nor spooled. Generated again while a round
        # places some of what it was given; a sender that places none ends the run (exit 1).
        left = len(r.todo(r.committed()))
        placed_some = left < len(todo)
        say(
            f"the connector could not place {res.unplaced or 'some'} samples after the engine's last step "
            f"({res.sender_error}); {left} samples neither committed nor spooled"
            + ("; generating them again" if placed_some and left else "")
        )
        if not placed_some and not stop.requested:
            raise ServeFailed(
                f"the connector placed none of the {len(todo)} samples it was given ({res.sender_error})"
            )
        res.again = res.again or (left > 0 and not stop.requested)
    return res


def _run_engine(r: Run, conn: ConnectorConfig, windows: Windows, first, stop: Stop, total: int) -> None:
    """Start vLLM, generate every window, shut vLLM down (always). Raises EngineDied."""
    from tqdm import tqdm

    cfg = r.cfg
    progress = _Progress(r, windows, tqdm(total=total, unit="sample", dynamic_ncols=True))
    prefetch = ThreadPoolExecutor(1, thread_name_prefix="distill-prefetch")  # next window's token ids
    llm = watchdog = None
    t0 = time.monotonic()
    try:
        try:
            llm = build_llm(cfg, conn)
        except Exception as e:
            if stop.requested:
                return
            raise EngineDied(f"engine start failed: {type(e).__name__}: {e}") from e
        watchdog = EngineWatchdog(llm)
        t0 = progress.t0 = time.monotonic()
        dead = _generate_windows(llm, windows, first, prefetch, progress, stop)
    except KeyboardInterrupt:
        stop.requested = True
        raise
    finally:
        progress.bar.close()
        windows.result.engine_s += time.monotonic() - t0
        prefetch.shutdown(wait=True, cancel_futures=True)
        if watchdog is not None:
            watchdog.close()
        if llm is not None:
            # Frees the GPU now: the serve phase needs no engine. The connector waits at most
            # drain_timeout_s for acks, then spools what is unacked.
            t_sd = time.monotonic()
            shutdown_llm(llm, timeout_s=shutdown_bound_s(conn.drain_timeout_s))
            log.info("engine shut down in %.1fs", time.monotonic() - t_sd)
            del llm
    if dead is not None:
        # The connector's sender thread failing (a sample neither streamed nor spooled) stops the
        # engine at its next step; vLLM's message then names only the engine.
        cause = (read_stats_file(r.stats_path()) or {}).get("sender_error")
        raise EngineDied(f"the connector could not place a sample ({cause}): {dead}" if cause else dead)


def _generate_windows(llm, windows: Windows, cur, prefetch, progress, stop: Stop) -> str | None:
    """The window loop (the next window is prepared while one generates). Returns why the engine
    died, or None."""
    r = windows.r
    while True:
        n_rows, prompts, params, keys = cur
        if n_rows == 0:
            windows.take_lost()
            if not windows.pending:
                return None
            windows.restart()  # lost keys came back after the last pass
            cur = windows.next()
            continue
        if stop.requested or r.verify_stop():
            return None
        nxt = prefetch.submit(windows.next)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False) if prompts else []
        except Exception as e:
            nxt.cancel()
            if stop.requested:
                # Ctrl-C reached the engine processes too: they are gone (see teacher/cli.py).
                log.warning("engine stopped by the signal (%s)", type(e).__name__)
                return None
            return f"{type(e).__name__}: {e}".rstrip(": ")
        progress.outputs(keys, outs, n_rows)
        windows.take_lost()
        cur = nxt.result()


class _Progress:
    """Counts what vLLM returned (into the phase's result) and shows it on a tqdm bar."""

    def __init__(self, r: Run, windows: Windows, bar):
        self.r, self.windows, self.bar = r, windows, bar
        self.bytes_per_token = bytes_per_token(r.cfg)
        self.t0 = time.monotonic()

    def outputs(self, keys: list[str], outs, n_rows: int) -> None:
        r, res = self.r, self.windows.result
        for key, out in zip(keys, outs, strict=True):
            n = len(out.prompt_token_ids)
            if r.cfg.include_output_tokens:
                n += len(out.outputs[0].token_ids) - 1
            res.count_output(key, n, self.bytes_per_token)
        self.bar.update(n_rows)
        dt = max(time.monotonic() - self.t0, 1e-9)
        self.bar.set_postfix_str(
            f"{res.samples / dt:.1f} samples/s, {r.tokens / dt:.0f} tok/s, "
            f"committed {len(self.windows.tail.committed)}, spool {spool_bytes(r.spool_dir) / 1e6:.1f} MB"
        )

"""`distill-teacher --config configs/<file>.yaml [--set section.key=value ...]`

Runs vLLM over a dataset with hidden-state extraction and our connector (teacher/connector.py),
which hands every finished request's states to the ZeroMQ Publisher in vLLM's worker process.

How this process knows delivery finished: the Publisher lives in vLLM's worker process (vLLM's
default multi-process mode: this process -> engine core -> worker), not here. Two files are the
channel back, and both are also the resume record:

    journal    keys acknowledged by students (appended by the Publisher per ack batch)
    spool dir  `spool_name(key)` files, written atomically when no student takes a sample

After the last window, this process waits until every key it submitted is in the journal or in the
spool (at most `teacher.drain_timeout_s`), then shuts the engine down; the connector's shutdown
closes the Publisher, which spools anything still unacked. A restarted run skips keys found in
either. Running vLLM in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) would put the Publisher here,
but then the last finished requests are only extracted on a later engine step that never comes
(NOTES: in-process pitfall), and tensor parallelism still puts rank 0 in another process: the
file channel works in every mode.

Ordering rules:
  1. Everything that can be wrong with the config, model folder, layer ids or dataset is checked
     before vLLM is imported (a clear one-line error, exit code 2).
  2. Signals. SIGTERM (or SIGINT) sent to this process: stop after the current window, wait for
     delivery as usual, shut down, exit 130. Ctrl-C in a terminal also reaches vLLM's engine
     processes (one process group; vLLM installs its own handlers there): they shut down at once,
     the connector's shutdown closes the Publisher (unacked samples are spooled), and this process
     sees the engine die, reports, and exits 130. A second signal aborts the wait. Either way no
     partial file is left (spool writes are atomic) and what was not delivered is re-run on
     restart.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import signal
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from distill.config import ConfigError, SpoolConfig, TransportConfig, load_run_file, parse_override
from distill.spool import list_spool, spool_name
from teacher.config import (
    ConnectorConfig,
    TeacherConfig,
    check_layer_ids,
    extraction_engine_args,
    load_teacher_config,
    model_num_layers,
)
from teacher.data import check_dataset, iter_rows

log = logging.getLogger("distill.teacher")


class JournalTail:
    """Reads an append-only journal incrementally (only complete lines)."""

    def __init__(self, path: str | None):
        self.path = Path(path) if path else None
        self.keys: set[str] = set()  # acknowledged keys seen so far
        self._offset = 0
        self._partial = b""

    def poll(self) -> set[str]:
        if self.path is None or not self.path.exists():
            return self.keys
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        self._offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        self.keys.update(x.decode() for x in lines if x)
        return self.keys


class Stop:
    """SIGINT/SIGTERM: the first asks to stop after the current window, the second aborts."""

    def __init__(self):
        self.requested = False

    def __call__(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        log.warning(
            "%s: finishing the current window, then draining (again to abort)", signal.Signals(signum).name
        )


def preflight(cfg: TeacherConfig) -> int:
    """Checks that need no vLLM. Returns the number of dataset rows used. Raises ConfigError."""
    num_layers = model_num_layers(cfg.model)
    check_layer_ids(cfg.layer_ids, num_layers)
    return check_dataset(cfg)


def build_llm(cfg: TeacherConfig, conn: ConnectorConfig):
    """The vLLM engine with extraction and our connector (spawns the engine processes)."""
    if cfg.cpu_kvcache_space_gib is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.cpu_kvcache_space_gib)
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


def run(cfg: TeacherConfig, transport: TransportConfig, spool: SpoolConfig, num_rows: int) -> int:
    from tqdm import tqdm

    from teacher.data import Prompter

    if not transport.teacher_id:
        transport = transport.model_copy(update={"teacher_id": f"{socket.gethostname()}-{os.getpid()}"})
    conn = ConnectorConfig(
        mode=cfg.connector_mode,
        transport=transport,
        spool=spool,
        journal=cfg.journal,
        include_output_tokens=cfg.include_output_tokens,
        queue_samples=cfg.queue_samples,
        pinned_buffers=cfg.pinned_buffers,
        copy_threads=cfg.copy_threads,
        # No caller reads the returned paths while we run: skip the per-request lock files (a file
        # create + flock + unlink on the engine step for each request); spooled files still get one.
        use_lock=False,
    )
    spool_dir = Path(spool.dir)
    journal = JournalTail(cfg.journal)
    done_before = journal.poll()

    def in_spool(key: str) -> bool:
        return (spool_dir / spool_name(key)).exists()

    # Lazy: rows are read window by window, so memory stays flat for any dataset size.
    skipped = 0

    def todo_rows():
        nonlocal skipped
        for k, row in iter_rows(cfg):
            if k in done_before or in_spool(k):
                skipped += 1
                continue
            yield k, row

    rows = todo_rows()
    first_window = list(itertools.islice(rows, cfg.window))
    if not first_window:
        print(
            f"distill-teacher: nothing to do: all {skipped} samples are in the journal or the spool",
            file=sys.stderr,
        )
        return 0

    prompter = Prompter(cfg)
    stop = Stop()
    llm = build_llm(cfg, conn)
    old_int = signal.signal(signal.SIGINT, stop)
    old_term = signal.signal(signal.SIGTERM, stop)

    from vllm import SamplingParams

    hidden = _hidden_size(cfg.model)
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}.get(cfg.dtype, _model_itemsize(cfg.model))
    bytes_per_token = len(cfg.layer_ids) * hidden * itemsize
    submitted: list[str] = []
    n_tokens = 0
    n_bytes = 0
    too_long = 0
    t0 = time.monotonic()
    bar = tqdm(total=num_rows, unit="sample", dynamic_ncols=True)
    shown_skipped = 0
    interrupted = False
    engine_dead = False  # the engine processes exited (Ctrl-C reaches them too)
    gen_s = None  # seconds until the last window was generated
    prefetch = ThreadPoolExecutor(1, thread_name_prefix="distill-prefetch")  # next window's token ids
    try:

        def prepare(window):
            """Token ids and sampling params of one window (runs while the previous one generates)."""
            prompts, params, keys, n_long = [], [], [], 0
            for key, row in window:
                ids = prompter.token_ids(row)
                if len(ids) + cfg.max_tokens > cfg.max_model_len:
                    n_long += 1
                    log.warning("skipping %r: %d prompt tokens > max_model_len - max_tokens", key, len(ids))
                    continue
                kv = {
                    "sample_key": key,
                    "meta": {"prompt_tokens": len(ids)},
                    "include_output_tokens": cfg.include_output_tokens,
                }
                prompts.append({"prompt_token_ids": ids})
                params.append(
                    SamplingParams(
                        max_tokens=cfg.max_tokens,
                        temperature=cfg.temperature,
                        extra_args={"kv_transfer_params": kv},
                    )
                )
                keys.append(key)
            return len(window), prompts, params, keys, n_long

        nxt = prefetch.submit(prepare, first_window)
        while True:
            n_rows, prompts, params, keys, n_long = nxt.result()
            if n_rows == 0:
                break
            if stop.requested:
                interrupted = True
                break
            too_long += n_long
            nxt = prefetch.submit(lambda: prepare(list(itertools.islice(rows, cfg.window))))
            try:
                outs = llm.generate(prompts, params, use_tqdm=False) if prompts else []
            except Exception as e:
                if not stop.requested:
                    raise
                # Ctrl-C reached the engine processes too: they are gone (see module docstring).
                log.warning("engine stopped by the signal (%s)", type(e).__name__)
                engine_dead = True
                interrupted = True
                break
            for key, out in zip(keys, outs, strict=True):
                n = len(out.prompt_token_ids)
                if cfg.include_output_tokens:
                    n += len(out.outputs[0].token_ids) - 1
                n_tokens += n
                n_bytes += n * bytes_per_token
                submitted.append(key)
            bar.update(n_rows + skipped - shown_skipped)  # rows run + rows found done
            shown_skipped = skipped
            dt = max(time.monotonic() - t0, 1e-9)
            bar.set_postfix_str(
                f"{len(submitted) / dt:.1f} samples/s, {n_tokens / dt:.0f} tok/s, "
                f"{n_bytes / dt / 1e9:.3f} GB/s, acked {len(journal.poll() & set(submitted))}, "
                f"spool {_spool_mb(spool_dir):.1f} MB"
            )
        bar.close()
        gen_s = time.monotonic() - t0
        if not engine_dead:
            _wait_delivered(submitted, journal, in_spool, cfg.drain_timeout_s, cfg.idle_timeout_s, stop)
    except KeyboardInterrupt:
        interrupted = True
        log.warning("aborted: samples not yet delivered will be re-run on restart")
    finally:
        bar.close()
        prefetch.shutdown(wait=True, cancel_futures=True)
        shutdown_llm(llm, timeout_s=conn.drain_timeout_s + 15)
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)

    elapsed = time.monotonic() - t0
    gen_s = gen_s or elapsed
    acked = journal.poll() & set(submitted)
    spooled = [k for k in submitted if in_spool(k)]
    for k in spooled:  # vLLM's load_hidden_states opens `<file>.lock`: make sure it exists
        lock = spool_dir / (spool_name(k) + ".lock")
        if not lock.exists():
            lock.touch()
    lost = [k for k in submitted if k not in acked and not in_spool(k)]
    print(
        # scripts/e2e.py parses "N samples, T tokens, G GB in S s ... spooled K": keep that shape.
        f"distill-teacher: {len(submitted)} samples, {n_tokens} tokens, {n_bytes / 1e9:.3f} GB in "
        f"{gen_s:.1f}s ({n_tokens / max(gen_s, 1e-9):.0f} tok/s, {n_bytes / max(gen_s, 1e-9) / 1e9:.3f} GB/s), "
        f"delivered and shut down after {elapsed:.1f}s; "
        f"acked {len(acked)}, spooled {len(spooled)} ({_spool_mb(spool_dir):.1f} MB in {spool_dir}), "
        f"already done {skipped}, too long {too_long}" + (", interrupted" if interrupted else ""),
        file=sys.stderr,
    )
    if lost:
        print(
            f"distill-teacher: {len(lost)} samples neither acked nor spooled (e.g. {lost[:3]}); "
            "they will be re-run on restart",
            file=sys.stderr,
        )
    if interrupted:
        return 130
    return 1 if lost else 0


def _wait_delivered(
    submitted, journal: JournalTail, in_spool, timeout_s: float, idle_s: float, stop: Stop
) -> list[str]:
    """Wait until every submitted key is acked (journal) or spooled. Returns the keys still open.

    Gives up after `timeout_s`, or after `idle_s` without any key becoming acked or spooled (no
    student is taking samples); the engine shutdown then spools what is left, so nothing is lost.
    """
    now = time.monotonic()
    deadline, last_progress = now + timeout_s, now
    open_keys = set(submitted)
    while True:
        before = len(open_keys)
        open_keys -= journal.poll()
        open_keys = {k for k in open_keys if not in_spool(k)}
        now = time.monotonic()
        if len(open_keys) < before:
            last_progress = now
        if not open_keys or now > deadline or now - last_progress > idle_s or stop.requested:
            if open_keys:
                log.warning("%d samples not yet acked or spooled; the shutdown spools them", len(open_keys))
            return sorted(open_keys)
        time.sleep(0.2)


def _spool_mb(d: Path) -> float:
    return sum(p.stat().st_size for p in list_spool(d) if p.exists()) / 1e6


def _model_json(model: str) -> dict:
    import json

    cfg = json.loads((Path(model) / "config.json").read_text())
    return cfg.get("text_config", cfg) if "hidden_size" not in cfg else cfg


def _hidden_size(model: str) -> int:
    return int(_model_json(model)["hidden_size"])


def _model_itemsize(model: str) -> int:
    dt = str(_model_json(model).get("torch_dtype") or _model_json(model).get("dtype") or "bfloat16")
    return 4 if "32" in dt else 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="distill-teacher", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="YAML run file (teacher, transport, spool sections)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. teacher.max_samples=8"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        overrides = dict(parse_override(s) for s in args.set)
        runfile = load_run_file(args.config, overrides)
        cfg = load_teacher_config(runfile.teacher)
        num_rows = preflight(cfg)
    except ConfigError as e:
        print(f"distill-teacher: error: {e}", file=sys.stderr)
        return 2
    try:
        return run(cfg, runfile.transport, runfile.spool, num_rows)
    except ConfigError as e:
        print(f"distill-teacher: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # vLLM spawns its engine processes: keep the entry point guarded
    sys.exit(main())

"""The vLLM engine of the GENERATE phase: start (with extraction and our connector), stop, and the
watchdog that turns a dead engine core into an exception instead of a hang.

vLLM engine death (an exception out of `llm.generate`, or the engine core process killed): vLLM's
SyncMPClient output thread exits on the engine monitor's shutdown without waking `get_output`, so
`llm.generate` would wait forever (vLLM 0.32 `core_client.py`, SyncMPClient.process_outputs_socket);
`EngineWatchdog` posts EngineDeadError into its queue when the monitor marks the engine dead.
"""

from __future__ import annotations

import os
import threading

from teacher.config import ConnectorConfig, TeacherConfig, extraction_engine_args

SPOOL_MARGIN_S = 60.0  # engine shutdown: time to spool what is in memory, beyond drain_timeout_s
SHUTDOWN_MARGIN_S = 30.0  # beyond drain_timeout_s + SPOOL_MARGIN_S: vLLM's own teardown


def shutdown_bound_s(drain_timeout_s: float) -> float:
    """How long the engine's shutdown may take (its Publisher drains, then spools), after which
    vLLM kills the engine processes: `shutdown_llm`'s timeout, and how long the serve phase waits
    for the engine's Publisher to let go of the journal (teacher/run/serve.py)."""
    return drain_timeout_s + SPOOL_MARGIN_S + SHUTDOWN_MARGIN_S


def _worker_shutdown_timeout(drain_timeout_s: float) -> None:
    """vLLM gives its workers VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (default 5) to exit before
    SIGTERM, then SIGKILL: the connector's shutdown (drain_timeout_s, then spooling what is in
    memory) must fit, or samples held in the worker's memory are lost (the serve phase would
    generate them again)."""
    need = int(drain_timeout_s + SPOOL_MARGIN_S)
    try:
        have = int(os.environ.get("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "5"))
    except ValueError:
        have = 5
    if have < need:
        os.environ["VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"] = str(need)


_REAPER: list = []  # this process's engine reaper (teacher/reaper.py), started once


def _start_reaper(journal: str) -> None:
    """The engine processes vLLM is about to start die with this process (teacher/reaper.py)."""
    if not _REAPER:
        from teacher import reaper

        os.environ[reaper.MARK] = str(os.getpid())  # inherited by every engine process
        _REAPER.append(reaper.start(journal))


def build_llm(cfg: TeacherConfig, conn: ConnectorConfig):
    """The vLLM engine with extraction and our connector (spawns the engine processes)."""
    if cfg.cpu_kvcache_space_gib is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.cpu_kvcache_space_gib)
    _worker_shutdown_timeout(conn.drain_timeout_s)
    _start_reaper(cfg.journal)
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
    extra = dict(cfg.engine_args)
    kv = extra.pop("kv_transfer_config", None)
    if isinstance(kv, dict):  # entries over ours (e.g. a connector subclass: kv_connector + module)
        args["kv_transfer_config"] = {**args["kv_transfer_config"], **kv}
    elif kv is not None:
        args["kv_transfer_config"] = kv
    args.update(extra)
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
                self._queue.put_nowait(err)
                return

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

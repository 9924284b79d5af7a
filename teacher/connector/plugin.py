"""vLLM KV connector that streams each finished request's hidden states to students.

Load it next to the `extract_hidden_states` speculative method::

    kv_transfer_config = {
        "kv_connector": "DistillHiddenStatesConnector",
        "kv_connector_module_path": "teacher.connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {...},   # teacher.config.ConnectorConfig, parsed once
    }

The scheduler side is vLLM's reference `ExampleHiddenStatesConnector` (subclassed, so the installed
vLLM's own bookkeeping and cache layout are used: 0.26 and 0.32 differ); this module changes where
the rows go. Plugin hooks by side, and when vLLM calls them:

Scheduler side (engine core process)
    build_connector_meta(scheduler_output)  every step: hands the requests that finished last step
        (block ids, token ids) to the worker, plus each new request's sample key, metadata and the
        spool path its lock file is taken on.
    request_finished(_all_groups)(request, block_ids)  once per finished request, before its blocks
        are freed: keeps the blocks (returns True) and returns `kv_transfer_params` telling the
        caller where the sample goes (see below).
    get_num_new_matched_tokens / update_state_after_alloc  store-only connector: nothing to load.
Worker side (each worker process; only tensor-parallel rank 0 sends)
    register_kv_caches(kv_caches)  once at start: finds the hidden-state cache; rank 0 starts the
        Publisher (binds the transport endpoints; CUDA with `ring_staging`: page-locks its ring)
        and the sender thread.
    wait_for_save()  every step: takes an exclusive flock on `<spool path>.lock` of new requests.
    bind_connector_metadata(meta)  every step, before its forward: gathers the rows of the
        requests that finished in an earlier step from the cache, copies them to host memory (CUDA:
        on a side stream that waits only for the work already queued, beside this step's forward,
        straight into the sample's slot of the page-locked shared-memory ring (`ring_staging`) or
        else into reused pinned buffers; CPU: a plain gather) and queues them for the sender thread (a
        sample over `staging_bytes`: in pieces, by that thread, teacher/connector/staging.py).
    get_finished(finished_req_ids)  every step, after the forward is launched: reports a request
        "finished sending" once its rows are off the cache, so vLLM can free its blocks. The engine
        step never waits for students: `Publisher.submit` spools when memory is full or no student
        is connected.
    get_finished_count()  1: only rank 0 reports, the other ranks would otherwise block the free.
    shutdown()  at engine shutdown: drains the sender thread, closes the Publisher's input, waits
        up to `drain_timeout_s` for students to ack what they hold, then closes it (anything
        unacked is spooled, never lost). This Publisher never sends END (auto_end=False):
        distill-teacher's serve phase replays the spool and ends the run once every sample is
        committed.

What a request's `kv_transfer_params` say (in and out), the loss mask every sample carries, the
rows `capture: loss_mask` keeps and the layer order: teacher/README.md, "Request parameters".
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as _ref
from vllm.logger import init_logger

try:  # vLLM >= 0.27 flags GPU<->CPU syncs when VLLM_GPU_SYNC_CHECK is set; ours are deliberate
    from vllm.utils.gpu_sync_debug import gpu_sync_allowed as _sync_allowed
except ImportError:  # vLLM 0.26
    from contextlib import nullcontext as _sync_allowed

from distill import fp8
from distill.capture import CAPTURES, POSITIONS_KEY, held_positions
from distill.protocol import Sample
from distill.shm import spec_sizes
from distill.spool import lock_path, spool_name, write_sample
from teacher.config import ConnectorConfig
from teacher.connector.parts import (
    ConnectorTiming,
    PinnedBlock,
    PinnedPool,
    SampleInfo,
    SendJob,
    StatsWriter,
    layer_perm,
    loss_mask,
    read_replay_keys,
    spans_ok,
    take_lock,
)
from teacher.connector.staging import (
    SLACK,
    CopyDigest,
    HostRegistration,
    Pieces,
    destination,
    parallel_copy,
    parallel_digest,
    slot_mapping,
    stage_into,
    stage_whole,
    staged_specs,
)
from teacher.connector.staging import cache_view as _cache_view
from teacher.connector.staging import check_staging_bytes as _check_staging
from teacher.connector.staging import fits as _fits
from teacher.connector.staging import piece_tokens as _piece_tokens
from teacher.connector.staging import token_bytes as _token_bytes
from teacher.sizing import write_flow

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorRole
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = init_logger("vllm.teacher.connector")  # under "vllm" so it shares vLLM's log handler

_STOP = object()  # sender-thread sentinel
_DEFERRED = object()  # _pending_copies value of a request waiting for a free pinned buffer
_STAGED = ("hidden_states", fp8.SCALE_KEY)  # what comes off the cache (the rest is built on the host)
_ALLOCATOR_KEYS = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc", "num_device_free")


def _allocator_counts(device) -> dict:
    """The CUDA caching allocator's counters of this process that stall an engine (vLLM's
    allocations included): retries after freeing cached memory, device-wide syncs, cudaMalloc and
    cudaFree calls (a cudaFree waits for the device)."""
    stats = torch.cuda.memory_stats(device)
    return {k: stats.get(k) for k in _ALLOCATOR_KEYS}


class DistillHiddenStatesConnector(_ref.ExampleHiddenStatesConnector):
    """Hidden-state connector that hands samples to a `distill.transport.Publisher`."""

    # Class defaults for instances built without __init__ (unit tests): see __init__.
    _stats = None  # StatsWriter: the Publisher's stats for distill-teacher (cfg.stats_path)
    _spool_tid = ""
    _spool_seq = 0
    _staged_token = 0  # (every sample then fits the staging bound: staged whole)
    _ring_miss_said = False  # the ring-full line of ring staging, said once
    _peak_lock = threading.Lock()
    _count_lock = threading.Lock()  # _placed, _timing's sums and _spool_seq: the sender threads
    _senders: tuple = ()
    _ring_host: HostRegistration | None = None  # the Publisher's ring, page-locked (ring_staging)
    _cache: torch.Tensor | None = None  # the hidden-state cache view (register_kv_caches)
    _allocator_at_start: dict | None = None  # CUDA allocator counters at the first engine step

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: Any = None,
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        # Parsed once; a bad value fails the engine start naming the key.
        self.cfg = ConnectorConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        # The reference's file writer is not used: placement happens in our sender thread.
        self._executor.shutdown(wait=False)
        self._storage_path = self.cfg.spool.dir
        self.use_lock = self.cfg.use_lock
        self.allow_custom_save_path = False
        hf = vllm_config.speculative_config.draft_model_config.hf_config
        # vLLM collects the extracted layers in execution order (ascending id), whatever the order
        # of the configured list; every sample is delivered in the CONFIGURED order (its `layers`
        # names what each slot holds): `_perm[i]` is the cache slot of layer_ids[i].
        self.layer_ids = list(getattr(hf, "eagle_aux_hidden_state_layer_ids", []))
        self._perm = layer_perm(self.layer_ids)
        self._perm_dev: torch.Tensor | None = None  # _perm on the cache's device (CUDA)

        # Scheduler-side state
        # req_id -> key/meta/path, from scheduling to finish
        self._req_info: dict[str, SampleInfo] = {}
        # req_id -> info of a finished request, until its pending save goes to the worker
        self._finished_info: dict[str, SampleInfo] = {}

        # Worker-side state (set up in register_kv_caches on rank 0)
        self._publisher = None  # distill.transport.Publisher (mode stream)
        self._queue: queue.Queue | None = None  # SendJob / _STOP for the sender thread
        self._senders: list[threading.Thread] = []  # teacher.sender_threads of them
        self._sender_error: BaseException | None = None  # first failure, re-raised on the engine step
        self._pending_copies: dict[str, Any] = {}  # req_id -> CUDA event of its copy (None: done)
        self._finished_reqs: set[str] = set()  # req_ids the scheduler finished, awaiting their copy
        # Pending saves that found every pinned buffer busy: copied (in order) at a later step,
        # their blocks kept meanwhile; the engine step never waits for a buffer.
        self._deferred: deque = deque()
        self._pinned: PinnedPool | PinnedBlock | None = None  # CUDA staging buffers
        self._copy_pool: ThreadPoolExecutor | None = None  # chunked copies out of staging (CUDA)
        # sender counters; unplaced: left at shutdown on a full spool that no student drained
        self._placed: dict[str, int] = {"stream": 0, "spool": 0, "errors": 0, "unplaced": 0}
        self._abandon = False  # shutdown gave up on a full spool: the sender drops what is left
        self._timing = ConnectorTiming()  # where the time goes (logged at shutdown)
        self._peak_lock = threading.Lock()  # staging_peak_bytes: engine and sender thread
        self._count_lock = threading.Lock()  # _placed, _timing's sums, _spool_seq: sender threads
        self._staged_token = 0  # bytes one token takes while staged (register_kv_caches)
        # Mode spool (no Publisher): the teacher id and sequence numbers the files carry, as a
        # Publisher would give them (transport.teacher_id, else host-pid-random; seq from 1).
        self._spool_tid = ""
        self._spool_seq = 0
        self._closed = False

    def get_finished_count(self) -> int:
        """Only TP rank 0 reports "finished sending" (vLLM 0.26's reference lacks this: with
        TP > 1 the scheduler would wait for every rank and leak the blocks)."""
        return 1

    # ==============================
    # Scheduler-side methods
    # ==============================

    def _info_for(self, req_id: str, kv_params: dict[str, Any] | None) -> SampleInfo:
        kv_params = kv_params or {}
        key = str(kv_params.get("sample_key") or req_id)
        meta = kv_params.get("meta") or {}
        if not isinstance(meta, dict):
            raise ValueError(
                f"kv_transfer_params['meta'] of request {req_id} must be a map, got {type(meta)}"
            )
        spans = kv_params.get("loss_spans")
        if spans is not None and not spans_ok(spans):
            # A malformed mask from an outside client must not stop the engine: the default is used.
            logger.warning(
                "distill: request %s: kv_transfer_params['loss_spans'] must be a list of [start, end) "
                "integer pairs; ignored (default loss mask)",
                req_id,
            )
            spans = None
        capture = kv_params.get("capture", self.cfg.capture)
        if capture not in CAPTURES:  # as a malformed mask: the engine goes on, with the default
            logger.warning("distill: request %s: kv_transfer_params['capture'] %r ignored", req_id, capture)
            capture = self.cfg.capture
        return SampleInfo(
            key=key,
            meta=meta,
            path=os.path.join(self.cfg.spool.dir, spool_name(key)),
            verify=bool(kv_params.get("verify")) and self.cfg.verify_dir is not None,
            loss_spans=[[int(a), int(b)] for a, b in spans] if spans is not None else None,
            capture=capture,
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        # The reference names files after the request id; ours are named after the sample key, at
        # the spool path, so the returned path is the one the spool (and the lock) use.
        for new_req in scheduler_output.scheduled_new_reqs:
            sp = new_req.sampling_params
            kv_params = sp.extra_args.get("kv_transfer_params") if sp and sp.extra_args else None
            info = self._info_for(new_req.req_id, kv_params)
            self._req_info[new_req.req_id] = info
            self._request_filenames[new_req.req_id] = info.path
            if hasattr(meta, "new_req_filenames"):
                meta.new_req_filenames[new_req.req_id] = info.path
        meta.distill_samples = {
            p.req_id: self._finished_info.pop(p.req_id)
            for p in meta.pending_saves
            if p.req_id in self._finished_info
        }
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        kv_params = request.kv_transfer_params
        if self.cfg.include_output_tokens and isinstance(kv_params, dict):
            kv_params.setdefault("include_output_tokens", True)
        elif self.cfg.include_output_tokens and kv_params is None:
            request.kv_transfer_params = {"include_output_tokens": True}
        info = self._req_info.pop(request.request_id, None)
        if request.request_id not in self._request_filenames:
            return False, None  # aborted before it was scheduled (vLLM 0.26 would raise KeyError)
        delay, _ = super().request_finished(request, block_ids)
        if not delay or info is None:
            return delay, None
        info.prompt_len = int(request.num_prompt_tokens)
        self._finished_info[request.request_id] = info
        params: dict[str, Any] = {
            "sample_key": info.key,
            "destination": self.cfg.mode,
            "hidden_states_path": info.path,
        }
        if self.cfg.transport.teacher_id:
            params["teacher_id"] = self.cfg.transport.teacher_id
        return True, params

    # ==============================
    # Worker-side methods
    # ==============================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        super().register_kv_caches(kv_caches)
        if not self._is_tp_rank_zero or self._senders:
            return
        # [blocks, L, block_size, H] whichever layout this vLLM has (a view)
        kv = self._cache = _cache_view(self._kv_cache, _ref.extract_from_kv_cache)
        quantize = self.cfg.hidden_dtype == "fp8"
        self._staged_token = _token_bytes(kv.shape[1], kv.shape[3], kv.element_size(), quantize)
        _check_staging(self.cfg.staging_bytes, self._staged_token, "kv_connector_extra_config.staging_bytes")
        if self._kv_cache.is_cuda:
            if quantize:  # the fused fp8 kernel compiled and checked now, not at the first sample
                fused = fp8.fused_quantizer(self._kv_cache.device, self._kv_cache.dtype, kv.shape[3])
                logger.info(
                    "fp8: %s quantizes the %s hidden states",
                    "one fused kernel" if fused is not None else "torch operations",
                    str(self._kv_cache.dtype).replace("torch.", ""),
                )
            if self.cfg.pinned_bytes and self.cfg.pinned_buffers:  # pinned now, while the engine starts
                # (the largest range: a whole sample of staging_bytes and its alignment slack)
                largest = self.cfg.staging_bytes + SLACK
                self._pinned = PinnedBlock(self.cfg.pinned_bytes, self.cfg.pinned_buffers, largest=largest)
            else:
                self._pinned = PinnedPool(
                    self.cfg.pinned_buffers,
                    limit=self.cfg.staging_bytes,
                    background=self.cfg.pinned_background,
                    device=self._kv_cache.device,
                )
            if self.cfg.copy_threads > 1:
                self._copy_pool = ThreadPoolExecutor(self.cfg.copy_threads, thread_name_prefix="distill-copy")
        if self.cfg.mode == "stream":
            from distill.transport import Publisher

            # auto_end=False: the engine does not know whether the run is complete; distill-teacher
            # (or, for `vllm serve`, nobody: a server never ends) decides.
            self._publisher = Publisher(
                self.cfg.transport,
                self.cfg.spool,
                journal=self.cfg.journal,
                auto_end=False,
                replay_keys=read_replay_keys(self.cfg.replay_keys_file),
            )
            self._publisher.start()
            logger.info("Distill publisher bound to %s", ", ".join(self.cfg.transport.bind))
            if self._kv_cache.is_cuda and self.cfg.ring_staging:
                self._register_ring()
            if self.cfg.stats_path:
                self._stats = StatsWriter(self._publisher, self.cfg.stats_path, extra=self._sender_failure)
        else:
            import secrets
            import socket

            self._spool_tid = self.cfg.transport.teacher_id or (
                f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"
            )
        self._start_senders()
        logger.info(
            "distill: this worker places samples (mode %s, spool %s, %d sender threads)",
            self.cfg.mode,
            self.cfg.spool.dir,
            self.cfg.sender_threads,
        )

    def _start_senders(self) -> None:
        """The job queue and teacher.sender_threads threads placing what it holds."""
        self._queue = queue.Queue(maxsize=self.cfg.queue_samples)
        self._senders = []
        for i in range(self.cfg.sender_threads):
            name = "distill-sender" if i == 0 else f"distill-sender-{i}"
            t = threading.Thread(target=self._send_loop, name=name, daemon=True)
            t.start()
            self._senders.append(t)

    def _register_ring(self) -> None:
        """ring_staging: page-lock the Publisher's whole ring for the GPU, so that each sample's
        rows are copied from the device straight into its ring slot (no pinned buffer, no host copy
        out of it). Without a ring, or one its filesystem cannot hold whole, the pinned path."""
        t0 = time.perf_counter()
        mem = self._publisher.ring_memory()
        if mem is not None:
            try:
                self._ring_host = HostRegistration(*mem)
            except RuntimeError as e:
                logger.warning("distill: shared-memory ring not page-locked (%s); pinned staging", e)
        if self._ring_host is not None:
            logger.info(
                "distill: device-to-host copies go straight into the shared-memory ring (%d bytes "
                "reserved and page-locked in %.1f s)", self._ring_host.nbytes, time.perf_counter() - t0,
            )  # fmt: skip
        else:
            logger.info(
                "distill: no whole shared-memory ring to copy into: samples go through pinned staging"
            )

    def _ring_slot(self, num_rows: int, mask, positions, token_ids):
        """A ring slot for one whole sample (ring_staging), or None: no room, or over the
        Publisher's memory bound (then the pinned path places or spools it as before)."""
        kv = self._cache
        layers = self._perm.numel() if self._perm is not None else kv.shape[1]
        quantize = self.cfg.hidden_dtype == "fp8"
        specs = staged_specs(num_rows, layers, kv.shape[3], kv.dtype, quantize)
        specs["loss_mask"] = (list(mask.shape), mask.dtype)
        if positions is not None:
            specs[POSITIONS_KEY] = (list(positions.shape), positions.dtype)
        specs["token_ids"] = (list(token_ids.shape), token_ids.dtype)
        nbytes = sum(spec_sizes(specs))
        if nbytes > self.cfg.transport.max_buffer_bytes:
            return None
        # Normal tensors, not inference tensors (the engine step runs in inference mode): the
        # sender thread writes the small tensors into the slot outside it.
        with torch.inference_mode(False):
            slot = self._publisher.ring_slot(specs)
        if slot is None:
            self._ring_missed(nbytes)
        return slot

    def _ring_missed(self, nbytes: int) -> None:
        """Ring staging found no room (its slots stay taken until students ack): counted, and said
        once with a ring size for the credit window at this sample's size, half again over it:
        samples queued for the sender or waiting for a credit take slots too (a 2 GiB ring of 32
        credits x 67 MB samples still missed 2-3% of them on an H100 host)."""
        self._timing.ring_missed += 1
        if self._ring_miss_said:
            return
        self._ring_miss_said = True
        t = self.cfg.transport
        logger.warning(
            "distill: no room in the %.0f MB shared-memory ring for a %.1f MB sample (each slot stays "
            "taken until a student acks it): this one and later ones that find no room go through a "
            "pinned range and a host copy, which costs the teacher more (connector timing: "
            "ring_missed). To keep them on the ring, transport.shm_bytes about %.0f MB per student "
            "(1.5 x credit_samples %d x samples of this size: samples queued for the sender or "
            "waiting for a credit hold slots too). Said once.",
            t.shm_bytes / 1e6, nbytes / 1e6, 1.5 * t.credit_samples * nbytes / 1e6, t.credit_samples,
        )  # fmt: skip

    def _extract(self, pending, info: SampleInfo | None, *, wait: bool = False) -> bool:
        """Copy one finished request's rows off the cache and queue them for the sender thread
        (CUDA: on a side stream into its ring slot (`ring_staging`) or else a reused pinned buffer;
        CPU: a plain gather). False (nothing
        done) when every pinned staging buffer is busy: the caller keeps the request's blocks and
        tries again at a later step. `wait`: never defer (a pageable, synchronous copy instead;
        used at shutdown). A sample over `staging_bytes` is queued as `Pieces`
        (teacher/connector/staging.py) that the sender thread copies; its blocks stay held meanwhile."""
        if info is None:  # cannot happen unless scheduler/worker bookkeeping diverged
            info = self._info_for(pending.req_id, None)
            info.path = pending.filename
        t_plan = time.perf_counter()
        kv = self._cache
        num_tokens = int(pending.token_ids.shape[0])
        quantize = self.cfg.hidden_dtype == "fp8"
        slots = slot_mapping(pending.block_ids, self._block_size, num_tokens)
        mask = positions = None
        if info.capture == "loss_mask":  # only the trained positions' rows leave the cache
            mask = loss_mask(info, num_tokens)
            positions = held_positions(mask)
            slots = slots.index_select(0, positions.long())
        num_rows = int(slots.shape[0])
        whole = _fits(num_rows, self._staged_token, self.cfg.staging_bytes)
        copy_done = copy_start = staging = pieces = stream = slot = None
        perm = self._perm
        t_stream = time.perf_counter()
        if kv.is_cuda and whole and self._ring_host is not None:
            if mask is None:
                mask = loss_mask(info, num_tokens)
            slot = self._ring_slot(num_rows, mask, positions, pending.token_ids)
        if kv.is_cuda and slot is None:
            elems = kv.numel() // (kv.shape[0] * self._block_size)  # values per token (all layers)
            token_bytes = elems + 4 * max(1, len(self.layer_ids)) if quantize else elems * kv.element_size()
            nbytes = num_rows * token_bytes + SLACK if whole else self.cfg.staging_bytes
            staging = self._pinned.take(nbytes) if self._pinned is not None else None
            if staging is None and not wait and self._pinned is not None and self._pinned.capacity > 0:
                return False  # every pinned buffer busy: later, never a synchronous copy here
        if kv.is_cuda:
            stream = self._get_copy_stream()
            ready = torch.cuda.Event()
            ready.record()  # at bind time: before this step's forward, after every earlier write
            stream.wait_event(ready)
            copy_start = torch.cuda.Event(enable_timing=True)
            copy_start.record(stream)
        t_launch = time.perf_counter()
        with torch.cuda.stream(stream) if stream is not None else nullcontext(), _sync_allowed():
            if stream is not None:
                if self._perm is not None and self._perm_dev is None:
                    self._perm_dev = self._perm.to(kv.device)
                # From pinned memory: CUDA may make a pageable host-to-device copy wait for the copy
                # stream first, which would block the engine thread until the earlier work is done.
                perm, slots = self._perm_dev, slots.pin_memory().to(kv.device, non_blocking=True)
            if slot is not None:  # straight into the page-locked ring slot
                hosts = [slot.tensors[k] for k in _STAGED if k in slot.tensors]
                try:
                    self._note_staging(stage_into(kv, slots, perm, quantize, hosts))
                except BaseException:
                    self._publisher.release_slot(slot)
                    raise
                copy_done = torch.cuda.Event(enable_timing=True)
                copy_done.record(stream)
            elif whole:  # configured layer order; fp8: quantized on the GPU
                hosts, work = stage_whole(kv, slots, perm, quantize, staging)
                self._note_staging(work)
                if staging is not None and hosts[0].data_ptr() != staging.data_ptr():
                    self._pinned.give(staging)  # the cache held more per token than estimated
                    staging = None
                if stream is not None:
                    copy_done = torch.cuda.Event(enable_timing=True)
                    copy_done.record(stream)
            else:
                piece = _piece_tokens(self.cfg.staging_bytes, self._staged_token)
                pieces = Pieces(kv, slots, perm, quantize, piece, stream=stream, staging=staging)
                hosts = pieces.placeholders()
                self._timing.pieces += 1
        t_rest = time.perf_counter()
        tm = self._timing
        tm.extract_plan_s += t_stream - t_plan
        tm.extract_stream_s += t_launch - t_stream
        tm.extract_launch_s += t_rest - t_launch
        tm.extracted += 1
        if staging is not None:
            self._note_staging(staging.numel())
        elif slot is not None:
            self._timing.ring_staged += 1
        elif kv.is_cuda:
            self._timing.pageable_copies += 1  # no pinned pool (pinned_buffers: 0) or shutdown
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = take_lock(info.path)
        self._pending_copies[pending.req_id] = pieces or copy_done
        job = SendJob(pending.req_id, info, pending.token_ids.clone(), hosts[0], copy_done, staging, lock_fd)
        job.pieces, job.slot = pieces, slot
        job.copy_start = copy_start if copy_done is not None else None
        if quantize:
            job.hidden_scale, job.model_dtype = hosts[1], kv.dtype
        job.loss_mask, job.positions = mask, positions
        self._timing.queue_peak = max(self._timing.queue_peak, self._queue.qsize() + 1)
        try:
            self._queue.put_nowait(job)
        except queue.Full:  # the sender thread is behind: the engine step waits here
            t0 = time.perf_counter()
            self._queue.put(job)
            self._timing.engine_wait_s += time.perf_counter() - t0
        self._timing.last_queued_t = time.monotonic()
        return True

    def _note_staging(self, nbytes: int) -> None:
        with self._peak_lock:
            self._timing.staging_peak_bytes = max(self._timing.staging_peak_bytes, nbytes)

    def _timed_extract(self, pending, info: SampleInfo | None) -> bool:
        """`_extract`, its engine-thread seconds counted in `extract_s`."""
        t0 = time.perf_counter()
        try:
            return self._extract(pending, info)
        finally:
            self._timing.extract_s += time.perf_counter() - t0

    def _extract_or_defer(self, pending, info: SampleInfo | None) -> None:
        """Pending saves are copied in order: behind earlier deferred ones, or deferred too."""
        if not self._deferred and self._timed_extract(pending, info):
            return
        self._deferred.append((pending, info))
        self._pending_copies[pending.req_id] = _DEFERRED
        self._timing.deferred += 1

    def _retry_deferred(self) -> None:
        while self._deferred:
            pending, info = self._deferred[0]
            if not self._timed_extract(pending, info):
                return
            self._deferred.popleft()

    def _sender_failure(self) -> dict:
        """For the stats file: why the sender thread stopped placing samples, if it did."""
        e = self._sender_error
        if e is None:
            return {}
        return {"sender_error": f"{type(e).__name__}: {e}", "sender_errors": self._placed["errors"]}

    def _check_sender(self) -> None:
        if self._sender_error is not None:
            raise RuntimeError(
                f"distill sender thread failed: {self._sender_error!r}"
            ) from self._sender_error

    def bind_connector_metadata(self, connector_metadata) -> None:
        """Every step, before its forward is launched: the pending saves (requests that finished in
        an earlier step, whose rows every earlier kernel has written, the drafter's included) are
        taken off the cache here, so on CUDA their copy overlaps this step's forward instead of
        waiting for it (the copy stream waits on an event recorded now)."""
        super().bind_connector_metadata(connector_metadata)
        if self._allocator_at_start is None and self._cache is not None and self._cache.is_cuda:
            self._allocator_at_start = _allocator_counts(self._cache.device)
        self._check_sender()  # a dead sender would never take a queued job
        self._retry_deferred()
        meta = connector_metadata
        if isinstance(meta, _ref.ExampleHiddenStatesConnectorMetadata) and self._is_tp_rank_zero:
            samples = getattr(meta, "distill_samples", {})
            for pending in meta.pending_saves:
                self._extract_or_defer(pending, samples.get(pending.req_id))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._check_sender()
        self._retry_deferred()  # buffers the sender gave back during this step's forward
        self._finished_reqs.update(finished_req_ids)
        done: set[str] = set()
        for req_id in list(self._finished_reqs):
            if req_id in self._pending_copies:
                event = self._pending_copies[req_id]
                if event is _DEFERRED or (event is not None and not event.query()):
                    continue  # not copied yet, or the device-to-host copy still running: keep the blocks
                del self._pending_copies[req_id]
                done.add(req_id)
            self._finished_reqs.discard(req_id)
            lock_fd = self._lock_fds.pop(req_id, None)  # aborted before extraction
            if lock_fd is not None:
                os.close(lock_fd)
        return done or None, None

    def _count(self, placed: str | None = None, **seconds: float) -> None:
        """(Sender threads) One more sample `placed` that way, and seconds added to `_timing`."""
        with self._count_lock:
            if placed is not None:
                self._placed[placed] += 1
            for k, v in seconds.items():
                setattr(self._timing, k, getattr(self._timing, k) + v)

    def _stamp(self, name: str) -> None:
        """(Sender threads) `_timing.<name>` = now, if later than what another sender wrote."""
        with self._count_lock:
            setattr(self._timing, name, max(getattr(self._timing, name), time.monotonic()))

    def _send_loop(self) -> None:
        """Sender thread (teacher.sender_threads of them): take the next job, wait for its copy,
        build the Sample, place it (stream or spool)."""
        while True:
            job = self._queue.get()
            if job is _STOP:
                return
            t0 = time.perf_counter()
            try:
                if self._abandon:  # shutdown, the spool full and nobody to drain it: not placed
                    self._count("unplaced")
                    if job.copy_done is not None:  # its ring slot / pinned range is unmapped next
                        job.copy_done.synchronize()
                    continue
                self._place(job)
            except BaseException as e:  # surfaced on the next engine step (get_finished)
                if self._abandon:  # the submit that waited for room, let go by stop_waiting_for_room
                    self._count("unplaced")
                    continue
                self._count("errors")
                logger.exception("distill: placing sample %r failed", job.info.key)
                if self._sender_error is None:
                    self._sender_error = e
                    if self._stats is not None:  # distill-teacher names it when the engine dies of it
                        self._stats.write()
            finally:
                if job.lock_fd is not None:
                    os.close(job.lock_fd)  # releases LOCK_EX: load_hidden_states readers proceed
                self._count(sender_busy_s=time.perf_counter() - t0)

    def _place(self, job: SendJob) -> None:
        hs = job.hidden_states
        if job.copy_done is not None:
            t0 = time.perf_counter()
            job.copy_done.synchronize()
            self._count(wait_copy_s=time.perf_counter() - t0)
            if job.copy_start is not None:
                self._count(d2h_s=job.copy_start.elapsed_time(job.copy_done) / 1000)
        if job.pieces is None:
            self._stamp("last_on_host_t")  # (pieces: once the last is copied)
        # Names in sorted order: a spool file lists its tensors so, and its digest covers them in
        # the order the producer had them (the same order, then).
        tensors = {"hidden_states": hs}
        if job.hidden_scale is not None:  # hidden_dtype fp8: the scales travel beside the values
            tensors[fp8.SCALE_KEY] = job.hidden_scale
        num_tokens = int(job.token_ids.shape[0])
        tensors["loss_mask"] = job.loss_mask if job.loss_mask is not None else loss_mask(job.info, num_tokens)
        if job.positions is not None:  # capture loss_mask: the rows `hidden_states` holds
            tensors[POSITIONS_KEY] = job.positions
        tensors["token_ids"] = job.token_ids
        slot = fused = None
        tree = self.cfg.transport.checksum == "xxh3-tree"
        if job.slot is not None:
            # Its rows were copied from the device into this ring slot: only the small host
            # tensors (loss mask, positions, token ids) are written here.
            t0 = time.perf_counter()
            slot = job.slot
            out = dict(slot.tensors)
            if list(out) != list(tensors):  # (a failure stops the engine: the slot is not given back)
                raise RuntimeError(f"ring slot holds {list(out)}, the sample {list(tensors)}")
            for k, t in tensors.items():
                if out[k] is not t:
                    out[k].copy_(t)
            tensors = out
            self._count(copy_s=time.perf_counter() - t0)
        elif job.staging is not None or job.pieces is not None:
            # Out of the pinned buffer (it goes back to the pool at once), or piece by piece off the
            # cache (a sample over staging_bytes): straight into a slot of the Publisher's
            # shared-memory ring when there is room (the one host copy a same-host student needs),
            # else into fresh pageable memory.
            t0 = time.perf_counter()
            size = self.cfg.transport.max_buffer_bytes
            if tree and job.pieces is None:  # each leaf hashed by the thread that copied it
                fused = CopyDigest(self._copy_pool, self.cfg.copy_threads)
            tensors, slot = destination(self._publisher, size, tensors, _STAGED, fused or self._copy)
            if job.pieces is not None:  # (a failure stops the engine: the slot is not given back)
                job.pieces.run([tensors[k] for k in tensors if k in _STAGED], copy=self._copy)
                self._note_staging(job.pieces.peak)
                self._stamp("last_on_host_t")
            if job.staging is not None:
                self._pinned.give(job.staging)
            self._count(copy_s=time.perf_counter() - t0)
        x3t = None
        if tree:
            # The xxh3 tree digest. Staged whole: its 4 MiB leaves were hashed inside the copy
            # threads as they wrote them (only the small host tensors are hashed here); otherwise
            # hashed now by the copy threads in parallel.
            t0 = time.perf_counter()
            values = list(tensors.values())
            x3t = fused.root(values) if fused is not None else self._digest(values)
            self._count(digest_s=time.perf_counter() - t0)
        meta = dict(job.info.meta)
        meta.setdefault("num_tokens", num_tokens)
        if job.model_dtype is not None:
            meta["hidden_dtype"] = fp8.dtype_name(job.model_dtype)
        sent = self.outgoing(dict(tensors))
        if any(sent.get(k) is not t for k, t in tensors.items()) or sent.keys() != tensors.keys():
            x3t = None  # changed after hashing: the Publisher hashes what is sent
        tensors = sent
        sample = Sample(key=job.info.key, tensors=tensors, layers=list(self.layer_ids), meta=meta)
        sample.x3t = x3t
        if job.info.verify:
            # The live probe: a copy of exactly what is delivered, for distill-teacher's verifier
            # (teacher/verify.py). Written here, on the sender thread, never on the engine step.
            write_sample(self.cfg.verify_dir, Sample(key=sample.key, tensors=tensors, layers=sample.layers))
        if self._publisher is None:
            with self._count_lock:
                self._spool_seq += 1
                sample.teacher, sample.seq = self._spool_tid, self._spool_seq
            where = str(write_sample(self.cfg.spool.dir, sample))
        else:
            t0 = time.perf_counter()
            where = self._publisher.submit(sample, slot=slot)
            self._count(submit_s=time.perf_counter() - t0)
        self._stamp("last_placed_t")
        if where.startswith("stream:"):
            self._count("stream")
            if job.lock_fd is not None:
                # Streamed: no file will appear; drop the lock so the spool folder stays clean
                # (a reader waiting on it then finds no file: FileNotFoundError, as documented).
                lock_path(job.info.path).unlink(missing_ok=True)
        else:
            self._count("spool")  # write_sample left the `.lock` vLLM's reader opens

    def outgoing(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors of one sample as they leave (sender thread, after hashing, before the live
        probe's copy and the Publisher): as they are. A subclass may return others (a tensor it
        replaced is hashed again by the Publisher); the test suite's faulty connectors do."""
        return tensors

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """`dst.copy_(src)`, split in chunks over the copy threads when it is large (CUDA path)."""
        return parallel_copy(self._copy_pool, self.cfg.copy_threads, dst, src)

    def _digest(self, tensors: list[torch.Tensor]) -> int:
        """The `x3t` tree digest of `tensors` (in order), its leaves hashed by the copy threads."""
        return parallel_digest(self._copy_pool, self.cfg.copy_threads, tensors)

    def _join_sender(self) -> None:
        """Stop the sender threads once they placed every queued sample: one stop mark each, put
        as the queue has room (a full queue behind senders that wait does not block this). A
        sender that waits for spool room (spool.max_bytes full) while no student takes samples
        gets drain_timeout_s; then it stops waiting and what is still held is left unplaced (not
        committed: the next run generates those keys), said in one line, instead of holding vLLM's
        shutdown until vLLM kills the worker."""
        pub = self._publisher
        stops = len(self._senders)
        while True:
            while stops:
                try:
                    self._queue.put(_STOP, timeout=0.05)
                except queue.Full:
                    break
                stops -= 1
            alive = [t for t in self._senders if t.is_alive()]
            if not alive:
                return
            alive[0].join(0.05)
            if self._abandon or pub is None or pub.spool_full_wait_s() <= self.cfg.drain_timeout_s:
                continue
            if pub.stats().get("students"):
                continue  # a student may still take samples and make room
            self._abandon = True
            with self._queue.mutex:
                queued = sum(job is not _STOP for job in self._queue.queue)
            logger.warning(
                "distill: spool.max_bytes is full and no student takes samples: %d samples queued "
                "at shutdown are not placed (not committed: the next run generates them)",
                queued + len(alive),  # the queued ones + those waiting for room (one per sender)
            )
            pub.stop_waiting_for_room()  # the senders drop the rest; their stop marks go in

    def shutdown(self):
        if self._closed:
            return
        self._closed = True
        if self._deferred:
            # The engine stopped stepping with samples still waiting for a pinned buffer: copy
            # them now (synchronously; nothing else runs on the engine any more).
            logger.info("distill: %d samples waited for a pinned buffer at shutdown", len(self._deferred))
            try:
                while self._deferred:
                    pending, info = self._deferred.popleft()
                    self._extract(pending, info, wait=True)
            except Exception:  # the cache may be gone: those keys are generated again next run
                logger.exception("distill: could not copy %d deferred samples", len(self._deferred) + 1)
        if self._senders:
            self._join_sender()
        if self._ring_host is not None:  # no copy into the ring is left; the Publisher still reads it
            self._ring_host.close()
        if self._publisher is not None:
            pub = self._publisher
            pub.close_input()
            # Students holding samples get up to drain_timeout_s to ack them; everything else
            # (waiting, in flight, unacked) is spooled by close() at once. While no student has
            # come yet and connect_timeout_s has not passed (a short generation), samples waiting
            # in memory get the same time for a first student. This Publisher never sends END
            # (auto_end=False): distill-teacher's serve phase replays the spool and decides when
            # the run is complete. vLLM kills a slow shutdown: keep this short.
            deadline = time.monotonic() + self.cfg.drain_timeout_s
            while time.monotonic() < deadline:
                st = pub.stats()
                if not (st.get("inflight", 0) or st.get("pending", 0)):
                    break
                if not st.get("students") and not pub.awaiting_students():
                    break
                time.sleep(0.05)
            pub.close()
            if self._stats is not None:
                self._stats.close()
            # (The Publisher's spool files have their `.lock` companion: distill.spool.write_sample.)
            logger.info("distill: publisher closed: %s", pub.stats())
            if self.cfg.journal:  # distill-teacher's sizing figures for the generate phase
                try:
                    write_flow(self.cfg.journal, pub.stats(), pub.student_names())
                except OSError as e:
                    logger.warning("distill: could not write the flow counters: %s", e)
        for fd in self._lock_fds.values():
            os.close(fd)
        self._lock_fds.clear()
        if self._copy_pool is not None:
            self._copy_pool.shutdown(wait=True)
        if self._pinned is not None:
            self._pinned.close()
        if self._senders:
            # (the pool: buffers pinned; the block: most ranges out at once, and their bytes)
            pinned = self._pinned.peak if self._pinned is not None else 0
            short = getattr(self._pinned, "error", None)  # pinned memory ran out (warned then)
            logger.info(
                "distill: samples placed: %s; pinned staging buffers: %d%s",
                self._placed,
                pinned,
                f" (pinning stopped: {short})" if short is not None else "",
            )
            if isinstance(self._pinned, PinnedBlock):
                logger.info(
                    "distill: pinned block: %d bytes, at most %d bytes out at once",
                    self._pinned.nbytes,
                    self._pinned.peak_bytes,
                )
            logger.info("distill: connector timing: %s", self._timing.line())
            if getattr(self, "_kv_cache", None) is not None and self._kv_cache.is_cuda:
                # allocation retries and device-wide syncs of the worker process (vLLM's included):
                # a gather that has to free cached memory first stalls the engine
                now = _allocator_counts(self._kv_cache.device)
                logger.info("distill: cuda allocator: %s", now)
                if self._allocator_at_start is not None:  # the same, counted from the first step on
                    since = {
                        k: now[k] - v
                        for k, v in self._allocator_at_start.items()
                        if now.get(k) is not None and v is not None
                    }
                    logger.info("distill: cuda allocator since the first step: %s", since)

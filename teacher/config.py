"""Typed teacher configuration: the run file's `teacher` section and the connector's extra config.

Both are validated once, at load (`distill.config.validate`): unknown keys and bad values fail with
their dotted name before vLLM starts.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from distill.config import SpoolConfig, Strict, TransportConfig, load_yaml, validate
from distill.config import eagle3_layer_ids as _eagle3_formula
from distill.errors import ConfigError
from teacher.errors import DuplicateField


def extraction_engine_args(
    layer_ids: list[int],
    connector_extra: dict[str, Any],
    *,
    connector: str = "DistillHiddenStatesConnector",
    module: str | None = "teacher.connector",
) -> dict[str, Any]:
    """`vllm.LLM` keyword arguments that extract `layer_ids` (the `extract_hidden_states`
    speculative method) and hand each finished request to `connector` (default: ours, configured
    by `connector_extra`, i.e. a ConnectorConfig as a dict). `module=None`: a connector vLLM ships."""
    kv = {"kv_connector": connector, "kv_role": "kv_producer", "kv_connector_extra_config": connector_extra}
    if module:
        kv["kv_connector_module_path"] = module
    return {
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
        },
        "kv_transfer_config": kv,
    }


class ConnectorTuning(Strict):
    """Connector settings that the run file's `teacher` section sets too: one definition (and one
    default) for both `TeacherConfig` and `ConnectorConfig`; distill-teacher hands them over with
    `TeacherConfig.connector_tuning()`."""

    # Samples copied off the cache but not yet handed to the Publisher; beyond it the engine step
    # waits (only when even the spool cannot keep up).
    queue_samples: int = Field(64, gt=0)
    # CUDA only: the most reused pinned staging buffers for the device-to-host copy, one per request
    # from its end until the sender copied it out; the pool allocates one only when no idle buffer
    # is large enough. Keep it at 3-4x the requests that finish per engine step: a request that
    # finds none free waits for a later step (BENCHMARKS.md, "Pinned buffers: 32 or 64").
    pinned_buffers: int = Field(64, ge=0)
    # CUDA only: make new pinned staging buffers on a thread of the pool's own instead of the
    # engine thread (pinning a 64 MiB buffer takes tens of milliseconds, during which the engine
    # launches nothing); a request whose buffer is being made waits for a later step, and one
    # buffer is made ahead of need. Off until measured on a GPU side by side with the inline pool
    # (benchmarks/gpu_teacher.py modes Cb, C8b, Db).
    pinned_background: bool = False
    # CUDA only: > 0 pins one block of this many bytes when the engine starts, never while it
    # serves; each copy takes a range of its sample's size out of it (first fit, at most
    # pinned_buffers at once), given back once copied out. 0: the pool above, which pins a buffer
    # (the sample rounded up to a power of two) on the engine thread whenever none idle is large
    # enough. At least staging_bytes when set; left at its default it grows to staging_bytes when
    # that is larger. Measured side by side with the pool on an H100 (benchmarks/gpu_teacher.py
    # modes C, C8, D against Co, C8o, Do): at 8 layers the pool pinned 8 GiB on the engine thread.
    pinned_bytes: int = Field(4 * 1024 * 1024 * 1024, ge=0)
    # CUDA only, with the same-host ring (transport.shm): the shared-memory ring is page-locked for
    # the GPU while the engine starts (all of transport.shm_bytes is then in memory from the start)
    # and each sample that fits is copied from the device straight into its ring slot: no pinned
    # buffer and no host copy out of it (the sender only hashes the slot). A sample that finds the
    # ring full, or a ring that cannot be reserved whole, takes the pinned path below. false: always
    # the pinned path (benchmarks/gpu_teacher.py modes Cr, C8r).
    ring_staging: bool = True
    # CUDA only: threads that copy each sample out of its pinned buffer (into the shared-memory
    # ring or pageable memory), in chunks; torch releases the GIL while copying. 1: one copy on
    # the sender thread. Shortens the time from a request's end to the student having it.
    copy_threads: int = Field(4, ge=1, le=64)
    # Threads that place samples (wait for a sample's copy, hash it, hand it to the Publisher,
    # which writes a spool file when memory is full or no student takes it): each takes the next
    # sample of the queue, so a slow spool write does not hold the samples behind it. 1: one
    # sender, samples handed over in the order their requests finished.
    sender_threads: int = Field(1, ge=1, le=16)
    # The most the connector stages at once for one sample, in bytes: its pinned host buffer (CUDA)
    # and the rows it gathers off the cache in one step (with fp8 also their float32 work copies).
    # A longer sample is copied in pieces of at most half of it (one piece copied out while the next
    # comes off the device) straight into its destination, which still holds the whole sample.
    # Default 512 MiB: Qwen3-8B samples in bf16 go in one piece below 16k tokens with 4 layers
    # (32 KiB a token), 8k with 8, and 2.9k with 4 layers in fp8 (its work copies: 176 KiB a
    # token). At least 1 MiB.
    staging_bytes: int = Field(512 * 1024 * 1024, ge=1024 * 1024)
    # The dtype hidden states travel and are spooled in: `model` (the model's own), or `fp8`:
    # float8 e4m3 with one float32 scale per token and layer (distill/fp8.py), half the bytes;
    # receivers (Subscriber.get, read_spool_file) hand back the model dtype, within 1/16 of each
    # value (plus scale/1024 for values near zero).
    hidden_dtype: Literal["model", "fp8"] = "model"
    # Which token positions' states travel and are spooled: `all`, or `loss_mask`: only those where
    # the sample's loss_mask is 1 (a chat row's assistant turns, generated tokens), named by the
    # sample's `positions` [R] int32 (distill/capture.py); token_ids and loss_mask stay whole. A
    # sample whose mask is all zeros then holds no states (R = 0). A request's
    # kv_transfer_params["capture"] overrides it for that request.
    capture: Literal["all", "loss_mask"] = "all"
    # At engine (connector) shutdown, generation done: wait at most this long for students to ack
    # the samples they hold before the Publisher spools the rest (the serve phase replays the spool).
    drain_timeout_s: float = Field(5.0, ge=0)

    @model_validator(mode="after")
    def _pinned_block(self) -> ConnectorTuning:
        if "pinned_bytes" not in self.model_fields_set and self.pinned_bytes < self.staging_bytes:
            self.pinned_bytes = self.staging_bytes  # the default block holds one staged sample
        if self.pinned_bytes and self.pinned_bytes < self.staging_bytes:
            raise ValueError(
                f"pinned_bytes ({self.pinned_bytes}) must be 0 or at least staging_bytes "
                f"({self.staging_bytes}): the block holds a staged sample"
            )
        return self


class ConnectorConfig(ConnectorTuning):
    """What `DistillHiddenStatesConnector` reads from `kv_connector_extra_config`."""

    # stream: hand samples to the ZeroMQ Publisher (it spools when no student / memory is full);
    # spool: write every sample to spool.dir as a safetensors file (vLLM's layout), no sockets.
    mode: Literal["stream", "spool"] = "stream"
    # Optional YAML run file whose `transport` and `spool` sections are used (handy for `vllm serve`);
    # keys given here as well override it.
    run_file: str | None = None
    transport: TransportConfig = Field(default_factory=TransportConfig)
    spool: SpoolConfig = Field(default_factory=SpoolConfig)
    # Append-only file of acknowledged sample keys (the resume record); None: no journal.
    journal: str | None = None
    # A file of sample keys, one a line: the Publisher replays only those keys' files of spool.dir
    # at start (distill-teacher writes `<journal>.replay-keys`, its run's keys not committed);
    # None: every file in spool.dir.
    replay_keys_file: str | None = None
    # Save generated tokens' states too when a request does not say (`include_output_tokens`).
    include_output_tokens: bool = False
    # Hold `<spool file>.lock` while a sample is undecided, so vLLM's `load_hidden_states` on the
    # returned path waits for it (as with vLLM's own connector).
    use_lock: bool = True
    # The live probe (teacher.verify_every): requests marked `verify` in their kv_transfer_params
    # get a copy of the delivered sample written here (distill-teacher checks and removes it).
    verify_dir: str | None = None
    # Mode stream: write the Publisher's stats (JSON) here every second and when it closes
    # (distill-teacher reads them for its metrics endpoint and summary); None: not written.
    stats_path: str | None = None

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        """Parse `kv_connector_extra_config` (plus its optional run file) into a ConnectorConfig."""
        data = dict(extra or {})
        run_file = data.get("run_file")
        if run_file:
            base = load_yaml(run_file)
            for section in ("transport", "spool"):
                merged = dict(base.get(section) or {})
                merged.update(data.get(section) or {})
                data[section] = merged
        return validate(cls, data, prefix="kv_connector_extra_config.")


class TeacherConfig(ConnectorTuning):
    """The `teacher` section of a run file."""

    # Local model folder (config.json + weights + tokenizer).
    model: str
    # Weights / activations dtype; the hidden states travel in this dtype.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # Longest prompt (+ generated tokens) in tokens; longer rows follow teacher.on_too_long.
    max_model_len: int = Field(2048, gt=0)
    tensor_parallel_size: int = Field(1, gt=0)
    # Layer ids to extract: 0 = embeddings, k = output of decoder layer k-1, L = num_hidden_layers =
    # the last layer's output BEFORE the final norm. `eagle3`: EAGLE-3's choice for an L-layer
    # model, [2, L//2, L-3, L] (3 aux layers + the last), resolved from the model's config.json.
    layer_ids: list[int] = Field(min_length=1)
    # vLLM: no CUDA graphs / compilation (faster start, slower steps).
    enforce_eager: bool = False
    # Must stay false: hidden-state extraction needs whole prompts in one step.
    enable_chunked_prefill: bool = False
    # CUDA: fraction of GPU memory vLLM may use.
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    # CPU: KV cache size in GiB (sets VLLM_CPU_KVCACHE_SPACE); None: vLLM's default.
    cpu_kvcache_space_gib: int | None = Field(None, gt=0)
    # vLLM load format: "auto", or "dummy" (random weights, for throughput runs).
    load_format: str = "auto"
    seed: int = 0

    # Dataset: a .jsonl file, a .parquet file, or a folder written by `datasets.save_to_disk`.
    dataset: str
    dataset_format: Literal["auto", "jsonl", "parquet", "hf"] = "auto"
    # Column with plain text, or with chat messages [{"role", "content"}] (the chat template applies).
    text_field: str = "text"
    messages_field: str = "messages"
    # Column with token ids (pre-tokenized data; no tokenizer needed, e.g. with dummy weights).
    tokens_field: str = "input_ids"
    # Column with a pre-tokenized row's loss mask (0/1 per token, as long as the tokens), passed
    # through to every sample's `loss_mask`; without it: all ones (all zeros when generated tokens
    # are kept). Text rows: all ones; chat rows: 1 on the assistant turns' tokens (teacher/data.py).
    loss_mask_field: str = "loss_mask"
    # Column with the sample key; None: the row number ("row-<n>").
    key_field: str | None = "id"
    # HF folders with several splits (DatasetDict): which one.
    split: str = "train"
    # Use at most this many rows (the first N of the dataset, bad rows included; None = all).
    max_samples: int | None = Field(None, gt=0)
    # A row that cannot be used (invalid JSON, no usable field, null/empty text, malformed chat
    # messages, invalid token ids, bad or duplicate key), found before vLLM starts: fail (exit 2,
    # one line per bad row) or skip (listed in `<journal>.skipped.jsonl`, counted in the summary,
    # exit 6 at the end instead of 0).
    on_bad_row: Literal["fail", "skip"] = "fail"
    # A row longer than max_model_len - max_tokens tokens: skip (as on_bad_row=skip: listed,
    # counted, exit 6), truncate (keep the first max_model_len - max_tokens tokens; counted in the
    # summary) or fail (every row is tokenized before vLLM starts; exit 2 naming the row).
    on_too_long: Literal["skip", "truncate", "fail"] = "skip"

    # Tokens to generate per prompt: 1 = prefill only; > 1 with include_output_tokens for draft-model
    # training data (the generated tokens' states are saved too, except the last one's).
    max_tokens: int = Field(1, gt=0)
    include_output_tokens: bool = False
    temperature: float = Field(0.0, ge=0)

    # Requests submitted to vLLM at once; memory stays flat whatever the dataset size.
    window: int = Field(64, gt=0)
    # Append-only journal of sample keys COMMITTED by students (trained and, with checkpointing,
    # covered by a checkpoint) plus `!lost<TAB>key` records; a restarted teacher skips committed
    # keys. Required: it is how this process learns what the students finished.
    journal: str = "runs/journal.txt"
    # Deprecated, ignored (the serve phase replaced the idle wait; see student_wait_s).
    idle_timeout_s: float | None = Field(None, ge=0)
    # What to do once everything is generated: serve (keep serving the spool until every sample is
    # committed, then send END) or exit (generate now, train offline later: everything not yet
    # committed is in the spool; exit 0).
    after_generation: Literal["serve", "exit"] = "serve"
    # Serve phase: give up (exit 3, everything left stays in the spool) when for this long no
    # student made progress: none connected, or connected ones committed/acked nothing and took no
    # sample. 0 = wait forever.
    student_wait_s: float = Field(600.0, ge=0)
    # Serve phase: a progress line on stderr this often.
    progress_every_s: float = Field(5.0, gt=0)
    # Where the run's summary JSON goes; None: `<journal>.summary.json`.
    summary_path: str | None = None
    # Prometheus endpoint of the whole run (http://0.0.0.0:<port>/metrics: both phases; the
    # generate phase's Publisher counters come from its connector); 0 = off. A port in use: exit 2.
    metrics_port: int = Field(0, ge=0, le=65535)
    # The connector's mode (ConnectorConfig.mode); its other settings the run file's transport and
    # spool sections do not cover are ConnectorTuning's (queue_samples, pinned_buffers,
    # copy_threads, drain_timeout_s).
    connector_mode: Literal["stream", "spool"] = "stream"
    # The live correctness probe (teacher/verify.py): every N-th submitted sample is recomputed
    # with transformers and compared (token ids, every delivered layer); 0 = off.
    verify_every: int = Field(0, ge=0)
    # A mismatch: warn (counted, logged, in the summary) or stop (generation stops, exit 5, no END).
    verify_fail: Literal["warn", "stop"] = "warn"
    # Relative tolerance (max abs difference / max abs value, per layer); None: by dtype
    # (float32 1e-3, float16 2e-2, bfloat16 5e-2).
    verify_tol: float | None = Field(None, gt=0)
    # Where transformers recomputes the probed samples.
    verify_device: str = "cpu"
    # Extra keyword arguments for vllm.LLM (escape hatch; prefer the typed keys above).
    engine_args: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _eagle3(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("layer_ids") == "eagle3":
            data = {**data, "layer_ids": eagle3_layer_ids(model_num_layers(str(data.get("model"))))}
        return data

    @field_validator("layer_ids")
    @classmethod
    def _layers(cls, v: list[int]) -> list[int]:
        if len(set(v)) != len(v):
            raise ValueError(f"layer ids must be distinct, got {v}")
        if any(x < 0 for x in v):
            raise ValueError(f"layer ids must be >= 0, got {v}")
        return v

    @model_validator(mode="after")
    def _rules(self) -> TeacherConfig:
        if self.enable_chunked_prefill:
            raise ValueError(
                "enable_chunked_prefill must be false: hidden-state extraction needs each prompt in "
                "one step. Remove it or set teacher.enable_chunked_prefill=false"
            )
        if self.verify_every and self.load_format == "dummy":
            raise ValueError(
                "verify_every needs the real weights (load_format=dummy gives random ones that "
                "transformers would not reproduce): set teacher.verify_every=0"
            )
        if self.include_output_tokens and self.max_tokens < 2:
            raise ValueError("include_output_tokens needs max_tokens >= 2 (the last token has no state)")
        return self

    def connector_tuning(self) -> dict[str, Any]:
        """The ConnectorTuning settings of this section, to build the connector's config from."""
        return self.model_dump(include=set(ConnectorTuning.model_fields))


def load_teacher_config(data: dict[str, Any] | None) -> TeacherConfig:
    if data is None:
        raise ConfigError("the run file has no 'teacher' section")
    if isinstance(data, dict) and data.get("layer_ids") == "eagle3" and isinstance(data.get("model"), str):
        # Resolved here too, so that its errors are one plain line (not wrapped by the validator).
        data = {**data, "layer_ids": eagle3_layer_ids(model_num_layers(data["model"]))}
    return validate(TeacherConfig, data, prefix="teacher.")


def _no_duplicate_fields(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise DuplicateField(k)
        out[k] = v
    return out


def loads_strict(text: str | bytes) -> Any:
    """json.loads, refusing an object with the same field twice (DuplicateField, a ValueError): the
    teacher's reader of JSON it is given (dataset rows, the model's config.json)."""
    return json.loads(text, object_pairs_hook=_no_duplicate_fields)


def _name_lines(text: str, name: str) -> str:
    """(the name is at lines a, b, ...): where a field name occurs in a JSON text."""
    pat = re.compile(re.escape(json.dumps(name)) + r"\s*:")
    lines = [text.count("\n", 0, m.start()) + 1 for m in pat.finditer(text)][:6]
    return f" (the name is at lines {', '.join(map(str, lines))})" if lines else ""


def model_config(model_dir: str) -> dict:
    """The text model's config.json of a local model folder (its `text_config` for multimodal ones).

    The one reader of a teacher's config.json. Raises ConfigError naming `teacher.model`.
    """
    p = Path(model_dir)
    cfg_path = p / "config.json"
    if not p.is_dir():
        raise ConfigError(
            f"teacher.model: {model_dir!r} is not a folder. Point it at a local model folder "
            "(config.json + weights + tokenizer); this teacher does not download models."
        )
    if not cfg_path.is_file():
        raise ConfigError(f"teacher.model: {model_dir!r} has no config.json: not a model folder")
    try:
        text = cfg_path.read_text()
        cfg = loads_strict(text)
    except DuplicateField as e:
        raise ConfigError(f"teacher.model: {cfg_path}: {e}{_name_lines(text, e.name)}") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"teacher.model: cannot read {cfg_path}: {e}") from None
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        return {**cfg["text_config"], **{k: cfg[k] for k in ("torch_dtype", "dtype") if k in cfg}}
    return cfg


def model_num_layers(model_dir: str) -> int:
    """num_hidden_layers from a local model folder's config.json."""
    n = model_config(model_dir).get("num_hidden_layers")
    if not isinstance(n, int) or isinstance(n, bool):
        raise ConfigError(f"teacher.model: {model_dir}/config.json has no integer num_hidden_layers")
    return n


_DTYPE_NAMES = {
    "float32": "float32",
    "torch.float32": "float32",
    "float": "float32",
    "float16": "float16",
    "torch.float16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "torch.bfloat16": "bfloat16",
}


def model_dtype(model_dir: str) -> str:
    """The checkpoint's dtype (what vLLM's dtype=auto uses): float32, float16 or bfloat16."""
    cfg = model_config(model_dir)
    name = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    return _DTYPE_NAMES.get(name, "bfloat16")


def eagle3_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's layers for an n-layer model: [2, n//2, n-3] (low, middle, high aux layers) and n
    (the last layer, before the final norm). Needs n >= 7 for four distinct ascending ids."""
    n = num_layers
    ids = _eagle3_formula(n)
    if ids != sorted(set(ids)):
        raise ConfigError(
            f"teacher.layer_ids: eagle3 means [2, n//2, n-3, n], which needs num_hidden_layers >= 7; "
            f"this model has {n} (would give {ids}): list the layer ids explicitly"
        )
    return ids


def check_layer_ids(layer_ids: list[int], num_layers: int) -> None:
    bad = [x for x in layer_ids if not 0 <= x <= num_layers]
    if bad:
        raise ConfigError(
            f"teacher.layer_ids: {bad} out of range for a model with num_hidden_layers={num_layers}; "
            f"valid ids are 0..{num_layers} (0 = embeddings, {num_layers} = last layer before the norm)"
        )

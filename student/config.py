"""The `student` section of a run file: model, layer map, losses, optimizer, run control.

Validated once at load (`load_student_config`); unknown keys fail with their dotted name.

Layer ids, on both sides (teacher/README.md, "Facts this design rests on"): 0 = embeddings, k = output of decoder
layer k-1 (= transformers `hidden_states[k]` for k < L), L = num_hidden_layers = output of the last
decoder layer BEFORE the final norm. transformers' own `hidden_states[L]` is after the norm; the
student reads its pre-norm last layer with a hook, so a student id means the same thing as a
teacher id.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from distill.config import RunFile, Strict, load_run_file, parse_override, validate
from distill.errors import ConfigError


class LayerPair(Strict):
    """One distilled pair: a student layer learns to match a teacher layer."""

    # Student layer id (0 = embeddings, k = after decoder layer k-1, L = last layer before final norm).
    student_layer: int = Field(ge=0)
    # Teacher layer id, same convention; the teacher must send it (its `layers` list).
    teacher_layer: int = Field(ge=0)
    # Weight of this pair in the hidden-state losses (mse, cosine, nmse).
    weight: float = Field(1.0, ge=0)


class LossWeights(Strict):
    """Weight per loss term; a term with weight 0 is not computed."""

    # Mean squared error between (projected) student and teacher states, per mapped pair.
    mse: float = Field(0.0, ge=0)
    # 1 - cosine similarity, per token, per mapped pair.
    cosine: float = Field(0.0, ge=0)
    # MSE after standardising each feature with the teacher's batch mean/std, per mapped pair.
    nmse: float = Field(1.0, ge=0)
    # KL(teacher || student) on next-token distributions; teacher logits are recomputed here from
    # the teacher's last layer (id L) with the teacher's final norm and LM head.
    kl: float = Field(0.0, ge=0)
    # Cross-entropy on the next token (the plain language-modelling loss).
    ce: float = Field(0.0, ge=0)


class Eagle3Config(Strict):
    """`student.eagle3`: the EAGLE-3 draft recipe (student/eagle3/draft.py; `recipe: eagle3`)."""

    # Teacher layer ids of the 3 auxiliary states fed to the draft's fc (distinct, < n); default
    # [2, n//2, n-3] for an n-layer teacher. The teacher must also send the last layer, n.
    aux_layer_ids: list[int] | None = None
    # Tokens of the draft LM head (the most frequent in vocab_from); None = the whole vocabulary.
    draft_vocab_size: int | None = Field(None, gt=0)
    # Token frequencies for the draft vocabulary, counted once before training: a JSONL dataset
    # (text / messages / prompt / token_ids rows), a spool folder, or a token_freq.pt. Needed when
    # draft_vocab_size is below the teacher's vocabulary.
    vocab_from: str | None = None
    # Training-time test: draft steps unrolled per position, and the weight decay per step.
    ttt_steps: int = Field(3, gt=0, le=8)
    ttt_decay: float = Field(0.8, gt=0)
    # The teacher's logits are divided by this before its distribution is taken (1: as it is; below
    # 1 sharpens it toward its top token, the one greedy serving accepts: for flat teachers).
    target_temperature: float = Field(1.0, gt=0)
    # vLLM's norm_before_residual (written to the export's config.json).
    norm_before_residual: bool = False
    # Draft layer widths; default: the teacher's.
    intermediate_size: int | None = Field(None, gt=0)
    num_attention_heads: int | None = Field(None, gt=0)
    num_key_value_heads: int | None = Field(None, gt=0)
    head_dim: int | None = Field(None, gt=0)
    # Dtype of the exported weights; None: the teacher's (vLLM runs the draft in the target's dtype).
    export_dtype: Literal["float32", "bfloat16", "float16"] | None = None


class StudentConfig(Strict):
    """Everything a student worker needs besides the transport/spool sections."""

    # distill: a student LM learns the teacher's states/logits (model, layer_map, losses below).
    # eagle3: an EAGLE-3 speculative-decoding draft (the `eagle3` section; model/from_config,
    # layer_map and losses are not used; teacher_model is required); exported for vLLM.
    recipe: Literal["distill", "eagle3"] = "distill"  # a name in student.recipes.RECIPES
    eagle3: Eagle3Config | None = None

    # --- model ---
    # Local checkpoint folder of the student (transformers save_pretrained layout) ...
    model: str | None = None
    # ... or a transformers config dict (with `model_type`) to train from scratch.
    from_config: dict[str, Any] | None = None
    # Teacher checkpoint folder: its config (hidden size, layers) and, for KL, its final norm + LM head.
    teacher_model: str | None = None
    # Teacher hidden size when no teacher_model is given (needed to build projections up front).
    teacher_hidden_size: int | None = Field(None, gt=0)
    # Layer pairs to distil.
    layer_map: list[LayerPair] = Field(default_factory=list)
    # auto: a learned linear projection per pair when hidden sizes differ; always: one per pair;
    # never: hidden sizes must match (an error otherwise).
    projection: Literal["auto", "always", "never"] = "auto"

    # --- losses ---
    losses: LossWeights = Field(default_factory=LossWeights)
    # Softmax temperature of the KL term (the term is scaled by temperature**2, as in Hinton et al.).
    temperature: float = Field(1.0, gt=0)
    # Tokens the loss terms are averaged over: all (every real token) or masked (only where the
    # teacher's per-sample `loss_mask` is 1: chat rows' assistant tokens, generated tokens, a
    # pre-tokenized row's mask column; samples without one count as all ones). See student/losses.py.
    loss_on: Literal["all", "masked"] = "all"

    # --- batching ---
    # packed: a micro-batch's samples one after another in one row, no padding; each sample keeps
    # its own positions and attends to itself only (variable-length FlashAttention on a GPU in
    # bf16/fp16, SDPA per sample otherwise: student/packing.py). padded: a sample per row, padded
    # on the right to the longest. The eagle3 recipe trains padded rows only (its default).
    batch_layout: Literal["packed", "padded"] = "packed"
    # Tokens per micro-batch per rank: packed, the samples' tokens; padded, batch size x longest
    # sample. A longer sample goes alone.
    max_tokens_per_batch: int = Field(4096, gt=0)
    # Optional cap on samples per micro-batch.
    max_samples_per_batch: int | None = Field(None, gt=0)
    # padded only: samples held to group by length: each micro-batch is the oldest held sample plus
    # the held samples closest to it in length (less padding). 0 or 1: batches in arrival order. In
    # stream mode at most half the credit window (transport.credit_samples x teachers).
    length_window: int = Field(32, ge=0)
    # A partial batch is trained once no sample arrived for this long (stream mode).
    idle_flush_s: float = Field(1.0, gt=0)
    # padded only: pad each micro-batch's length up to a multiple of this (fewer distinct shapes
    # for kernels that plan per shape). None: 64 with cudnn_attention on a GPU, else 1 (no rounding).
    pad_to_multiple_of: int | None = Field(None, gt=0)
    # Threads that copy a micro-batch's teacher rows into the packed host batch, a sample each, once
    # the rows come to 8 MiB (smaller batches: the loop's own thread). 1: the loop's thread only.
    # A GPU student reads about 8 KB a token from the ring, cold: one thread was the loop's limit
    # (student/README.md, "Collating in threads").
    collate_threads: int = Field(4, ge=1, le=64)
    # Fill the next micro-batch (wait for its samples, check and collate them) in a thread of its
    # own while this one's forward, backward and optimizer step run on the loop's thread, instead
    # of between them. The loop's collectives, acks and exactly-once decisions are unchanged; the
    # next batch counts this one's samples as held against the credit window until they are acked.
    fill_ahead: bool = False
    # Let PyTorch's SDPA use cuDNN attention on a GPU. It builds a plan per new (batch, length)
    # shape, ~30 ms of CPU per layer (H200 profile), and token-budget batches rarely repeat a
    # shape; off, SDPA uses its flash / memory-efficient kernels.
    cudnn_attention: bool = False

    # --- optimisation ---
    optimizer: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    # transformers schedule name; linear/cosine need max_steps.
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    # Micro-batches per optimizer step (fewer at the end of the stream, or when every rank is idle).
    grad_accum_steps: int = Field(1, gt=0)
    # Gradient-norm clipping; 0 = off.
    max_grad_norm: float = Field(1.0, ge=0)
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    # DDP's find_unused_parameters (an extra pass over the graph every step). None: only when some
    # parameter gets no gradient (no kl/ce term, so the layers above the deepest mapped one and the
    # LM head are unused; or projections without a hidden-state term).
    find_unused_parameters: bool | None = None
    # Stop after this many optimizer steps; None = until the teacher (or spool) is exhausted.
    max_steps: int | None = Field(None, gt=0)
    seed: int = 0

    # --- run control ---
    # stream: receive from the teacher (transport.connect); spool: read a spool folder.
    mode: Literal["stream", "spool"] = "stream"
    # Spool folder for mode=spool; default: the run file's spool.dir.
    spool_dir: str | None = None
    # Layer ids of `hidden_states` in spool files that do not record them (vLLM's own
    # ExampleHiddenStatesConnector writes none: give its eagle_aux_hidden_state_layer_ids, in order).
    spool_layers: list[int] | None = None
    # Final model, metrics.json and tracker logs go here.
    output_dir: str = "runs/student"
    # Checkpoints (accelerator.save_state + ledger) every N optimizer steps; 0 = never.
    checkpoint_every: int = Field(0, ge=0)
    # Default: <output_dir>/checkpoints.
    checkpoint_dir: str | None = None
    # Keep only the newest N checkpoints (0 = keep all).
    checkpoint_keep: int = Field(2, ge=0)
    # Resume from a checkpoint folder, or "latest" (the newest in checkpoint_dir; fresh start if none).
    resume_from: str | None = None
    # Seconds a collective (the per-step agreement, DDP's gradient all-reduce, a checkpoint barrier)
    # may wait for the other ranks before it fails (Accelerate's InitProcessGroupKwargs). A rank
    # whose host vanished without closing its connections is noticed after this long; one whose
    # process died at once. Either way every surviving rank exits 4 with one line (student/README.md,
    # "Multi-node"). Keep it well above any pause a rank may take (a long checkpoint save, a frozen rank).
    collective_timeout_s: float = Field(600.0, gt=0)
    # Log every N optimizer steps (main process).
    log_every: int = Field(10, gt=0)
    # Prometheus endpoint of each rank: rank r serves http://0.0.0.0:<metrics_port + r>/metrics
    # (student/exporter.py); 0 = off. A port in use: exit 2.
    metrics_port: int = Field(0, ge=0, le=65535)
    # Accelerate trackers, e.g. [tensorboard].
    trackers: list[Literal["tensorboard"]] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check(self) -> StudentConfig:
        RECIPE_RULES[self.recipe](self)  # the recipe's own rules (and defaults)
        if self.lr_schedule in ("linear", "cosine") and self.max_steps is None:
            raise ValueError(f"lr_schedule {self.lr_schedule!r} needs max_steps (or use 'constant')")
        return self

    @property
    def ckpt_dir(self) -> str:
        return self.checkpoint_dir or f"{self.output_dir}/checkpoints"


def _distill_rules(cfg: StudentConfig) -> None:
    """Recipe `distill`: a student model (checkpoint or config), a teacher for KL, a layer map for
    the hidden-state terms, and something to train."""
    if (cfg.model is None) == (cfg.from_config is None):
        raise ValueError("set exactly one of 'model' (a checkpoint folder) or 'from_config' (a config dict)")
    if cfg.from_config is not None and "model_type" not in cfg.from_config:
        raise ValueError("'from_config' needs a 'model_type' (e.g. qwen3, llama)")
    if cfg.losses.kl > 0 and cfg.teacher_model is None:
        raise ValueError("losses.kl > 0 needs 'teacher_model' (its final norm and LM head give the logits)")
    if cfg.teacher_model is None and cfg.teacher_hidden_size is None and cfg.layer_map:
        raise ValueError("set 'teacher_model' or 'teacher_hidden_size' so projections can be built")
    hidden_terms = cfg.losses.mse + cfg.losses.cosine + cfg.losses.nmse
    if hidden_terms > 0 and not cfg.layer_map:
        raise ValueError("mse/cosine/nmse weights are set but 'layer_map' is empty")
    if hidden_terms + cfg.losses.kl + cfg.losses.ce == 0:
        raise ValueError("every loss weight is 0: nothing to train")


def _eagle3_rules(cfg: StudentConfig) -> None:
    """Recipe `eagle3`: the draft is built from the teacher; its section and `loss_on` default."""
    if cfg.teacher_model is None:
        raise ValueError("recipe eagle3 needs 'teacher_model' (embeddings, final norm and LM head)")
    if cfg.model is not None or cfg.from_config is not None or cfg.layer_map:
        raise ValueError(
            "recipe eagle3 builds its draft from the teacher: drop model, from_config and layer_map"
        )
    if cfg.eagle3 is None:
        cfg.eagle3 = Eagle3Config()
    if "loss_on" not in cfg.model_fields_set:
        cfg.loss_on = "masked"  # a draft learns the responses (EAGLE-3 trainers do the same)
    if "batch_layout" not in cfg.model_fields_set:
        cfg.batch_layout = "padded"
    elif cfg.batch_layout == "packed":
        raise ValueError(
            "recipe eagle3 trains padded rows (its steps read each row's next positions): set "
            "batch_layout: padded or leave it out"
        )


# The config rules of each recipe named in `StudentConfig.recipe` (what it builds and trains:
# student/recipes/).
RECIPE_RULES = {"distill": _distill_rules, "eagle3": _eagle3_rules}


def load_student_config(path: str, overrides: list[str] | None = None) -> tuple[StudentConfig, RunFile]:
    """Load a run file, apply `--set section.key=value` overrides, validate the student section.

    Raises:
        ConfigError: unreadable file, unknown key, bad value (the message names the key).
    """
    pairs = dict(parse_override(o) for o in overrides or [])
    run = load_run_file(path, pairs)
    if run.student is None:
        raise ConfigError(f"config file {path!r} has no 'student' section")
    return validate(StudentConfig, run.student, prefix="student."), run

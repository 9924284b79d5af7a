"""The e2e benchmarks' assets and run file: the model pairs (GPU and tiny), the teacher model and
dataset built locally (`build_assets`), and run.yaml (`run_config`, `--set` overrides)."""

from __future__ import annotations

import json
from pathlib import Path

# The ~0.8B pair (GPU) and a tiny pair for CPU smoke runs.
TEACHER_GPU = dict(
    hidden_size=2048,
    intermediate_size=6144,
    num_layers=16,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    vocab_size=8192,
)


TEACHER_TINY = dict(
    hidden_size=128,
    intermediate_size=256,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    vocab_size=1024,
)


# Qwen3-1.7B's shape (a real model's full size; random weights): the EAGLE-3 run's teacher.
TEACHER_EAGLE3_GPU = dict(
    hidden_size=2048,
    intermediate_size=6144,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    vocab_size=151936,
)


TEACHER_EAGLE3_TINY = dict(TEACHER_TINY, num_layers=8)  # eagle3 needs >= 7 layers


TEACHER_QWEN3_8B = dict(
    hidden_size=4096,
    intermediate_size=12288,
    num_layers=36,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    vocab_size=151936,
)


QWEN3_8B_BUILT_LAYERS = 1


# A 2-layer student of the same width (the shape of a 1-2 layer draft / distilled head).
STUDENT_QWEN3_8B = dict(
    model_type="qwen3",
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=2,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    tie_word_embeddings=False,
)


STUDENT_GPU = dict(
    model_type="qwen3",
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=8192,
    tie_word_embeddings=False,
)


STUDENT_TINY = dict(
    model_type="qwen3",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    vocab_size=1024,
    tie_word_embeddings=False,
)


def build_assets(args, work: Path) -> tuple[Path, Path]:
    import torch

    from testkit.tiny import build_tiny_model, write_tiny_dataset

    if args.tiny:
        spec = TEACHER_EAGLE3_TINY if args.recipe == "eagle3" else TEACHER_TINY
        teacher = build_tiny_model(work / "teacher", dtype=torch.float32, **spec)
        data = write_tiny_dataset(work / "data.jsonl", args.rows, seed=1, min_words=5, max_words=60)
    elif args.preset == "qwen3-8b":
        spec = dict(TEACHER_QWEN3_8B, num_layers=QWEN3_8B_BUILT_LAYERS)
        teacher = build_tiny_model(work / "teacher_8b", dtype=torch.bfloat16, **spec)
        conf = json.loads((teacher / "config.json").read_text())
        conf["num_hidden_layers"] = TEACHER_QWEN3_8B["num_layers"]
        conf.pop("layer_types", None)  # one entry per built layer: let transformers fill it for 36
        (teacher / "config.json").write_text(json.dumps(conf, indent=1))
        data = write_tiny_dataset(work / "data.jsonl", args.rows, seed=1, min_words=50, max_words=600)
    else:
        spec = TEACHER_EAGLE3_GPU if args.recipe == "eagle3" else TEACHER_GPU
        teacher = build_tiny_model(work / "teacher", dtype=torch.bfloat16, **spec)
        data = write_tiny_dataset(work / "data.jsonl", args.rows, seed=1, min_words=50, max_words=600)
    return teacher, data


def set_dotted(cfg: dict, dotted: str, value) -> None:
    parts = dotted.split(".")
    d = cfg
    for k in parts[:-1]:
        d = d.setdefault(k, {})
    d[parts[-1]] = value


SECTIONS = ("teacher", "student", "transport", "spool")  # the run file's sections


def parse_sets(items, prefix: str = "") -> list[tuple[str, object]]:
    """`--set` / `--alone-set` items (each a comma-separated list of section.key=value; the value
    read as YAML; "" adds nothing) as (dotted key, value) pairs.

    Raises:
        ValueError: an item that is not section.key=value with a known section (one line).
    """
    import yaml

    pairs = []
    for item in (x for group in items for x in group.split(",") if x):
        key, eq, raw = item.partition("=")
        key = prefix + key.strip()
        section, dot, rest = key.partition(".")
        if not eq or not dot or not rest or section not in SECTIONS:
            raise ValueError(
                f"{item!r} is not section.key=value with a section of {', '.join(SECTIONS)} "
                "(the defaults are an empty argument: --alone-set '')"
            )
        pairs.append((key, yaml.safe_load(raw)))
    return pairs


def apply_sets(cfg: dict, items, prefix: str = "") -> None:
    """KEY=VALUE overrides (YAML values) into `cfg`; `items` may hold comma-separated lists."""
    for key, value in parse_sets(items, prefix):
        set_dotted(cfg, key, value)


def check_variants(cfg: dict, variants) -> None:
    """Validate run.yaml with each `--alone-set` variant applied as the teacher and the student
    will (typed configs), before any phase spends GPU time on one they would refuse.

    Raises:
        ConfigError: one line naming the variant and the key.
    """
    from distill.config import RunFile, validate
    from distill.errors import ConfigError
    from student.config import StudentConfig
    from teacher.config import load_teacher_config

    for variant in variants or [""]:
        data = json.loads(json.dumps(cfg))
        apply_sets(data, [variant])
        try:
            validate(RunFile, data)
            load_teacher_config(data.get("teacher"))
            validate(StudentConfig, data.get("student"), prefix="student.")
        except ConfigError as e:
            raise ConfigError(
                f"--alone-set {variant!r}: {e}" if variant else f"run.yaml with --set: {e}"
            ) from None


def use_port(cfg: dict, port: int) -> None:
    """The teacher binds and the student connects on 127.0.0.1:`port`."""
    ep = f"tcp://127.0.0.1:{port}"
    cfg["transport"]["bind"], cfg["transport"]["connect"] = [ep], [ep]  # two lists: no YAML alias


def run_config(args, work: Path, teacher: Path, data: Path, port: int, spool: str) -> dict:
    n_layers = (TEACHER_TINY if args.tiny else TEACHER_GPU)["num_layers"]
    if args.recipe == "eagle3":
        n_layers = 4  # placeholders: replaced by layer_ids eagle3 below
        layer_ids = [1, 2, 3, 4]
        layer_map = []
    elif args.tiny:
        layer_ids = [1, 2, 3, 4]
        layer_map = [{"student_layer": 1, "teacher_layer": 2}, {"student_layer": 2, "teacher_layer": 4}]
    elif args.preset == "qwen3-8b":
        n_layers = TEACHER_QWEN3_8B["num_layers"]
        layer_ids = [2, 18, 33, 36]
        layer_map = [{"student_layer": 1, "teacher_layer": 18}, {"student_layer": 2, "teacher_layer": 36}]
    else:
        layer_ids = [4, 8, 12, 16]
        layer_map = [{"student_layer": 2, "teacher_layer": 8}, {"student_layer": 4, "teacher_layer": 16}]
    assert layer_ids[-1] == n_layers
    teacher_sec = {
        "model": str(teacher),
        "dtype": "float32" if args.tiny else "bfloat16",
        "max_model_len": 2048,
        "layer_ids": layer_ids,
        "dataset": str(data),
        "window": 64 if args.tiny else 256,
        "journal": str(work / "journal.txt"),
    }
    if args.tiny:
        teacher_sec.update(enforce_eager=True, cpu_kvcache_space_gib=1)
    else:
        teacher_sec.update(gpu_memory_utilization=0.45, engine_args={"max_cudagraph_capture_size": 32})
        if args.preset == "qwen3-8b":
            teacher_sec["engine_args"]["load_format"] = "dummy"  # random weights at full size
    cfg = {
        "teacher": teacher_sec,
        "transport": {
            "bind": [f"tcp://127.0.0.1:{port}"],
            "connect": [f"tcp://127.0.0.1:{port}"],
            "connect_timeout_s": 120,
        },
        "spool": {"dir": spool},
        "student": {
            "from_config": dict(
                STUDENT_TINY if args.tiny else STUDENT_QWEN3_8B if args.preset == "qwen3-8b" else STUDENT_GPU
            ),
            "teacher_model": str(teacher),
            "layer_map": layer_map,
            "losses": {"nmse": 1.0, "kl": 1.0},
            # 8,192 for the 152k vocabulary: the KL's fp32 logits of 16k tokens would need ~20 GB
            "max_tokens_per_batch": 512 if args.tiny else 8192 if args.preset == "qwen3-8b" else 16384,
            "mixed_precision": "no" if args.tiny else "bf16",
            "lr": 1e-4,
            "output_dir": str(work / "student"),
            "checkpoint_every": 0,
            "log_every": 10,  # the default: a log line per step costs ~8% here (probe, H200)
        },
    }
    if args.recipe == "eagle3":
        teacher_sec["layer_ids"] = "eagle3"
        st = cfg["student"]
        for k in ("from_config", "layer_map", "losses"):
            st.pop(k)
        st.update(
            recipe="eagle3",
            eagle3={"draft_vocab_size": 256 if args.tiny else 32000, "vocab_from": str(data), "ttt_steps": 3},
            max_tokens_per_batch=512 if args.tiny else 8192,
        )
    apply_sets(cfg, args.set)
    return cfg


def variant_label(variant: str, base_sets: list[str]) -> str:
    """How an alone variant is named in the figures and the log: its settings, and the run's own
    `--set` items under it ('' is the defaults only when no `--set` changed them)."""
    if not base_sets:
        return variant or "defaults"
    base = "--set " + ",".join(base_sets)
    return f"{variant} (over {base})" if variant else base

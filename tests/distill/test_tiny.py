"""testkit.tiny: the locally built model and dataset that the vLLM tests run on."""

from __future__ import annotations

import json
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from testkit.tiny import build_tiny_model, write_tiny_chat_dataset, write_tiny_dataset


def test_build_is_deterministic_cached_and_loads(tmp_path):
    a = build_tiny_model(tmp_path / "a", seed=3)
    b = build_tiny_model(tmp_path / "b", seed=3)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()

    mtime = (a / "model.safetensors").stat().st_mtime_ns
    t = time.monotonic()
    build_tiny_model(tmp_path / "a", seed=3)
    assert time.monotonic() - t < 1.0  # cached: nothing rebuilt
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime

    c = build_tiny_model(tmp_path / "a", seed=4)  # other params: rebuilt in place
    assert (c / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()

    model = AutoModelForCausalLM.from_pretrained(b)
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim, cfg.vocab_size) == (128, 4, 32, 4096)
    w = model.model.layers[0].mlp.up_proj.weight
    assert abs(w.std().item() - 0.08) < 0.01
    tok = AutoTokenizer.from_pretrained(b)
    assert len(tok) == 4096
    ids = tok("the teacher model streams hidden states")["input_ids"]
    assert 1 < len(ids) < 20 and max(ids) < 4096
    out = model(torch.tensor([ids]))
    assert torch.isfinite(out.logits).all()


def test_chat_template_and_datasets(tmp_path):
    p = build_tiny_model(tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(p)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

    ds = write_tiny_dataset(tmp_path / "d.jsonl", 50, seed=1)
    rows = [json.loads(x) for x in ds.read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"row-{i:05d}" for i in range(50)]
    lengths = {len(r["text"].split()) for r in rows}
    assert min(lengths) <= 10 and max(lengths) >= 40  # varied lengths
    assert write_tiny_dataset(tmp_path / "e.jsonl", 50, seed=1).read_text() == ds.read_text()

    chat = write_tiny_chat_dataset(tmp_path / "c.jsonl", 5)
    row = json.loads(chat.read_text().splitlines()[0])
    assert row["messages"][0]["role"] == "user"

"""The loss mask from the teacher: computed when the teacher tokenizes, carried to the
connector in each request's kv_transfer_params, delivered as `loss_mask` [num_tokens] uint8 in the
stream and in spool files; `layer_ids: eagle3`.

The expected masks are computed here independently of teacher/data.py: by scanning the token ids
of the tiny model's chat template (`<|im_start|>role\\n ... <|im_end|>\\n`) for assistant turns.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import faults
import pytest
import torch
import yaml

from distill.config import SpoolConfig, TransportConfig
from distill.errors import ConfigError
from distill.spool import list_spool, read_spool_file, spool_name
from teacher.config import TeacherConfig, eagle3_layer_ids, load_teacher_config
from teacher.data import Prompter, check_dataset, mask_spans, spans_mask
from testkit.tiny import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]

# Conversations: ending with the assistant (no generation prompt) and with the user.
CHATS = [
    [
        {"role": "system", "content": "the model of stream"},
        {"role": "user", "content": "which layer is the hidden state"},
        {"role": "assistant", "content": "the teacher sample batch"},
        {"role": "user", "content": "and the loss"},
        {"role": "assistant", "content": "student train data value of the token"},
    ],
    [
        {"role": "user", "content": "the batch of hidden state"},
        {"role": "assistant", "content": "is the stream"},
        {"role": "user", "content": "from the teacher"},
    ],
    [{"role": "user", "content": "a token"}, {"role": "assistant", "content": "data"}],
]


def expected_chat_mask(tok, ids: list[int]) -> list[int]:
    """1 on each assistant turn's tokens after its `<|im_start|>assistant\\n` header, through its
    `<|im_end|>` and the newline after it; found by scanning the ids (not by rendering prefixes)."""
    start, end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    mask = [0] * len(ids)
    i = 0
    while i < len(ids):
        if ids[i] != start:
            i += 1
            continue
        j, head = i + 1, ""
        while j < len(ids) and not head.endswith("\n"):
            head += tok.decode([ids[j]])
            j += 1
        if head.strip() == "assistant":
            k = j
            while k < len(ids) and ids[k] != end:
                mask[k] = 1
                k += 1
            if k < len(ids):
                mask[k] = 1  # <|im_end|>
                if k + 1 < len(ids) and tok.decode([ids[k + 1]]) == "\n":
                    mask[k + 1] = 1
            i = k
        else:
            i = j
    return mask


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("lm") / "tiny")


def _cfg(model, dataset="unused.jsonl", **kw) -> TeacherConfig:
    return TeacherConfig(model=str(model), dataset=str(dataset), layer_ids=[1], **kw)


# ---------------------------------------------------------------------------------------------
# Without vLLM: the Prompter's masks, row checks, eagle3.
# ---------------------------------------------------------------------------------------------


def test_chat_mask_is_the_assistant_tokens(chat_model):
    p = Prompter(_cfg(chat_model))
    for msgs in CHATS:
        ids, mask = p.encode_mask({"messages": msgs})
        assert ids == p.token_ids({"messages": msgs})  # the same prompt as before the mask
        want = expected_chat_mask(p.tok, ids)
        assert mask == want and 0 < sum(mask) < len(mask)
        assert p.last_spans == mask_spans(mask) and spans_mask(p.last_spans, len(ids)) == mask
        text = p.tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
        assert all(m["content"] in text for m in msgs if m["role"] == "assistant")
        assert not any(m["content"] in text for m in msgs if m["role"] != "assistant")


def _with_template(model: Path, dest: Path, template: str) -> Path:
    shutil.copytree(model, dest)
    cfg = json.loads((dest / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg))
    for extra in ("chat_template.jinja", "chat_template.json"):
        (dest / extra).unlink(missing_ok=True)
    return dest


GENERATION_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Renders the last assistant turn differently from an earlier one (as templates that drop earlier
# turns' reasoning do): the prefix of a conversation is not a prefix of the whole.
UNSTABLE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and loop.last %}<think></think>{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_generation_markers_give_the_same_mask(chat_model, tmp_path):
    marked = _with_template(chat_model, tmp_path / "marked", GENERATION_TEMPLATE)
    p, q = Prompter(_cfg(marked)), Prompter(_cfg(chat_model))
    assert p.has_generation_markers() and not q.has_generation_markers()
    for msgs in CHATS:
        ids, mask = p.encode_mask({"messages": msgs})  # transformers' return_assistant_tokens_mask
        assert (ids, mask) == q.encode_mask({"messages": msgs})  # prefix rendering + offsets
        assert mask == expected_chat_mask(p.tok, ids)


def test_template_that_is_not_prefix_stable_fails_before_the_engine(chat_model, tmp_path):
    model = _with_template(chat_model, tmp_path / "unstable", UNSTABLE_TEMPLATE)
    ds = tmp_path / "c.jsonl"
    ds.write_text(
        json.dumps({"id": "u", "messages": [{"role": "user", "content": "hi"}]})
        + "\n"
        + json.dumps({"id": "c", "messages": CHATS[0]})
        + "\n"
    )
    with pytest.raises(ConfigError) as e:
        check_dataset(_cfg(model, ds))
    msg = str(e.value)
    assert "\n" not in msg and "row 'c'" in msg and "not prefix-stable" in msg, msg
    assert msg.endswith(f"(first found at {ds}:2)")


def test_pre_tokenized_and_text_masks(chat_model):
    p = Prompter(_cfg(chat_model))
    row = {"input_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 0, 1, 1, 0]}
    assert p.encode_mask(row) == ([5, 6, 7, 8, 9], [0, 0, 1, 1, 0])
    assert p.encode({"input_ids": [5, 6], "loss_mask": [True, False]}) == ([5, 6], [[0, 1]])
    assert p.encode_mask({"input_ids": [5, 6]}) == ([5, 6], [1, 1])
    ids, mask = p.encode_mask({"text": "the model of"})
    assert ids and mask == [1] * len(ids)
    # Generated tokens kept: they are what to train on; a text prompt is all zeros then.
    g = Prompter(_cfg(chat_model, max_tokens=4, include_output_tokens=True))
    assert g.encode_mask({"text": "the model of"})[1] == [0] * len(ids)
    assert g.encode_mask({"input_ids": [5, 6]})[1] == [0, 0]
    assert g.encode_mask(row)[1] == [0, 0, 1, 1, 0]  # an explicit mask column stays
    msgs = CHATS[1]
    assert g.encode_mask({"messages": msgs}) == p.encode_mask({"messages": msgs})
    # Another column name.
    c = Prompter(_cfg(chat_model, loss_mask_field="labels_mask"))
    assert c.encode_mask({"input_ids": [5, 6], "labels_mask": [1, 0]})[1] == [1, 0]


BAD_MASK_ROWS = [
    (
        '{"id": "l", "input_ids": [1, 2, 3], "loss_mask": [1, 0]}',
        "('l'): field 'loss_mask' has 2 values for 3 tokens",
    ),
    (
        '{"id": "v", "input_ids": [1, 2], "loss_mask": [1, 2]}',
        "('v'): field 'loss_mask' holds values [2] (must be 0 or 1)",
    ),
    (
        '{"id": "f", "input_ids": [1, 2], "loss_mask": [1, 0.5]}',
        "('f'): field 'loss_mask' holds values [0.5]",
    ),
    (
        '{"id": "s", "input_ids": [1, 2], "loss_mask": "11"}',
        "('s'): field 'loss_mask' must be a list of 0/1 values, got str",
    ),
    (
        '{"id": "t", "text": "x", "loss_mask": [1]}',
        "('t'): field 'loss_mask' (teacher.loss_mask_field) goes with pre-tokenized rows ('input_ids') only",
    ),
]


@pytest.mark.parametrize(
    "line, expected", BAD_MASK_ROWS, ids=[e.split(")")[0][2:-1] for _, e in BAD_MASK_ROWS]
)
def test_bad_loss_mask_column_is_one_line_with_file_and_line(chat_model, tmp_path, line, expected):
    ds = tmp_path / "d.jsonl"
    ds.write_text('{"id": "ok", "input_ids": [1, 2], "loss_mask": [0, 1]}\n' + line + "\n")
    lines = []
    with pytest.raises(ConfigError) as e:
        check_dataset(_cfg(chat_model, ds), report=lambda b: lines.append(b.line()))
    assert len(lines) == 1 and lines[0].startswith(f"{ds}:2 ") and expected in lines[0], lines
    assert "\n" not in str(e.value) and lines[0] in str(e.value)
    assert check_dataset(_cfg(chat_model, ds, on_bad_row="skip"))[0] == ["ok"]


def test_eagle3_layer_ids(chat_model, tmp_path):
    assert eagle3_layer_ids(36) == [2, 18, 33, 36] and eagle3_layer_ids(7) == [2, 3, 4, 7]
    deep = tmp_path / "deep"
    deep.mkdir()
    conf = json.loads((chat_model / "config.json").read_text())
    (deep / "config.json").write_text(json.dumps({**conf, "num_hidden_layers": 12}))
    data = {"model": str(deep), "dataset": "d.jsonl", "layer_ids": "eagle3"}
    assert load_teacher_config(data).layer_ids == [2, 6, 9, 12]
    assert TeacherConfig(**data).layer_ids == [2, 6, 9, 12]  # built directly too
    # The 4-layer model is too small: one plain line.
    with pytest.raises(ConfigError) as e:
        load_teacher_config({**data, "model": str(chat_model)})
    assert str(e.value) == (
        "teacher.layer_ids: eagle3 means [2, n//2, n-3, n], which needs num_hidden_layers >= 7; "
        "this model has 4 (would give [2, 2, 1, 4]): list the layer ids explicitly"
    )
    with pytest.raises(ConfigError, match=r"^teacher.model: '/nonexistent' is not a folder"):
        load_teacher_config({**data, "model": "/nonexistent"})


# ---------------------------------------------------------------------------------------------
# Real vLLM: the mask travels through the connector (stream), and through distill-teacher into
# spool files (vLLM's reader and ours).
# ---------------------------------------------------------------------------------------------


def _collect(sub, n: int, timeout_s: float = 120.0) -> dict:
    got = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        s = sub.get(timeout=1.0)
        if s is None:
            continue
        assert s.key not in got, f"sample {s.key} delivered twice"
        got[s.key] = (
            s.tensors["token_ids"].tolist(),
            s.tensors["loss_mask"].clone(),
            list(s.layers),
            tuple(s.tensors["hidden_states"].shape),
        )
        sub.ack(s)
    return got


@pytest.mark.vllm
@pytest.mark.slow
def test_stream_carries_the_loss_mask(chat_model, tmp_path):
    """In-process vLLM with the connector streaming to a real Subscriber; layer ids not ascending
    (the connector permutes the layers, not the mask)."""
    pytest.importorskip("vllm")
    from vllm import LLM, SamplingParams

    from distill.transport import Subscriber
    from teacher.config import extraction_engine_args

    layer_ids = [4, 1, 3]
    ep = f"tcp://127.0.0.1:{faults.free_port()}"
    transport = TransportConfig(bind=[ep], connect=[ep], connect_timeout_s=120, heartbeat_timeout_s=30)
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    llm = LLM(
        model=str(chat_model),
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        enable_chunked_prefill=False,
        seed=0,
        **extraction_engine_args(
            layer_ids,
            {
                "mode": "stream",
                "transport": transport.model_dump(),
                "spool": SpoolConfig(dir=str(tmp_path / "spool")).model_dump(),
                "journal": str(tmp_path / "journal.txt"),
            },
        ),
    )
    sub = Subscriber(transport).start()
    try:
        p = Prompter(_cfg(chat_model))
        prompts, params, want = [], [], {}

        def add(key, ids, spans, gen=0, kv_extra=None):
            kv = {
                "sample_key": key,
                **({"loss_spans": spans} if spans is not None else {}),
                **(kv_extra or {}),
            }
            if gen:
                kv["include_output_tokens"] = True
            prompts.append({"prompt_token_ids": ids})
            params.append(
                SamplingParams(
                    max_tokens=max(gen, 1),
                    ignore_eos=True,
                    temperature=0.0,
                    extra_args={"kv_transfer_params": kv},
                )
            )

        # Chat rows: prefill only, and with 4 generated tokens (3 of them have a state).
        for i, msgs in enumerate(CHATS):
            ids, spans = p.encode({"messages": msgs})
            add(f"chat-{i}", ids, spans)
            want[f"chat-{i}"] = expected_chat_mask(p.tok, ids)
        ids, spans = p.encode({"messages": CHATS[1]})
        add("chat-gen", ids, spans, gen=4)
        want["chat-gen"] = expected_chat_mask(p.tok, ids) + [1, 1, 1]
        # Pre-tokenized with a mask column: passed through.
        tok_mask = [0, 1, 1, 0, 0, 1, 1, 1]
        ids, spans = p.encode({"input_ids": [11, 12, 13, 14, 15, 16, 17, 18], "loss_mask": tok_mask})
        add("tokens", ids, spans)
        want["tokens"] = tok_mask
        # A generated response from a text prompt: prompt 0, generated 1.
        g = Prompter(_cfg(chat_model, max_tokens=5, include_output_tokens=True))
        ids, spans = g.encode({"text": "the model of the stream"})
        add("text-gen", ids, spans, gen=5)
        want["text-gen"] = [0] * len(ids) + [1] * 4
        # Truncated prompt (on_too_long=truncate): spans past the prompt are clipped.
        ids, spans = p.encode({"messages": CHATS[0]})
        cut = len(ids) - 4
        add("truncated", ids[:cut], spans)
        want["truncated"] = expected_chat_mask(p.tok, ids)[:cut]
        # An outside client that sends no mask: all ones (prompt only).
        add("no-spans", [21, 22, 23], None)
        want["no-spans"] = [1, 1, 1]

        outs = llm.generate(prompts, params, use_tqdm=False)
        got = _collect(sub, len(want))
        assert set(got) == set(want)
        for out, (key, exp) in zip(outs, want.items(), strict=True):
            ids, mask, layers, shape = got[key]
            assert mask.dtype == torch.uint8 and mask.shape == (len(ids),), key
            assert mask.tolist() == exp, key
            assert layers == layer_ids and shape == (len(ids), 3, 128)
            assert ids[: len(out.prompt_token_ids)] == list(out.prompt_token_ids)
    finally:
        from teacher.engine import shutdown_llm

        shutdown_llm(llm, timeout_s=20)
        sub.close()


@pytest.mark.vllm
@pytest.mark.slow
def test_distill_teacher_spools_the_mask_with_eagle3_layers(tmp_path):
    """distill-teacher on chat rows with generated tokens, `layer_ids: eagle3` on an 8-layer model,
    no student: every sample spools; vLLM's own reader and ours read `loss_mask` from the files."""
    pytest.importorskip("vllm")
    import subprocess
    import sys

    from transformers import AutoTokenizer
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        load_hidden_states,
    )

    model = build_tiny_model(tmp_path / "tiny8", num_layers=8)
    rows = [{"id": f"c{i}", "messages": m} for i, m in enumerate(CHATS)]
    rows.append({"id": "tok", "input_ids": [7, 8, 9, 10, 11, 12], "loss_mask": [0, 0, 1, 1, 1, 0]})
    ds = tmp_path / "d.jsonl"
    ds.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {
        "teacher": {
            "model": str(model),
            "dtype": "float32",
            "max_model_len": 256,
            "layer_ids": "eagle3",
            "enforce_eager": True,
            "cpu_kvcache_space_gib": 1,
            "dataset": str(ds),
            "journal": str(tmp_path / "journal.txt"),
            "max_tokens": 4,
            "include_output_tokens": True,
            "temperature": 0.0,
            "after_generation": "exit",
        },
        # No student will connect: the Publisher spools every sample.
        "transport": {"bind": [f"tcp://127.0.0.1:{faults.free_port()}"], "connect_timeout_s": 0},
        "spool": {"dir": str(tmp_path / "spool")},
    }
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump(cfg))
    r = subprocess.run(
        [sys.executable, "-m", "teacher.cli", "--config", str(run)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(list_spool(tmp_path / "spool")) == len(rows)
    tok = AutoTokenizer.from_pretrained(model)
    for row in rows:
        path = tmp_path / "spool" / spool_name(row["id"])
        d = load_hidden_states(str(path))  # vLLM's reader: the extra tensor is one more dict entry
        assert set(d) == {"hidden_states", "token_ids", "loss_mask"}
        s = read_spool_file(path)  # ours (checks the CRC over all three tensors)
        assert s.layers == [2, 4, 5, 8] and d["hidden_states"].shape[1:] == (4, 128)
        ids = d["token_ids"].tolist()
        n_gen = 3  # 4 generated, the last has no state
        prompt = ids[: len(ids) - n_gen]
        if "messages" in row:
            exp = expected_chat_mask(tok, prompt)
        else:
            assert prompt == row["input_ids"]
            exp = row["loss_mask"]
        assert d["loss_mask"].dtype == torch.uint8
        assert d["loss_mask"].tolist() == exp + [1] * n_gen, row["id"]
        assert torch.equal(s.tensors["loss_mask"], d["loss_mask"])


# ---------------------------------------------------------------------------------------------
# Students: Batch.loss_mask (collate / select / to) and `student.loss_on`.
# ---------------------------------------------------------------------------------------------


def _sample(key: str, n: int, mask: list[int] | None, seed: int = 0):
    from distill.protocol import Sample

    g = torch.Generator().manual_seed(seed)
    tensors = {"hidden_states": torch.randn(n, 1, 8, generator=g), "token_ids": torch.arange(n) + 1}
    if mask is not None:
        tensors["loss_mask"] = torch.tensor(mask, dtype=torch.uint8)
    return Sample(key=key, tensors=tensors, layers=[2])


def test_batch_carries_the_loss_mask_padded_and_ones_without_one():
    from student.data import StudentError, check_sample, collate, empty_batch, select

    a, b, c = _sample("a", 5, [0, 0, 1, 1, 0]), _sample("b", 3, None), _sample("c", 2, [1, 0])
    host = collate([a, b, c], [2], pad_to_multiple_of=4)
    assert host.loss_mask.dtype == torch.bool and host.loss_mask.shape == host.mask.shape == (3, 8)
    assert host.loss_mask.int().tolist() == [
        [0, 0, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],  # no loss_mask (an older teacher / spool file): its real tokens
        [1, 0, 0, 0, 0, 0, 0, 0],
    ]
    assert torch.equal(host.to("cpu").loss_mask, host.loss_mask)
    sub = select(host, [2, 1])
    assert sub.loss_mask.int().tolist() == [[1, 0, 0, 0], [1, 1, 1, 0]]
    assert not empty_batch([2], 8).loss_mask.any()
    bad = _sample("bad", 4, [1, 0])
    with pytest.raises(StudentError, match=r"sample 'bad': loss_mask \[2\] must be \[T\] with T = 4 tokens"):
        check_sample(bad, [2], 8)


def test_loss_on_masked_changes_the_students_loss():
    from student.config import StudentConfig
    from student.data import collate
    from student.model import DistillModel, load_student
    from student.recipes.distill import Distill

    compute_loss = Distill().loss

    student = {
        "from_config": {
            "model_type": "qwen3",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "vocab_size": 64,
        },
        "teacher_hidden_size": 8,
        "layer_map": [{"student_layer": 1, "teacher_layer": 2}],
        "losses": {"mse": 1.0, "nmse": 1.0, "ce": 1.0},
    }
    torch.manual_seed(0)
    cfg_all = StudentConfig.model_validate(student)
    assert cfg_all.loss_on == "all"
    cfg_masked = StudentConfig.model_validate({**student, "loss_on": "masked"})
    model = DistillModel(load_student(cfg_all), [(1, 2)], 8, "auto")
    batch = collate([_sample("a", 6, [0, 0, 0, 1, 1, 1], seed=1), _sample("b", 4, [0, 1, 1, 0], seed=2)], [2])
    all_loss, all_terms = compute_loss(model, None, batch, cfg_all, None)
    masked, terms = compute_loss(model, None, batch, cfg_masked, None)
    assert set(terms) == {"mse", "nmse", "ce"}
    assert abs(masked.item() - all_loss.item()) > 1e-4
    # The same batch with every token trained gives the unmasked loss.
    ones = collate([_sample("a", 6, [1] * 6, seed=1), _sample("b", 4, [1] * 4, seed=2)], [2])
    torch.testing.assert_close(compute_loss(model, None, ones, cfg_masked, None)[0], all_loss)
    with pytest.raises(ValueError, match="loss_on"):
        StudentConfig.model_validate({**student, "loss_on": "assistant"})

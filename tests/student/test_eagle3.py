"""The EAGLE-3 draft recipe (student/eagle3/draft.py): vocabulary maps, the training-time-test forward
against a step-by-step reference, the loss's masks, the export layout, and (slow, vLLM) a draft
trained from the live stream served by vLLM: higher acceptance than an untrained one, the target's
own greedy output, and vLLM's acceptance counts equal to what the training forward predicts.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from distill.errors import ConfigError
from student.config import StudentConfig, load_student_config
from student.data import Batch, StudentError
from student.eagle3.draft import (
    build_draft,
    draft_loss,
    draft_to_target,
    eagle3_layer_ids,
    export_draft,
    target_to_draft,
    token_counts,
    vocab_maps,
)

ROOT = Path(__file__).resolve().parents[2]
AUX = [1, 2, 3]  # the 4-layer tiny teacher: [2, n//2, n-3] = [2, 2, 1] collides


def e3_cfg(teacher: Path, tmp: Path, **e3) -> StudentConfig:
    vocab = tmp / "vocab.jsonl"
    if not vocab.exists():
        rng = random.Random(0)
        vocab.write_text(
            "".join(
                json.dumps({"token_ids": [rng.randrange(300) for _ in range(50)]}) + "\n" for _ in range(20)
            )
        )
    section = {"aux_layer_ids": AUX, "draft_vocab_size": 256, "vocab_from": str(vocab), "ttt_steps": 3}
    section.update(e3)
    return StudentConfig(recipe="eagle3", teacher_model=str(teacher), eagle3=section)


def teacher_batch(teacher: Path, ids: list[int], lengths: list[int], seed: int = 0) -> Batch:
    """A right-padded batch of random tokens with the teacher's real states for `ids` (transformers)."""
    from transformers import AutoModelForCausalLM

    from teacher.reference import ReferenceStates

    model = AutoModelForCausalLM.from_pretrained(str(teacher), dtype=torch.float32).eval()
    ref = ReferenceStates(model)
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    x = torch.zeros(len(lengths), t, dtype=torch.long)
    mask = torch.zeros(len(lengths), t, dtype=torch.bool)
    states = torch.zeros(len(lengths), t, len(ids), model.config.hidden_size)
    for r, n in enumerate(lengths):
        row = torch.randint(0, model.config.vocab_size, (1, n), generator=g)
        x[r, :n], mask[r, :n] = row[0], True
        states[r, :n] = ref.states(row, ids)
    return Batch(x, mask, states, list(ids))


# --- vocabulary ------------------------------------------------------------------------------------


def test_vocab_maps_round_trip_and_most_frequent_tokens():
    counts = torch.tensor([5, 0, 9, 9, 1, 0, 7, 3])
    d2t, t2d = vocab_maps(counts, 4, always=[5])
    # the 3 most frequent (2, 3, 6; ties by id) plus the forced 5, draft ids ordered by target id
    assert draft_to_target(d2t).tolist() == [2, 3, 5, 6]
    assert d2t.tolist() == [2, 2, 3, 3] and d2t.dtype == torch.int64
    assert t2d.tolist() == [False, False, True, True, False, True, True, False]
    t2d_ids = target_to_draft(t2d)
    for d, t in enumerate(draft_to_target(d2t).tolist()):
        assert t2d_ids[t] == d  # target -> draft -> target
    assert (t2d_ids[~t2d] == -1).all()
    assert int(t2d.sum()) == d2t.numel()
    with pytest.raises(StudentError):
        vocab_maps(counts, 9)


def test_token_counts_from_jsonl_spool_and_pt(tiny_teacher, tmp_path):
    from distill.protocol import Sample
    from distill.spool import write_sample

    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"token_ids": [3, 3, 7]}) + "\n" + json.dumps({"text": "the model"}) + "\n")
    c = token_counts(str(rows), str(tiny_teacher), 1024)
    from transformers import AutoTokenizer

    text_ids = AutoTokenizer.from_pretrained(str(tiny_teacher))("the model")["input_ids"]
    expect = torch.zeros(1024, dtype=torch.long)
    for i in [3, 3, 7, *text_ids]:
        expect[i] += 1
    assert torch.equal(c, expect)
    spool = tmp_path / "spool"
    spool.mkdir()
    for k in range(2):
        s = Sample(
            key=f"k{k}",
            tensors={"hidden_states": torch.zeros(3, 1, 4), "token_ids": torch.tensor([1, 2, 2])},
            layers=[1],
            meta={},
        )
        write_sample(spool, s)
    c = token_counts(str(spool), str(tiny_teacher), 1024)
    assert c[1] == 2 and c[2] == 4 and int(c.sum()) == 6
    torch.save(expect, tmp_path / "token_freq.pt")
    assert torch.equal(token_counts(str(tmp_path / "token_freq.pt"), str(tiny_teacher), 1024), expect)


# --- the training forward -------------------------------------------------------------------------


def reference_logits(model, frozen, input_ids, aux, anchor: int, steps: int) -> list[torch.Tensor]:
    """vLLM's way, one anchor: step 0 over positions 0..anchor (keys from the teacher states), then
    one query per step at the anchor, fed with the previous step's output and the next true token,
    attending to step 0's keys 0..anchor and the anchor's own keys of steps 1..k. Explicit loops."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    layer, attn = model.midlayer, model.midlayer.self_attn
    nh, nkv, d = attn.heads, attn.kv_heads, attn.head_dim

    def rope(q, k, pos):
        cos, sin = model.rotary_emb(q, torch.tensor([[pos]]))
        return apply_rotary_pos_emb(q[None, :, None], k[None, :, None], cos, sin)

    def inputs(tok, hidden):
        normed = layer.hidden_norm(hidden)
        x = torch.cat([layer.input_layernorm(frozen.embed(tok)), normed], -1)
        return x, (normed if layer.norm_before_residual else hidden)

    def rest(x, residual, keys, vals, pos):
        q = attn.q_proj(x).view(nh, d)
        k = attn.k_proj(x).view(nkv, d)
        v = attn.v_proj(x).view(nkv, d)
        q, k = rope(q, k, pos)
        q, k = q[0, :, 0], k[0, :, 0]
        keys.append(k.repeat_interleave(nh // nkv, 0))
        vals.append(v.repeat_interleave(nh // nkv, 0))
        kk, vv = torch.stack(keys, 1), torch.stack(vals, 1)  # [h, n, d]
        p = torch.softmax((q[:, None] * kk).sum(-1) * d**-0.5, -1)  # [h, n]
        o = attn.o_proj((p[..., None] * vv).sum(1).reshape(-1))
        h = residual + o
        return h + layer.mlp(layer.post_attention_layernorm(h))

    with torch.no_grad():
        keys0, vals0, h = [], [], None
        for j in range(anchor + 1):  # step 0, causal: position j sees keys 0..j
            x, res = inputs(input_ids[j + 1], model.fc(aux[j]))
            ks, vs = keys0[:], vals0[:]
            h = rest(x, res, ks, vs, j)
            keys0.append(ks[-1])
            vals0.append(vs[-1])
        out = [model.lm_head(model.norm(h))]
        keys, vals = keys0[:], vals0[:]
        for k in range(1, steps):
            x, res = inputs(input_ids[anchor + k + 1], h)
            h = rest(x, res, keys, vals, anchor + k)
            out.append(model.lm_head(model.norm(h)))
    return out


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_ttt_forward_matches_a_step_by_step_reference(tiny_teacher, tmp_path, norm_before_residual):
    """Every TTT step's logits at every anchor equal an explicit vLLM-style unrolling (its own
    caches and attention loop); padding in another row changes nothing."""
    cfg = e3_cfg(tiny_teacher, tmp_path, norm_before_residual=norm_before_residual)
    model, frozen, ids = build_draft(cfg)
    assert ids == AUX + [4]
    batch = teacher_batch(tiny_teacher, ids, [12, 7])
    aux = batch.teacher[:, :, :3].reshape(2, 12, -1)
    steps = 3
    with torch.no_grad():
        got = model(frozen.embed(batch.input_ids), aux, batch.mask, steps)
    for row, n in ((0, 12), (1, 7)):
        for anchor in range(n - steps):
            ref = reference_logits(model, frozen, batch.input_ids[row], aux[row], anchor, steps)
            for k in range(steps):
                torch.testing.assert_close(got[k][row, anchor], ref[k], rtol=1e-4, atol=1e-4)


def test_draft_loss_masks_padding_loss_mask_and_empty_batches(tiny_teacher, tmp_path):
    cfg = e3_cfg(tiny_teacher, tmp_path)
    model, frozen, ids = build_draft(cfg)
    batch = teacher_batch(tiny_teacher, ids, [10, 6], seed=1)
    loss, terms = draft_loss(model, frozen, batch, cfg)
    assert loss.item() > 0 and set(terms) == {"ttt0", "acc0", "ttt1", "acc1", "ttt2", "acc2"}
    # what lies in the padding never matters
    noisy = Batch(batch.input_ids.clone(), batch.mask, batch.teacher.clone(), ids)
    noisy.input_ids[1, 6:] = 5
    noisy.teacher[1, 6:] = torch.randn_like(noisy.teacher[1, 6:])
    torch.testing.assert_close(draft_loss(model, frozen, noisy, cfg)[0], loss)
    # loss_mask all zero: nothing is scored, the loss is exactly 0 and still has a graph (DDP)
    batch.loss_mask = torch.zeros_like(batch.mask, dtype=torch.uint8)
    zero, _ = draft_loss(model, frozen, batch, cfg)
    assert zero.item() == 0.0 and zero.requires_grad
    zero.backward()
    assert all(p.grad is not None and p.grad.abs().sum() == 0 for p in model.parameters() if p.requires_grad)
    # a loss_mask that keeps only the second row = the second row alone
    batch.loss_mask = torch.zeros_like(batch.mask, dtype=torch.uint8)
    batch.loss_mask[1, :6] = 1
    alone = Batch(batch.input_ids[1:, :6], batch.mask[1:, :6], batch.teacher[1:, :6], ids)
    torch.testing.assert_close(
        draft_loss(model, frozen, batch, cfg)[0], draft_loss(model, frozen, alone, cfg)[0]
    )
    # the loop's zero-weight padding batch: one padding token
    empty = Batch(
        torch.zeros(1, 1, dtype=torch.long),
        torch.zeros(1, 1, dtype=torch.bool),
        torch.zeros(1, 1, 4, 128),
        ids,
    )
    assert draft_loss(model, frozen, empty, cfg)[0].item() == 0.0


def test_frozen_parts_come_from_the_teacher_and_get_no_gradient(tiny_teacher, tmp_path):
    from safetensors.torch import load_file

    model, frozen, ids = build_draft(e3_cfg(tiny_teacher, tmp_path))
    w = load_file(str(tiny_teacher / "model.safetensors"))
    assert torch.equal(frozen.embed_tokens.weight, w["model.embed_tokens.weight"].float())
    assert torch.equal(frozen.head.lm_head.weight, w["lm_head.weight"].float())
    assert torch.equal(frozen.head.norm.weight, w["model.norm.weight"].float())
    assert not any(p.requires_grad for p in frozen.parameters())
    assert torch.equal(
        model.lm_head.weight, w["lm_head.weight"].float()[model.draft_ids]
    )  # initial draft head
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in model.named_parameters()}  # the draft holds no frozen part
    assert {"fc.weight", "norm.weight", "lm_head.weight", "midlayer.self_attn.q_proj.weight"} <= trainable


def test_export_is_vllms_eagle3_layout(tiny_teacher, tmp_path):
    cfg = e3_cfg(tiny_teacher, tmp_path)
    model, _, _ = build_draft(cfg)
    out = export_draft(model, tmp_path / "draft")
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLMEagle3"]
    assert conf["eagle_aux_hidden_state_layer_ids"] == AUX
    assert conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == AUX
    assert conf["norm_before_residual"] is False
    assert conf["draft_vocab_size"] == 256 and conf["vocab_size"] == 1024
    assert conf["num_hidden_layers"] == 1 and conf["target_hidden_size"] == 128
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("fc.weight").shape == (128, 3 * 128)
        assert f.get_tensor("midlayer.self_attn.q_proj.weight").shape[1] == 2 * 128
        assert f.get_tensor("lm_head.weight").shape == (256, 128)
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    assert not any(n.startswith(("embed_tokens", "rotary")) for n in names)
    assert {"norm.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight"} <= names
    assert torch.equal(d2t, model.d2t) and torch.equal(t2d, model.t2d)
    assert (out / "token_freq.pt").is_file()


def test_config_errors_are_one_line(tiny_teacher, tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text("student:\n  recipe: eagle3\n  eagle3: {draft_vocab_size: 16}\n")
    with pytest.raises(ConfigError, match="teacher_model"):
        load_student_config(str(run))
    run.write_text(
        f"student:\n  recipe: eagle3\n  teacher_model: {tiny_teacher}\n  eagle3: {{ttt_stepz: 2}}\n"
    )
    with pytest.raises(ConfigError, match="ttt_stepz"):
        load_student_config(str(run))
    # the 4-layer default [2, 2, 1] collides
    cfg = StudentConfig(recipe="eagle3", teacher_model=str(tiny_teacher))
    with pytest.raises(StudentError, match="3 distinct"):
        build_draft(cfg)
    with pytest.raises(StudentError, match="vocab_from"):
        build_draft(
            StudentConfig(
                recipe="eagle3",
                teacher_model=str(tiny_teacher),
                eagle3={"aux_layer_ids": AUX, "draft_vocab_size": 8},
            )
        )
    assert eagle3_layer_ids(32) == [2, 16, 29, 32]


# --- end to end: live stream from the vLLM teacher, then served by vLLM ---------------------------

E2E_PROMPTS = 256  # training prompts; the teacher generates 48 tokens for each
E2E_K = 3  # num_speculative_tokens


def cyclic_target(root: Path) -> Path:
    """A tiny random Llama (8 layers) whose attention output projections are zero.

    A random transformer's greedy argmax is chaotic in its context (~13% of held-out transitions
    seen in 800 generations); with no attention output, its next token is a fixed function of the
    current one (a random mapping), so every greedy generation runs into one of a few cycles that
    a draft can learn from a few hundred generations in a minute of CPU, and generalise to prompts
    it never saw. vLLM still runs the whole target (attention included) and the whole EAGLE-3
    path: aux states, the draft's KV cache, d2t, rejection."""
    import shutil

    from safetensors.torch import load_file, save_file

    from testkit.tiny import build_tiny_model

    base = build_tiny_model(root / "base", arch="llama", num_layers=8, vocab_size=1024, seed=0)
    target = root / "target"
    shutil.copytree(base, target)
    w = load_file(str(base / "model.safetensors"))
    w = {k: v * 0 if k.endswith("self_attn.o_proj.weight") else v for k, v in w.items()}
    save_file(w, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def prompts_file(path: Path, n: int, seed: int) -> Path:
    from testkit.tiny import synthetic_text

    rng = random.Random(seed)
    rows = [{"id": f"p{seed}-{i:04d}", "text": synthetic_text(rng, rng.randint(3, 10))} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def predicted_acceptance(model, frozen, target: Path, prompts: list[str], outputs: list[list[int]], k: int):
    """What vLLM must count for `model` if its first pass and k-1 later steps are the training
    forward's: for each prompt, the greedy sequence (prompt + output) through the target
    (transformers) gives the aux states; from anchor a = last known position - 1 the draft proposes
    k tokens, the leading ones equal to the sequence are accepted, and the next anchor follows the
    accepted ones and the target's bonus token. vLLM verifies (and counts) the drafts of the last
    round past max_tokens too, so the sequence is extended by k greedy tokens (transformers).
    Returns (drafts, accepted per position)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    tmodel = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    aux_ids = model.config.eagle_aux_hidden_state_layer_ids
    drafts, per_pos = 0, [0] * k
    for text, out in zip(prompts, outputs, strict=True):
        p = tok(text)["input_ids"]
        seq = torch.tensor([p + out])
        t, last = seq.shape[1], len(p)  # `last`: the first generated token (from the prefill)
        with torch.no_grad():
            seq = tmodel.generate(seq, attention_mask=torch.ones_like(seq), max_new_tokens=k, do_sample=False)
            hs = tmodel(input_ids=seq, output_hidden_states=True).hidden_states
            aux = torch.cat([hs[i] for i in aux_ids], -1)
            logits = model(frozen.embed(seq), aux, torch.ones_like(seq, dtype=torch.bool), k)
        preds = [model.draft_ids[lg[0].argmax(-1)] for lg in logits]
        while last < t - 1:
            a, n = last - 1, 0
            while n < k and int(preds[n][a]) == int(seq[0, a + n + 2]):
                per_pos[n] += 1
                n += 1
            drafts += 1
            last += n + 1
    return drafts, per_pos


@pytest.mark.slow
@pytest.mark.vllm
def test_draft_trained_from_the_vllm_teacher_stream_speeds_up_vllm(tmp_path, procs):
    """distill-teacher (vLLM) generates 48 tokens for 256 prompts and streams prompt + response
    states (layers 2, 4, 5, 8; loss mask = the response) to `accelerate launch student.py` with
    recipe eagle3; the exported draft, served by vLLM on 16 prompts never seen in training,
    accepts clearly more tokens than the untrained draft of the same shape; greedy output with
    either draft is the target's own; and vLLM's acceptance counts are what the training forward
    predicts (the forward is vLLM's draft, step by step)."""
    pytest.importorskip("vllm")
    import yaml
    from faults import free_port

    target = cyclic_target(tmp_path)
    train = prompts_file(tmp_path / "train.jsonl", E2E_PROMPTS, seed=1)
    held = prompts_file(tmp_path / "held.jsonl", 16, seed=99)
    port = free_port()
    run = {
        "teacher": {
            "model": str(target),
            "dtype": "float32",
            "max_model_len": 512,
            "layer_ids": [2, 4, 5, 8],
            "enforce_eager": True,
            "cpu_kvcache_space_gib": 1,
            "dataset": str(train),
            "max_tokens": 48,
            "include_output_tokens": True,
            "journal": str(tmp_path / "journal.txt"),
            "window": 64,
        },
        "transport": {
            "bind": [f"tcp://127.0.0.1:{port}"],
            "connect": [f"tcp://127.0.0.1:{port}"],
            "connect_timeout_s": 300,
            # the serve phase lingers ~3 s for students to reconnect and get END; a student
            # re-says HELLO after heartbeat_timeout_s of silence (10 s by default: END is missed)
            "heartbeat_timeout_s": 3,
            "credit_samples": 32,
            "shm_dir": str(tmp_path),
        },
        "spool": {"dir": str(tmp_path / "spool")},
        "student": {
            "recipe": "eagle3",
            "teacher_model": str(target),
            "eagle3": {
                "aux_layer_ids": [2, 4, 5],
                "draft_vocab_size": 768,
                "vocab_from": str(train),
                "ttt_steps": E2E_K,
                "target_temperature": 0.1,
            },
            "max_tokens_per_batch": 512,
            "idle_flush_s": 0.5,
            "lr": 5.0e-3,
            "output_dir": str(tmp_path / "out"),
            "log_every": 4,
        },
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    bindir = Path(sys.executable).parent
    teacher = procs.start(
        "teacher", [str(bindir / "distill-teacher"), "--config", str(tmp_path / "run.yaml")], env
    )
    student = procs.start(
        "student",
        [str(bindir / "accelerate"), "launch", "--num_processes", "1", "--main_process_port", str(free_port()),
         "student.py", "--config", str(tmp_path / "run.yaml")],
        env,
    )  # fmt: skip
    assert student.wait(420) == 0, student.tail()
    assert teacher.wait(120) == 0, teacher.tail()
    m = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert m["summary"]["samples"] == E2E_PROMPTS
    steps = m["steps"]
    print(f"trained {len(steps)} steps: acc0 {steps[0]['acc0']:.2f} -> {steps[-1]['acc0']:.2f}")

    # the untrained draft: same config, same vocabulary, initial weights
    cfg = load_student_config(str(tmp_path / "run.yaml"))[0]
    untrained, frozen, _ = build_draft(cfg)
    export_draft(untrained, tmp_path / "untrained")
    trained_dir = tmp_path / "out" / "model"
    r = subprocess.run(
        [sys.executable, "-m", "student.eagle3.evaluate", "--target", str(target), "--prompts", str(held),
         "--k", str(E2E_K), "--draft", "none", "--draft", str(tmp_path / "untrained"), "--draft", str(trained_dir),
         "--out", str(tmp_path / "eval.json")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    alone, before, after = json.loads((tmp_path / "eval.json").read_text())
    print(
        f"mean acceptance length (k={E2E_K}, 16 unseen prompts): untrained {before['mean_acceptance_length']:.3f}, "
        f"trained {after['mean_acceptance_length']:.3f}; accepted per position {before['accepted_per_pos']} -> "
        f"{after['accepted_per_pos']}"
    )
    assert after["mean_acceptance_length"] >= before["mean_acceptance_length"] + 1.0
    assert before["outputs"] == alone["outputs"] and after["outputs"] == alone["outputs"]

    # vLLM counted what the training forward predicts, step by step
    from safetensors.torch import load_file

    trained, frozen, _ = build_draft(cfg)
    trained.load_state_dict(
        {k: v.float() for k, v in load_file(str(trained_dir / "model.safetensors")).items()}, strict=False
    )
    texts = [json.loads(line)["text"] for line in held.read_text().splitlines()]
    drafts, per_pos = predicted_acceptance(trained, frozen, target, texts, alone["outputs"], E2E_K)
    print(f"predicted by the training forward: {drafts} drafts, accepted per position {per_pos}")
    assert drafts == after["drafts"]
    for got, want in zip(after["accepted_per_pos"], per_pos, strict=True):
        assert abs(got - want) <= 1, (after["accepted_per_pos"], per_pos)  # (exact in every run so far)


@pytest.mark.parametrize("path", sorted(ROOT.glob("configs/eagle3_*.yaml")), ids=lambda p: p.name)
def test_eagle3_configs_load(path):
    """Each shipped eagle3 run file passes both loaders; the teacher sends the aux layers + the last."""
    from distill.config import load_run_file
    from teacher.config import load_teacher_config

    cfg, run = load_student_config(str(path))
    assert cfg.recipe == "eagle3" and cfg.loss_on == "masked"
    teacher = load_teacher_config(run.teacher)
    assert set(cfg.eagle3.aux_layer_ids) < set(teacher.layer_ids)
    assert max(teacher.layer_ids) not in cfg.eagle3.aux_layer_ids
    assert load_run_file(str(path), {}).student["recipe"] == "eagle3"
    assert path.read_text().startswith("# accelerate launch student.py --config " + f"configs/{path.name}")


@pytest.mark.slow
def test_untrained_baseline_draft_is_the_trainings_start(tiny_teacher, tmp_path):
    """`python -m student.eagle3.baseline` exports the draft a run file would start training from."""
    import yaml

    from student.eagle3.draft import build_draft

    cfg = e3_cfg(tiny_teacher, tmp_path, aux_layer_ids=[1, 2, 3])
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({"student": cfg.model_dump(mode="json")}))
    out = tmp_path / "untrained"
    p = subprocess.run(
        [sys.executable, "-m", "student.eagle3.baseline", "--config", str(run), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert (out / "config.json").is_file()
    want, _, _ = build_draft(cfg)
    with safe_open(str(out / "model.safetensors"), framework="pt") as fh:
        assert torch.equal(fh.get_tensor("fc.weight"), want.fc.weight.detach())
        assert fh.get_tensor("d2t").numel() == 256
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"student": {"recipe": "general"}}))
    p = subprocess.run(
        [sys.executable, "-m", "student.eagle3.baseline", "--config", str(bad), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_token_counts_from_a_spool_count_the_loss_masked_tokens(tiny_teacher, tmp_path):
    """A spool of generated answers counts the answers' tokens, not the prompts'."""
    from distill.protocol import Sample
    from distill.spool import write_sample

    s = Sample(
        key="k0",
        tensors={
            "hidden_states": torch.zeros(5, 1, 4),
            "token_ids": torch.tensor([9, 9, 9, 4, 5]),
            "loss_mask": torch.tensor([0, 0, 0, 1, 1], dtype=torch.uint8),
        },
        layers=[1],
        meta={},
    )
    write_sample(tmp_path, s)
    c = token_counts(str(tmp_path), str(tiny_teacher), 1024)
    assert c[9] == 0 and c[4] == 1 and c[5] == 1 and int(c.sum()) == 2

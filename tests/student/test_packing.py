"""The packed batch layout (`student.batch_layout: packed`, student/packing.py): the samples of a
micro-batch one after another in one row, each attending to itself only. What it must keep: the
same losses and gradients as the padded layout over the same samples (every term, with and without
a loss mask, samples holding some positions only, fp8 samples), a budget that counts tokens,
`select` equal to collating the kept samples, and no host read of a device value in a step. The
student loop itself runs packed in every system test (it is the default)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distill import fp8
from distill.protocol import Sample
from student import losses
from student.config import StudentConfig
from student.data import TokenBudgetBatcher, collate, select
from student.model import DistillModel, TeacherHead, load_student
from student.packing import Segments
from student.recipes.distill import Distill

STUDENT = {
    "from_config": {"model_type": "qwen3", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64},
    "teacher_hidden_size": 8,
    "layer_map": [{"student_layer": 1, "teacher_layer": 2}, {"student_layer": 2, "teacher_layer": 4}],
}  # fmt: skip


def sample(key: str, n: int, seed: int, loss_mask=None, positions=None) -> Sample:
    g = torch.Generator().manual_seed(seed)
    rows = n if positions is None else len(positions)
    t = {
        "hidden_states": torch.randn(rows, 2, 8, generator=g).to(torch.bfloat16),
        "token_ids": torch.randint(1, 64, (n,), generator=g),
    }
    if loss_mask is not None:
        t["loss_mask"] = torch.tensor(loss_mask, dtype=torch.bool)
    s = Sample(key=key, tensors=t, layers=[2, 4])
    if positions is not None:
        s.tensors["positions"] = torch.tensor(positions, dtype=torch.int32)
    return s


def quantized(s: Sample) -> Sample:
    q, scale = fp8.quantize(s.tensors["hidden_states"])
    s.tensors = {**s.tensors, "hidden_states": q, fp8.SCALE_KEY: scale}
    s.meta["hidden_dtype"] = "bfloat16"
    return s


def head() -> TeacherHead:
    torch.manual_seed(7)
    return TeacherHead(nn.RMSNorm(8), nn.Linear(8, 64, bias=False))


def step(layout: str, samples, student_cfg: dict):
    """Loss, terms and gradients of one micro-batch in `layout`, from the same initial weights."""
    weights = dict(student_cfg["losses"])
    kl = weights.pop("kl", 0.0)  # validated without: the test's head stands in for a teacher checkpoint
    cfg = StudentConfig.model_validate({**STUDENT, **student_cfg, "losses": weights, "batch_layout": layout})
    cfg.losses.kl = kl
    model = DistillModel(load_student(cfg), [(1, 2), (2, 4)], 8, "auto")
    batch = collate(samples, [2, 4], pack=layout == "packed")
    h = head() if cfg.losses.kl > 0 else None
    loss, terms = Distill().loss(model, h, batch.to("cpu"), cfg, 4)
    loss.backward()
    return loss.detach(), terms, [p.grad.clone() for p in model.parameters() if p.grad is not None], batch


MASKS = [[0, 1, 1, 0, 1], [1, 1, 0], [0, 0, 1, 1, 1, 1, 1], [1]]


@pytest.mark.parametrize(
    "student_cfg",
    [
        {"losses": {"nmse": 1.0, "mse": 0.5, "cosine": 0.5, "kl": 1.0, "ce": 1.0}},
        {"losses": {"nmse": 1.0, "kl": 1.0, "ce": 1.0}, "loss_on": "masked"},
    ],
    ids=["all", "masked"],
)
def test_packed_gives_the_padded_losses_and_gradients(student_cfg):
    """Four samples of 5, 3, 7 and 1 tokens: the packed row (no padding) and the padded rows give
    the same terms and gradients, so no sample attends to, or predicts, another one's tokens."""
    samples = [sample(k, len(m), i, loss_mask=m) for i, (k, m) in enumerate(zip("abcd", MASKS, strict=True))]
    lp, tp, gp, bp = step("padded", samples, student_cfg)
    lk, tk, gk, bk = step("packed", samples, student_cfg)
    assert bp.input_ids.shape == (4, 7) and bk.input_ids.shape == (1, 16) and bk.segments == [5, 3, 7, 1]
    assert bool(bk.mask.all()) and not bk.padded
    assert set(tp) == set(tk) == set(student_cfg["losses"])
    for k in tp:
        torch.testing.assert_close(tk[k], tp[k], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lk, lp, rtol=1e-5, atol=1e-6)
    assert len(gp) == len(gk) > 0
    for a, b in zip(gp, gk, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_a_packed_row_without_boundaries_would_differ():
    """The check above can fail: the same packed row read as one long sample (no segments) gives
    another ce (token 5 would be predicted from sample a's tokens)."""
    samples = [sample("a", 5, 1), sample("b", 3, 2)]
    logits = torch.randn(1, 8, 64)
    ids = collate(samples, [2, 4], pack=True).input_ids
    seg = Segments.build([5, 3], "cpu")
    with_ends = losses.ce(logits, ids, torch.ones(1, 8, dtype=torch.bool), ends=seg.ends)
    without = losses.ce(logits, ids, torch.ones(1, 8, dtype=torch.bool))
    per_sample = (losses.ce(logits[:, :5], ids[:, :5], torch.ones(1, 5, dtype=torch.bool)) * 4
                  + losses.ce(logits[:, 5:], ids[:, 5:], torch.ones(1, 3, dtype=torch.bool)) * 2) / 6  # fmt: skip
    torch.testing.assert_close(with_ends, per_sample)
    assert not torch.allclose(without, with_ends)
    assert seg.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    assert seg.cu_seqlens.tolist() == [0, 5, 8] and seg.ends.nonzero()[:, 1].tolist() == [4, 7]


def test_samples_holding_some_positions_and_fp8_samples_pack_like_they_pad():
    """teacher.capture: loss_mask samples (`positions`) and fp8 samples: the packed layout holds the
    same teacher rows at the same tokens, and trains to the same loss as the padded one."""
    part = [sample("a", 6, 1, positions=[3, 4, 5]), sample("b", 4, 2, positions=[1, 2])]
    cfg = {"losses": {"nmse": 1.0, "kl": 1.0}}
    lp, _, _, bp = step("padded", part, cfg)
    lk, _, _, bk = step("packed", part, cfg)
    torch.testing.assert_close(lk, lp, rtol=1e-5, atol=1e-6)
    assert bk.held.view(-1).tolist() == bp.held[0, :6].tolist() + bp.held[1, :4].tolist()
    quant = [quantized(sample(k, n, i)) for i, (k, n) in enumerate([("c", 5), ("d", 2)])]
    lp, _, _, bp = step("padded", quant, cfg)
    lk, _, _, bk = step("packed", quant, cfg)
    assert bk.scale is not None and bk.teacher.dtype == fp8.FP8
    torch.testing.assert_close(lk, lp, rtol=1e-5, atol=1e-6)


def test_select_of_a_packed_batch_equals_collating_the_kept_samples():
    ss = [sample("a", 5, 1, [1] * 5), sample("b", 3, 2, [0, 1, 1]), sample("c", 7, 3), sample("d", 2, 4)]
    full = collate(ss, [2, 4], pack=True)
    for keep in ([0], [1, 3], [0, 2, 3], [3, 2]):
        got, want = select(full, keep), collate([ss[i] for i in keep], [2, 4], pack=True)
        assert got.segments == want.segments and got.lengths == want.lengths == [sum(want.segments)]
        for f in ("input_ids", "mask", "teacher", "loss_mask"):
            assert torch.equal(getattr(got, f), getattr(want, f)), (keep, f)
    quant = [quantized(s) for s in ss]
    got, want = select(collate(quant, [4], pack=True), [2, 0]), collate([quant[2], quant[0]], [4], pack=True)
    assert torch.equal(got.teacher.view(torch.uint8), want.teacher.view(torch.uint8))
    assert torch.equal(got.scale, want.scale) and got.segments == [7, 5]


def test_the_packed_budget_counts_tokens_in_arrival_order():
    class S:
        def __init__(self, key, n):
            self.key, self.num_tokens = key, n

    b = TokenBudgetBatcher(max_tokens=10, window=8, packed=True)
    assert b.window == 0  # no holding back by length: nothing to pad
    out = []
    for k, n in [("a", 4), ("b", 5), ("c", 2), ("d", 12), ("e", 1), ("f", 9)]:
        ready = b.push(S(k, n))
        if ready:
            out.append([s.key for s in ready])
    assert out == [["a", "b"], ["c"], ["d"]]  # 9 tokens; 2 (+12 > 10); 12 alone
    assert [s.key for s in b.pending] == ["e", "f"] and b.full  # 10 of 10 tokens held
    sizes = [("a", 6), ("b", 1), ("c", 1), ("d", 1)]
    packed, padded = TokenBudgetBatcher(max_tokens=10, packed=True), TokenBudgetBatcher(max_tokens=10)
    assert [packed.push(S(k, n)) for k, n in sizes] == [None] * 4  # 9 tokens, one batch
    assert [padded.push(S(k, n)) is not None for k, n in sizes] == [False, True, False, False]
    assert [s.key for s in packed.flush()] == ["a", "b", "c", "d"]
    assert [s.key for s in padded.flush()] == ["b", "c", "d"]  # 2 x 6 > 10: a went alone


def test_eagle3_trains_padded_rows_and_refuses_packed_in_one_line():
    base = {"recipe": "eagle3", "teacher_model": "/nonexistent"}
    assert StudentConfig.model_validate(base).batch_layout == "padded"
    assert StudentConfig.model_validate(STUDENT).batch_layout == "packed"
    with pytest.raises(ValueError, match="recipe eagle3 trains padded rows"):
        StudentConfig.model_validate({**base, "batch_layout": "packed"})


def test_a_packed_step_never_reads_a_device_value_on_the_host():
    """As the padded layout (tests/student/test_student_units.py): positions, offsets and ends are
    built from host lengths, so a packed step makes the host wait for no device value."""
    from host_reads import HostReads

    cfg = StudentConfig.model_validate({**STUDENT, "losses": {"nmse": 1.0, "ce": 1.0}, "loss_on": "masked"})
    model = DistillModel(load_student(cfg), [(1, 2), (2, 4)], 8, "auto")
    batch = collate([sample("a", 5, 1, MASKS[0]), sample("b", 3, 2, MASKS[1])], [2, 4], pack=True).to("cpu")
    with HostReads() as reads:
        loss, _ = Distill().loss(model, None, batch, cfg, 4)
        loss.backward()
    assert reads.n == 0 and torch.isfinite(loss)


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="variable-length FlashAttention needs a CUDA device"
)
def test_varlen_attention_on_a_gpu_matches_attention_per_sample():
    """On a GPU in bf16 the packed row takes torch's varlen kernel: same outputs and gradients (bf16
    tolerance) as one causal SDPA per sample."""
    from student import packing

    if packing._VARLEN is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    torch.manual_seed(0)
    lens = [37, 5, 120, 1, 64]
    n = sum(lens)
    seg = Segments.build(lens, "cuda")
    q = torch.randn(1, 8, n, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 2, n, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 2, n, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    mod = nn.Module()
    out, _ = packing.packed_attention(mod, q, k, v, None, scaling=0.125, distill_packed=seg)
    saved, packing._VARLEN = packing._VARLEN, None  # the per-sample path
    try:
        ref, _ = packing.packed_attention(mod, q, k, v, None, scaling=0.125, distill_packed=seg)
    finally:
        packing._VARLEN = saved
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    g1 = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    g2 = torch.autograd.grad(ref.float().square().sum(), (q, k, v))
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="an upload stream needs a CUDA device")
def test_upload_stream_gives_the_same_batch_while_the_current_stream_is_busy():
    """`Batch.to(stream=...)` (the loop's upload stream): packed, padded and fp8 batches arrive
    equal to a plain upload, whichever stream is still busy: with the upload stream busy, a
    current stream that did not wait for it would read the batch before its copies ran."""
    dev = torch.device("cuda")
    up = torch.cuda.Stream(dev)
    half = [i % 2 for i in range(50)]
    hosts = {
        "packed": collate([sample("a", 50, 1, half), sample("b", 9, 2)], [2, 4], True, pack=True),
        "padded": collate([sample("a", 50, 1), sample("b", 9, 2)], [2, 4], True),
        "fp8": collate(
            [quantized(sample("q", 40, 3)), quantized(sample("r", 7, 4))], [2, 4], True, pack=True
        ),
    }
    busy = torch.randn(4096, 4096, device=dev)
    for (name, host), busy_stream in zip(
        [*hosts.items(), *hosts.items()], [up] * 3 + [torch.cuda.current_stream(dev)] * 3, strict=True
    ):
        ref = host.to(dev)
        torch.cuda.synchronize()
        with torch.cuda.stream(busy_stream):  # queued ahead of the upload's copies, or of the reads
            for _ in range(20):
                busy = busy @ busy / 4096
        got = host.to(dev, stream=up)
        assert torch.cuda.current_stream(dev) != up
        for a, b in zip(got.device_tensors(), ref.device_tensors(), strict=True):
            assert a.device.type == "cuda"
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
        if got.packing is not None:
            assert got.packing.lengths == ref.packing.lengths

"""student/losses.py against naive per-token references: values, masks, gradients."""

import math

import pytest
import torch

from student import losses

B, T, H, V = 3, 7, 16, 11


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    t = torch.randn(B, T, H, generator=g, dtype=torch.float64) * 3 + 1
    lengths = [7, 4, 1]  # right padding, one row fully real, one with a single token
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, :n] = True
    return s, t, mask


def _real(mask):
    return [(b, i) for b in range(mask.shape[0]) for i in range(mask.shape[1]) if mask[b, i]]


# --- naive references: python loops over real tokens ------------------------------------------


def ref_mse(s, t, mask):
    n = s.shape[-1]
    vals = [sum((float(s[b, i, h]) - float(t[b, i, h])) ** 2 for h in range(n)) / n for b, i in _real(mask)]
    return sum(vals) / len(vals)


def ref_cosine(s, t, mask):
    vals = []
    for b, i in _real(mask):
        sv, tv = [float(x) for x in s[b, i]], [float(x) for x in t[b, i]]
        dot = sum(x * y for x, y in zip(sv, tv, strict=True))
        ns = math.sqrt(sum(x * x for x in sv))
        nt = math.sqrt(sum(y * y for y in tv))
        vals.append(1 - dot / (ns * nt))
    return sum(vals) / len(vals)


def ref_nmse(s, t, mask, eps=1e-5):
    toks = _real(mask)
    total = 0.0
    for h in range(s.shape[-1]):
        col = [float(t[b, i, h]) for b, i in toks]
        mean = sum(col) / len(col)
        var = sum((x - mean) ** 2 for x in col) / len(col)
        sd = math.sqrt(var + eps)
        total += sum(
            ((float(s[b, i, h]) - mean) / sd - (float(t[b, i, h]) - mean) / sd) ** 2 for b, i in toks
        )
    return total / (len(toks) * s.shape[-1])


def ref_kl(sl, tl, mask, temp):
    vals = []
    for b, i in _real(mask):
        zt = [float(x) / temp for x in tl[b, i]]
        zs = [float(x) / temp for x in sl[b, i]]
        lt = math.log(sum(math.exp(z) for z in zt))
        ls = math.log(sum(math.exp(z) for z in zs))
        vals.append(sum(math.exp(a - lt) * ((a - lt) - (c - ls)) for a, c in zip(zt, zs, strict=True)))
    return sum(vals) / len(vals) * temp**2


def ref_ce(logits, ids, mask):
    vals = []
    for b in range(logits.shape[0]):
        for i in range(logits.shape[1] - 1):
            if mask[b, i] and mask[b, i + 1]:
                z = [float(x) for x in logits[b, i]]
                lse = math.log(sum(math.exp(x) for x in z))
                vals.append(lse - z[int(ids[b, i + 1])])
    return sum(vals) / len(vals)


# --- values -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fn,ref",
    [(losses.mse, ref_mse), (losses.cosine, ref_cosine), (losses.nmse, ref_nmse)],
    ids=["mse", "cos", "nmse"],
)
def test_hidden_losses_match_reference(fn, ref):
    s, t, mask = _inputs()
    assert float(fn(s, t, mask)) == pytest.approx(ref(s, t, mask), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("temp", [1.0, 2.0, 0.5])
def test_kl_matches_reference(temp):
    g = torch.Generator().manual_seed(1)
    sl = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    tl = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    _, _, mask = _inputs()
    assert float(losses.kl(sl, tl, mask, temp)) == pytest.approx(ref_kl(sl, tl, mask, temp), rel=1e-6)


def test_ce_matches_reference_and_torch():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (B, T), generator=g)
    _, _, mask = _inputs()
    got = float(losses.ce(logits, ids, mask))
    assert got == pytest.approx(ref_ce(logits, ids, mask), rel=1e-6)
    # torch's own cross-entropy with ignore_index on the shifted labels gives the same number.
    labels = ids[:, 1:].masked_fill(~(mask[:, 1:] & mask[:, :-1]), -100)
    torch_ce = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, V), labels.reshape(-1), ignore_index=-100
    )
    assert got == pytest.approx(float(torch_ce), rel=1e-6)


def test_known_values():
    s, _, mask = _inputs()
    assert float(losses.mse(s, s, mask)) == 0.0
    assert float(losses.cosine(s, 2.5 * s, mask)) == pytest.approx(0.0, abs=1e-12)
    assert float(losses.cosine(s, -s, mask)) == pytest.approx(2.0)
    logits = torch.randn(B, T, V, dtype=torch.float64)
    assert float(losses.kl(logits, logits, mask)) == pytest.approx(0.0, abs=1e-12)
    # Uniform student vs one-hot-ish teacher: KL = log V - H(teacher) > 0.
    assert float(losses.kl(torch.zeros(B, T, V), logits.float() * 10, mask)) > 0.5


# --- masks ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [losses.mse, losses.cosine, losses.nmse])
def test_padding_does_not_change_hidden_losses(fn):
    s, t, mask = _inputs()
    s2, t2 = s.clone(), t.clone()
    s2[~mask] = 1e6  # garbage in padding
    t2[~mask] = -1e6
    assert float(fn(s2, t2, mask)) == pytest.approx(float(fn(s, t, mask)), rel=1e-12)


def test_padding_does_not_change_kl_and_ce():
    g = torch.Generator().manual_seed(3)
    sl, tl = torch.randn(2, B, T, V, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    _, _, mask = _inputs()
    sl2, tl2, ids2 = sl.clone(), tl.clone(), ids.clone()
    sl2[~mask] = 50.0
    tl2[~mask] = -50.0
    ids2[~mask] = 0
    assert float(losses.kl(sl2, tl2, mask, 2.0)) == pytest.approx(
        float(losses.kl(sl, tl, mask, 2.0)), rel=1e-6
    )
    assert float(losses.ce(sl2, ids2, mask)) == pytest.approx(float(losses.ce(sl, ids, mask)), rel=1e-6)


def test_all_padding_is_zero_with_zero_gradient():
    # A rank without data runs a one-token padding batch: the loss must be 0, not NaN.
    s = torch.randn(1, 1, H, requires_grad=True)
    t = torch.zeros(1, 1, H)
    logits = torch.randn(1, 1, V, requires_grad=True)
    mask = torch.zeros(1, 1, dtype=torch.bool)
    total = (
        losses.mse(s, t, mask)
        + losses.cosine(s, t, mask)
        + losses.nmse(s, t, mask)
        + losses.kl(logits, torch.zeros(1, 1, V), mask)
        + losses.ce(logits, torch.zeros(1, 1, dtype=torch.long), mask)
    )
    total.backward()
    assert total.item() == 0.0
    assert torch.all(s.grad == 0) and torch.all(logits.grad == 0)


# --- gradients --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mse", "cosine", "nmse"])
def test_hidden_gradients_match_autograd_of_naive_torch_reference(name):
    s, t, mask = _inputs(4)
    s.requires_grad_(True)
    getattr(losses, name)(s, t, mask).backward()
    got = s.grad.clone()
    # Reference: the same math written token by token with torch ops, differentiated by autograd.
    s2 = s.detach().clone().requires_grad_(True)
    toks = _real(mask)
    real_t = torch.stack([t[b, i] for b, i in toks])
    mean, var = real_t.mean(0), real_t.var(0, unbiased=False)
    terms = []
    for b, i in toks:
        if name == "mse":
            terms.append(((s2[b, i] - t[b, i]) ** 2).mean())
        elif name == "cosine":
            terms.append(1 - (s2[b, i] @ t[b, i]) / (s2[b, i].norm() * t[b, i].norm()))
        else:
            sd = (var + 1e-5).sqrt()
            terms.append((((s2[b, i] - mean) / sd - (t[b, i] - mean) / sd) ** 2).mean())
    torch.stack(terms).mean().backward()
    torch.testing.assert_close(got, s2.grad, rtol=1e-7, atol=1e-10)
    assert torch.all(got[~mask] == 0)  # padding gets no gradient
    assert got[mask].abs().sum() > 0


def test_kl_and_ce_gradients_finite_differences():
    g = torch.Generator().manual_seed(5)
    _, _, mask = _inputs()
    sl = torch.randn(B, T, V, generator=g, dtype=torch.float64, requires_grad=True)
    tl = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (B, T), generator=g)
    assert torch.autograd.gradcheck(lambda x: losses.kl(x, tl, mask, 1.7), (sl,))
    assert torch.autograd.gradcheck(lambda x: losses.ce(x, ids, mask), (sl,))
    losses.kl(sl, tl, mask, 1.7).backward()
    assert torch.all(sl.grad[~mask] == 0)
    # KL gradient wrt student logits is (p_s - p_t) * T / n_tokens (the T**2 factor over the 1/T).
    n = int(mask.sum())
    expected = (torch.softmax(sl.detach() / 1.7, -1) - torch.softmax(tl / 1.7, -1)) * 1.7 / n
    expected[~mask] = 0
    torch.testing.assert_close(sl.grad, expected)


# --- loss_mask (student.loss_on: masked) --------------------------------------------------------


def _loss_mask(mask, seed=1):
    g = torch.Generator().manual_seed(seed)
    lm = (torch.rand(mask.shape, generator=g) < 0.5).to(torch.uint8)  # as the teacher sends it
    lm[0, 2] = 1  # row 0 keeps some trained tokens whatever the draw
    return lm


@pytest.mark.parametrize(
    "fn,ref",
    [(losses.mse, ref_mse), (losses.cosine, ref_cosine), (losses.nmse, ref_nmse)],
    ids=["mse", "cos", "nmse"],
)
def test_loss_mask_narrows_hidden_losses_to_trained_tokens(fn, ref):
    s, t, mask = _inputs()
    lm = _loss_mask(mask)
    got = float(fn(s, t, mask, loss_mask=lm))
    assert got == pytest.approx(ref(s, t, mask & lm.bool()), rel=1e-9)
    assert got != pytest.approx(float(fn(s, t, mask)), rel=1e-3)  # the mask changes the loss
    # all ones: the same as no loss mask
    assert float(fn(s, t, mask, loss_mask=torch.ones_like(lm))) == pytest.approx(float(fn(s, t, mask)))
    # the student's states on untrained tokens do not matter at all
    s2 = s.clone()
    s2[~lm.bool()] += 100.0
    assert float(fn(s2, t, mask, loss_mask=lm)) == pytest.approx(got, rel=1e-12)


def test_loss_mask_ce_counts_predictions_of_trained_tokens():
    g = torch.Generator().manual_seed(3)
    _, _, mask = _inputs()
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (B, T), generator=g)
    lm = _loss_mask(mask)
    vals = []
    for b in range(B):
        for i in range(T - 1):
            if mask[b, i] and mask[b, i + 1] and lm[b, i + 1]:
                z = [float(x) for x in logits[b, i]]
                vals.append(math.log(sum(math.exp(x) for x in z)) - z[int(ids[b, i + 1])])
    assert float(losses.ce(logits, ids, mask, loss_mask=lm)) == pytest.approx(sum(vals) / len(vals), rel=1e-9)
    assert float(losses.ce(logits, ids, mask, loss_mask=torch.ones_like(lm))) == pytest.approx(
        float(losses.ce(logits, ids, mask))
    )


def test_loss_mask_kl_counts_positions_that_predict_trained_tokens():
    g = torch.Generator().manual_seed(4)
    _, _, mask = _inputs()
    sl = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    tl = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    lm = _loss_mask(mask)
    # Position i counts when token i + 1 is real and trained; a row's last real position when
    # its own token is trained.
    want = torch.zeros_like(mask)
    for b in range(B):
        n = int(mask[b].sum())
        for i in range(n):
            want[b, i] = bool(lm[b, i + 1]) if i + 1 < n else bool(lm[b, i])
    assert torch.equal(losses.target_mask(mask, lm), want)
    got = float(losses.kl(sl, tl, mask, 2.0, loss_mask=lm))
    assert got == pytest.approx(ref_kl(sl, tl, want, 2.0), rel=1e-9)
    assert got != pytest.approx(float(losses.kl(sl, tl, mask, 2.0)), rel=1e-3)
    # Nothing trained: exactly 0, no NaN.
    assert float(losses.kl(sl, tl, mask, 1.0, loss_mask=torch.zeros_like(lm))) == 0.0

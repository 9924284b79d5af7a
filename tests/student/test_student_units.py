"""Student pieces in process (batching, layer selection, config, model) and its clear errors as a user
sees them: one readable line, no traceback, the documented exit code (in-process through
student.train.run where no process group is needed; real `student.py` / `accelerate launch`
processes for the exit code itself and for errors that must stop every rank)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import faults
import msgpack
import pytest
import torch
import yaml
import zmq

from distill.errors import ConfigError
from distill.protocol import Sample
from distill.spool import write_sample
from student.config import load_student_config
from student.data import (
    StudentError,
    TokenBudgetBatcher,
    agree,
    check_sample,
    collate,
    idle_wait_s,
    key_hash,
    layer_index,
    next_micro_batch,
    select,
)
from student.ledger import Ledger

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
ACCELERATE = str(Path(PY).with_name("accelerate"))


def sample(key: str, n: int, layers=(2, 4), hidden=8, seed=0) -> Sample:
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(n, len(layers), hidden, generator=g).to(torch.bfloat16)
    return Sample(
        key=key, tensors={"hidden_states": hs, "token_ids": torch.arange(n) + 1}, layers=list(layers)
    )


# --- batching ---------------------------------------------------------------------------------------


def test_token_budget_batcher_respects_budget_and_order():
    b = TokenBudgetBatcher(max_tokens=20)
    out = []
    for i, n in enumerate([5, 5, 5, 5, 3, 12, 30, 2]):
        ready = b.push(sample(f"k{i}", n))
        if ready:
            out.append(ready)
    out.append(b.flush())
    keys = [[s.key for s in batch] for batch in out]
    assert keys == [["k0", "k1", "k2", "k3"], ["k4"], ["k5"], ["k6"], ["k7"]]  # 2 x 12 > 20
    for batch in out:  # padded size within budget, except a sample longer than the budget alone
        padded = len(batch) * max(s.num_tokens for s in batch)
        assert padded <= 20 or len(batch) == 1
    assert b.flush() == []


def test_batcher_max_samples_and_full():
    b = TokenBudgetBatcher(max_tokens=1000, max_samples=2)
    assert b.push(sample("a", 3)) is None and not b.full
    assert b.push(sample("b", 3)) is None and b.full
    assert [s.key for s in b.push(sample("c", 3))] == ["a", "b"]


def test_length_window_groups_by_length_oldest_first_each_sample_once():
    """With a length window the batcher holds W samples and takes a batch by length: the oldest held
    sample and those closest to it in length that fit the budget. Every sample leaves once, every
    batch is within the budget (or a too-long sample alone), and none waits more than W takes."""
    import random

    rng = random.Random(3)
    lens = [rng.randint(10, 200) for _ in range(500)] + [900]  # 900: longer than the budget
    budget, w = 800, 24
    b = TokenBudgetBatcher(max_tokens=budget, window=w)
    arrived, out = {}, []
    for i, n in enumerate(lens):
        arrived[f"k{i}"] = len(out)
        ready = b.push(sample(f"k{i}", n, hidden=1))
        assert (ready is not None) == (len(b.pending) + len(ready or []) >= w)
        if ready:
            assert ready[0].key == min((s.key for s in ready + b.pending), key=lambda k: int(k[1:]))
            out.append(ready)
    assert not b.full and 0 < len(b.pending) < w
    while b.pending:
        out.append(b.flush())
    assert b.flush() == []
    keys = [s.key for batch in out for s in batch]
    assert sorted(keys) == sorted(arrived) and len(keys) == len(set(keys))  # each sample once
    for j, batch in enumerate(out):
        assert len(batch) * max(s.num_tokens for s in batch) <= budget or len(batch) == 1
        assert all(j - arrived[s.key] <= w for s in batch)  # no sample waits for ever
    padding = {}
    for name, window in (("arrival", 0), ("window", w)):
        bb, batches = TokenBudgetBatcher(max_tokens=budget, window=window), []
        for i, n in enumerate(lens):
            batches.append(bb.push(sample(f"k{i}", n, hidden=1)) or [])
        while bb.pending:
            batches.append(bb.flush())
        padded = sum(len(x) * max(s.num_tokens for s in x) for x in batches if x)
        padding[name] = 1 - sum(lens) / padded
    assert padding["window"] < 0.6 * padding["arrival"], padding  # measured: 0.13 vs 0.35


def test_length_window_respects_max_samples_and_micro_batch_flushes_every_held_sample():
    b = TokenBudgetBatcher(max_tokens=1000, max_samples=2, window=4)
    for i, n in enumerate([5, 50, 6, 51]):
        ready = b.push(sample(f"k{i}", n))
    assert [s.key for s in ready] == ["k0", "k2"] and [s.key for s in b.pending] == ["k1", "k3"]
    # next_micro_batch: held samples come out once the source has ended, one batch per call
    src = _ListSource([sample(f"m{i}", 4 + 40 * (i % 2)) for i in range(5)])
    b = TokenBudgetBatcher(max_tokens=90, window=8)
    got = [next_micro_batch(src, b, 0.5) for _ in range(5)]
    assert [[s.key for s in x] for x in got] == [["m0", "m2", "m4"], ["m1", "m3"], [], [], []]
    assert src.exhausted and not b.pending


def test_collate_pads_masks_selects_layers_and_copies():
    s1, s2 = sample("a", 5, layers=(0, 2, 4)), sample("b", 3, layers=(4, 2), seed=1)
    host = collate([s1, s2], [2, 4])
    # On the host: packed real tokens in the teacher's dtype (no fp32 upcast, no padding rows).
    assert host.teacher.shape == (8, 2, 8) and host.teacher.dtype == torch.bfloat16
    assert host.lengths == [5, 3] and int(host.mask.sum()) == 8 and host.padded
    batch = host.to("cpu")  # padded where it goes (the GPU, in training)
    assert batch.input_ids.shape == (2, 5) and batch.teacher.shape == (2, 5, 2, 8)
    assert batch.mask.tolist() == [[True] * 5, [True] * 3 + [False] * 2]
    assert batch.teacher.dtype == torch.bfloat16 and batch.lengths is None
    # Layer ids are looked up by id, not position: s2 sends [4, 2].
    torch.testing.assert_close(batch.teacher[0, :, 0], s1.tensors["hidden_states"][:, 1])
    torch.testing.assert_close(batch.teacher[1, :3, 0], s2.tensors["hidden_states"][:, 1])
    torch.testing.assert_close(batch.teacher[1, :3, 1], s2.tensors["hidden_states"][:, 0])
    assert torch.all(batch.teacher[1, 3:] == 0) and torch.all(batch.input_ids[1, 3:] == 0)
    # Copies: the batch survives the sample's buffers (zero-copy views die at ack).
    s1.tensors["hidden_states"].zero_()
    assert host.teacher[:5].abs().sum() > 0 and batch.teacher[0].abs().sum() > 0


def test_collate_in_threads_in_a_child_forked_after_the_parent_collated_with_them():
    """A forked child inherits none of the pool's threads: its collate must use a pool of its own
    (an inherited one takes the copies and never runs them). In a fresh interpreter with one OpenMP
    thread, as under `accelerate launch` (libgomp itself does not survive a fork after use)."""
    from forked import in_a_forked_child

    setup = """
    import threading, torch
    from distill.protocol import Sample
    from student import data as D
    S = [Sample(f"k{i}", {"hidden_states": torch.randn(1024, 2, 1024), "token_ids": torch.arange(1024)},
                [2, 4], {}) for i in range(4)]  # 32 MiB of rows: over PARALLEL_COLLATE_BYTES
    met = threading.Barrier(5)  # the parent's pool gets all its 4 threads (at once: none idle to reuse)
    for _ in range(4):
        D._pool(4).submit(met.wait, 30)
    met.wait(30)
    """
    out = in_a_forked_child(
        setup, "D.collate(S, [2, 4], threads=4).teacher.sum().item()", {"OMP_NUM_THREADS": "1"}
    )
    assert out["got"] == out["want"], f"the forked child's collate: {out['got']}"


def test_collate_in_threads_gives_bitwise_the_batch_of_one_thread(monkeypatch):
    """student.collate_threads: each sample's rows copied by a pool thread land exactly where the
    loop's own thread puts them: whole samples in either layer order, a sample holding some
    positions only, and an fp8 batch's rows and scales."""
    import student.data as data
    from distill import fp8
    from distill.capture import held_positions

    monkeypatch.setattr(data, "PARALLEL_COLLATE_BYTES", 0)  # the pool even for these small batches
    lm = torch.tensor([0, 1, 1, 0, 1, 0, 0], dtype=torch.uint8)
    pos = held_positions(lm)
    part = sample("p", 7, layers=(2, 4), seed=3)
    part.tensors = {
        "hidden_states": part.tensors["hidden_states"][pos.long()].contiguous(),
        "loss_mask": lm,
        "positions": pos,
        "token_ids": part.tensors["token_ids"],
    }
    ss = [sample(f"s{i}", 3 + 4 * i, layers=(2, 4) if i % 2 else (4, 2), seed=i) for i in range(6)] + [part]
    calls = []
    real = data._pool
    monkeypatch.setattr(data, "_pool", lambda n: calls.append(n) or real(n))
    one, three = collate(ss, [2, 4], threads=1), collate(ss, [2, 4], threads=3)
    assert calls == [3]  # one batch went through the pool, the other stayed on this thread
    for name in ("input_ids", "mask", "teacher", "loss_mask", "held"):
        assert torch.equal(getattr(one, name), getattr(three, name)), name
    assert three.lengths == one.lengths
    q = []
    for s in ss[:4]:
        v, sc = fp8.quantize(s.tensors["hidden_states"].float())
        q.append(
            Sample(key=s.key, tensors={**s.tensors, "hidden_states": v, fp8.SCALE_KEY: sc}, layers=s.layers)
        )
        q[-1].meta = {"hidden_dtype": "bfloat16"}
    q1, q3 = collate(q, [2, 4]), collate(q, [2, 4], threads=3)
    assert torch.equal(q1.teacher.view(torch.uint8), q3.teacher.view(torch.uint8))
    assert torch.equal(q1.scale, q3.scale) and torch.equal(q1.to("cpu").teacher, q3.to("cpu").teacher)


def test_collate_rounds_the_length_and_keeps_every_layer_order():
    s1, s2 = sample("a", 5, layers=(2, 4)), sample("b", 7, layers=(2, 4), seed=1)
    batch = collate([s1, s2], [2, 4], pad_to_multiple_of=4).to("cpu")
    assert batch.input_ids.shape == (2, 8) and batch.mask.sum(1).tolist() == [5, 7]
    torch.testing.assert_close(batch.teacher[1, :7], s2.tensors["hidden_states"])  # all layers, in order
    torch.testing.assert_close(batch.teacher[0, :5, 1], s1.tensors["hidden_states"][:, 1])  # one layer
    only = collate([s1], [4]).to("cpu")
    torch.testing.assert_close(only.teacher[0, :, 0], s1.tensors["hidden_states"][:, 1])
    full = collate([s1, sample("c", 5, seed=2)], [2, 4])
    assert not full.padded and full.to("cpu").teacher.shape == (2, 5, 2, 8)


def test_empty_batch_is_one_padding_token_carrying_every_layer():
    """What a rank without data trains on (weight 0) so that DDP's all-reduce still matches up."""
    from student.data import empty_batch

    for layer_ids in ([2], [2, 4]):
        b = empty_batch(layer_ids, 8).to("cpu")
        assert b.teacher.shape == (1, 1, len(layer_ids), 8) and b.input_ids.shape == (1, 1)
        assert not b.mask.any() and b.layer_ids == layer_ids


def test_device_scatter_positions_pad_like_the_row_copy():
    """Batch.to pads a packed batch on a GPU with one index_copy_ at `_positions`: the same result
    as the row-by-row copy used on a CPU."""
    from student.data import _positions

    host = collate(
        [sample("a", 3, seed=1), sample("b", 6, seed=2), sample("c", 1, seed=3)], [2, 4], pad_to_multiple_of=4
    )
    b, t = host.mask.shape
    assert _positions(host.lengths, t).tolist() == [0, 1, 2, 8, 9, 10, 11, 12, 13, 16]
    out = torch.zeros((b * t, *host.teacher.shape[1:]), dtype=host.teacher.dtype)
    out.index_copy_(0, _positions(host.lengths, t), host.teacher)
    torch.testing.assert_close(out.view(b, t, *host.teacher.shape[1:]), host.to("cpu").teacher)


def test_compute_loss_is_the_same_for_bf16_and_fp32_teacher_batches():
    """The loss upcasts the teacher states itself: a bf16 batch gives the fp32 batch's loss."""
    from student.model import DistillModel, load_student
    from student.recipes.distill import Distill

    compute_loss = Distill().loss

    cfg = load_student_config_dict({**TINY_STUDENT, "losses": {"mse": 1.0, "cosine": 1.0, "nmse": 1.0}})
    model = DistillModel(load_student(cfg), [(1, 2)], 8, "auto")
    ss = [sample("a", 5, seed=1), sample("b", 3, seed=2)]
    bf = collate(ss, [2])
    f32 = bf.to("cpu")
    f32.teacher = f32.teacher.float()
    a, ta = compute_loss(model, None, bf, cfg, None)
    b, tb = compute_loss(model, None, f32, cfg, None)
    torch.testing.assert_close(a, b)
    assert ta.keys() == tb.keys() == {"mse", "cosine", "nmse"}


def test_missing_layer_and_hidden_size_errors_are_clear():
    s = sample("a", 4, layers=(2, 4))
    with pytest.raises(StudentError, match=r"sends layers \[2, 4\].*needs teacher layer\(s\) \[3\]"):
        layer_index(s, [2, 3])
    with pytest.raises(StudentError, match="teacher hidden size 8, the config says 16"):
        check_sample(s, [2, 4], 16)
    check_sample(s, [4], 8)


class _ListSource:
    def __init__(self, samples):
        self.samples = list(samples)
        self.draining = True
        self.exhausted = False

    def get(self, timeout=0.0):
        if not self.samples:
            self.exhausted = True
            return None
        return self.samples.pop(0)


def test_next_micro_batch_flushes_at_end():
    src = _ListSource([sample(f"k{i}", 4) for i in range(5)])
    b = TokenBudgetBatcher(max_tokens=8)
    got = [next_micro_batch(src, b, 0.5) for _ in range(4)]
    assert [[s.key for s in x] for x in got] == [["k0", "k1"], ["k2", "k3"], ["k4"], []]
    assert src.exhausted


class _Backlog:
    """A stream source with `ready` samples already received and more only after `delay` seconds."""

    def __init__(self, ready, later=(), delay=30.0):
        self.ready, self.later, self.delay = list(ready), list(later), delay
        self.draining = self.exhausted = False
        self.t0 = time.monotonic()
        self.waited = 0.0

    def get(self, timeout=0.0):
        if self.ready:
            return self.ready.pop(0)
        if self.later and time.monotonic() - self.t0 >= self.delay:
            return self.later.pop(0)
        time.sleep(timeout)
        self.waited += timeout
        return None


def test_idle_wait_rule_no_crawling_tail():
    # A rank may wait only when no rank had a backlog (a full batch) in the previous iteration.
    assert idle_wait_s(0.5, anyone_backlogged=False) == 0.5
    assert idle_wait_s(0.5, anyone_backlogged=True) == 0.0
    # Not waiting: it returns at once with what has arrived (a partial batch, or nothing).
    b = TokenBudgetBatcher(max_tokens=16)
    src = _Backlog([sample("a", 4)], [sample("late", 4)])
    t0 = time.monotonic()
    assert [s.key for s in next_micro_batch(src, b, 0.0)] == ["a"] and not b.filled
    assert next_micro_batch(src, b, 0.0) == [] and not b.filled
    assert time.monotonic() - t0 < 0.1 and src.waited == 0.0
    # ... but never more than a full batch: the rest stays for the next micro-step. A full batch
    # is a backlog (`filled`): the other ranks will not wait next time.
    src = _Backlog([sample(f"k{i}", 4) for i in range(6)])
    assert [s.key for s in next_micro_batch(src, b, 0.0)] == ["k0", "k1", "k2", "k3"] and b.filled
    assert [s.key for s in next_micro_batch(src, b, 0.0)] == ["k4", "k5"] and not b.filled
    # Waiting: up to idle_flush_s for a sample, then an empty batch.
    t0 = time.monotonic()
    assert next_micro_batch(_Backlog([], [sample("late", 4)]), b, 0.3) == []
    assert 0.25 < time.monotonic() - t0 < 1.0


@pytest.mark.parametrize("held", [5, lambda: 5], ids=["count", "asked"])
def test_micro_batch_stops_waiting_when_credit_is_used_up(held):
    """A rank holding as many unacked samples as its credit allows gets no more: waiting for a
    fuller batch would only stall every step by idle_flush_s (e.g. with gradient accumulation).
    `held` as a number, or asked at every check (a fill running ahead of the loop's acks)."""
    b = TokenBudgetBatcher(max_tokens=1000)
    src = _Backlog([sample(f"k{i}", 4) for i in range(3)], [sample("late", 4)])
    t0 = time.monotonic()
    got = next_micro_batch(src, b, 5.0, held=held, credit=8)
    assert [s.key for s in got] == ["k0", "k1", "k2"] and b.filled
    assert time.monotonic() - t0 < 1.0
    assert b.capped == 1  # counted: the trainer hints at a larger credit window after 20 of these


def test_micro_batch_returns_what_it_has_once_told_to_stop():
    """A fill running ahead of the loop is told to stop when the loop ends (the source closes
    next): it returns the samples it holds at its next check instead of waiting idle_flush_s."""
    b = TokenBudgetBatcher(max_tokens=1000)
    src = _Backlog([sample("k0", 4)], [sample("late", 4)])
    t0 = time.monotonic()
    told = lambda: time.monotonic() - t0 > 0.3  # noqa: E731
    got = next_micro_batch(src, b, 30.0, stop=told)
    assert [s.key for s in got] == ["k0"] and not b.filled
    assert 0.3 <= time.monotonic() - t0 < 2.0


def test_unused_layers_hint_names_what_the_student_never_reads():
    from student.data import unused_layers_hint

    msg = unused_layers_hint([4, 8, 12, 16], [8, 16])
    assert "[4, 12]" in msg and "50%" in msg and "layer_ids" in msg
    assert unused_layers_hint([16, 8], [8, 16]) is None  # every sent layer is read, in any order


def test_copy_layers_equals_index_select_for_every_order_and_dtype():
    """collate's layer copy (one strided copy for evenly spaced positions, else one per layer) gives
    exactly what index_select gives, for every choice and order of layers, converting the dtype."""
    import itertools

    from student.data import copy_layers

    hs = torch.randn(7, 5, 16).bfloat16()
    for r in range(1, 6):
        for pos in itertools.permutations(range(5), r):
            for dt in (torch.bfloat16, torch.float32):
                dst = torch.empty(7, r, 16, dtype=dt)
                copy_layers(dst, hs, list(pos))
                assert torch.equal(dst, hs.index_select(1, torch.tensor(pos)).to(dt)), pos
    dst = torch.empty(7, 2, 16, dtype=torch.bfloat16)
    copy_layers(dst, hs, [2, 2])  # the same layer twice (two layer_map entries)
    assert torch.equal(dst[:, 0], hs[:, 2]) and torch.equal(dst[:, 1], hs[:, 2])


def test_agree_drops_trained_and_lower_rank_keys_the_same_on_every_rank():
    h = {k: key_hash(k) for k in "abcdefg"}
    trained, claimed = {h["a"]}, {h["b"]}  # a: an earlier step; b: earlier in this accumulation
    proposals = [[h["c"], h["a"], h["d"]], [h["d"], h["e"], h["b"], h["c"]], [h["f"], h["f"], h["e"]]]
    keep = agree(proposals, (trained, claimed))
    assert keep == [[True, False, True], [False, True, False, False], [True, False, False]]
    # Every rank computes it from the same gathered input: the same answer, and each key once.
    assert agree([list(p) for p in proposals], (set(trained), set(claimed))) == keep
    kept = [
        k for props, row in zip(proposals, keep, strict=True) for k, ok in zip(props, row, strict=True) if ok
    ]
    assert sorted(kept) == sorted({h["c"], h["d"], h["e"], h["f"]})
    assert agree([[], [h["g"]]]) == [[], [True]]


def test_agree_over_micro_steps_trains_each_key_once():
    """Two ranks receive overlapping keys (redeliveries) over several micro-steps: the union of what
    they train is every key once, and a key is never trained after it was trained anywhere."""
    import random

    rng = random.Random(0)
    keys = [f"k{i}" for i in range(60)]
    trained, claimed, seen = set(), set(), []
    for micro in range(40):
        proposals = [[key_hash(k) for k in rng.sample(keys, 3)] for _ in range(2)]
        keep = agree(proposals, (trained, claimed))
        for props, row in zip(proposals, keep, strict=True):
            for k, ok in zip(props, row, strict=True):
                if ok:
                    claimed.add(k)
                    seen.append(k)
        if micro % 3 == 2:  # an optimizer step
            trained |= claimed
            claimed.clear()
    assert len(seen) == len(set(seen)) and len(seen) > 30


def test_key_hash_is_stable_and_int64():
    assert key_hash("s0001") == key_hash("s0001") != key_hash("s0002")
    assert key_hash("s0001") == 8998327577190518501  # the same in every process and every run
    assert all(-(2**63) <= key_hash(f"k{i}") < 2**63 for i in range(100))
    torch.tensor([key_hash(f"k{i}") for i in range(100)], dtype=torch.int64)


def test_select_rows_equals_collate_of_the_subset():
    ss = [sample("a", 5, seed=1), sample("b", 9, seed=2), sample("c", 3, seed=3)]
    for pad_to in (1, 4):
        full = collate(ss, [2, 4], pad_to_multiple_of=pad_to)
        for keep in ([0, 2], [1], [2, 0]):
            want = collate([ss[i] for i in keep], [2, 4], pad_to_multiple_of=pad_to)
            got = select(full, keep)
            assert got.lengths == want.lengths
            for name in ("input_ids", "mask", "teacher"):
                torch.testing.assert_close(getattr(got, name), getattr(want, name))
                torch.testing.assert_close(getattr(got.to("cpu"), name), getattr(want.to("cpu"), name))


def test_find_unused_parameters_only_when_some_parameter_gets_no_gradient():
    from student.model import DistillModel, load_student
    from student.recipes.distill import Distill

    unused_parameters = Distill().unused_parameters

    def case(losses, projection="auto"):
        cfg = load_student_config_dict({**TINY_STUDENT, "losses": losses, "projection": projection})
        model = DistillModel(load_student(cfg), [(1, 2)], 8, projection)
        return unused_parameters(cfg, model)

    assert case({"nmse": 1.0})  # no logits: the LM head and the top layer get no gradient
    assert not case({"nmse": 1.0, "ce": 1.0})
    assert case({"nmse": 0.0, "ce": 1.0})  # projections without a hidden-state term


def test_ledger_roundtrip():
    led = Ledger()
    led.record(["a", "b"], 0, 1)
    assert led.keys() == {"a", "b"}
    led.merge([["a", 0, 1], ["b", 0, 1], ["c", 1, 1]])
    led.step = 1
    other = Ledger()
    other.load_state_dict(led.state_dict())
    assert other.keys() == {"a", "b", "c"} and other.step == 1


# --- config -----------------------------------------------------------------------------------------

BASE = {
    "from_config": {"model_type": "qwen3", "hidden_size": 32, "num_hidden_layers": 2},
    "teacher_hidden_size": 64,
    "layer_map": [{"student_layer": 1, "teacher_layer": 2}],
}


def _load(tmp_path, student, *sets):
    p = tmp_path / "run.yaml"
    p.write_text(yaml.safe_dump({"student": student}))
    return load_student_config(str(p), list(sets))


def test_config_loads_and_overrides(tmp_path):
    cfg, run = _load(tmp_path, BASE, "student.lr=0.5", "student.losses.kl=0")
    assert cfg.lr == 0.5 and cfg.losses.nmse == 1.0 and run.transport.connect


@pytest.mark.parametrize(
    "change,message",
    [
        ({"layr_map": []}, "unknown key 'student.layr_map'"),
        ({"losses": {"kl": 1.0}}, "needs 'teacher_model'"),
        ({"lr_schedule": "cosine"}, "needs max_steps"),
        ({"model": "x"}, "exactly one of 'model'"),
        ({"layer_map": []}, "'layer_map' is empty"),
        ({"losses": {"nmse": 0}}, "nothing to train"),
        ({"projection": "sometimes"}, "student.projection"),
    ],
)
def test_config_errors_name_the_key(tmp_path, change, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _load(tmp_path, {**BASE, **change})


# --- model ------------------------------------------------------------------------------------------


def test_student_prenorm_last_layer_and_projection():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from student.model import DistillModel

    torch.manual_seed(0)
    conf = Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, vocab_size=50)  # fmt: skip
    lm = Qwen3ForCausalLM(conf)
    m = DistillModel(lm, [(1, 3), (2, 5)], teacher_hidden=48, projection="auto")
    ids = torch.randint(0, 50, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.bool)
    logits, mapped = m(ids, mask)
    assert logits.shape == (2, 6, 50) and [h.shape for h in mapped] == [(2, 6, 48)] * 2
    # Id 2 = last layer BEFORE the final norm: norm(it) is transformers' hidden_states[2].
    out = lm(input_ids=ids, output_hidden_states=True)
    pre = torch.linalg.lstsq(
        m.projections["s2_t5"].weight, (mapped[1] - m.projections["s2_t5"].bias).reshape(-1, 48).T
    )
    prenorm = pre.solution.T.reshape(2, 6, 32)
    torch.testing.assert_close(lm.model.norm(prenorm), out.hidden_states[2], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(prenorm, out.hidden_states[2], atol=1e-2)
    with pytest.raises(StudentError, match="projection is 'never'"):
        DistillModel(lm, [(1, 3)], teacher_hidden=48, projection="never")
    assert len(DistillModel(lm, [(1, 3)], teacher_hidden=32, projection="auto").projections) == 0


def test_teacher_head_matches_teacher_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    from student.model import TeacherHead
    from testkit.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / "t", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                            vocab_size=300, intermediate_size=64)  # fmt: skip
    teacher = AutoModelForCausalLM.from_pretrained(path)
    head = TeacherHead.from_checkpoint(str(path))
    grab = {}
    teacher.model.norm.register_forward_pre_hook(lambda mod, a: grab.__setitem__("h", a[0]))
    ids = torch.randint(0, 300, (1, 9))
    with torch.no_grad():
        logits = teacher(input_ids=ids).logits
    torch.testing.assert_close(head(grab["h"]), logits, atol=1e-4, rtol=1e-4)
    assert not any(p.requires_grad for p in head.parameters())


# --- clear errors -------------------------------------------------------------------------------------
# Errors that need no process group are checked in-process through student.train.run (everything
# main() does except os._exit: the same config, model, source and loop, the same one line and exit
# code); a real `student.py` process shows the exit code itself (teacher gone: 3), and 2-rank
# `accelerate launch` runs show how a failure on one rank stops the other.

TINY_STUDENT = {
    "from_config": {"model_type": "qwen3", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 64},
    "teacher_hidden_size": 8,
    "layer_map": [{"student_layer": 1, "teacher_layer": 2}],
    "max_tokens_per_batch": 64,
}  # fmt: skip


def load_student_config_dict(student: dict):
    from student.config import StudentConfig

    return StudentConfig.model_validate(student)


def write_run(tmp_path, student: dict, transport: dict | None = None) -> Path:
    cfg = {"student": {"output_dir": str(tmp_path / "out"), **student}}
    if transport:
        cfg["transport"] = transport
    p = tmp_path / "run.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def run_student(tmp_path, student: dict, transport: dict | None = None, nproc: int = 1, timeout=120):
    p = write_run(tmp_path, student, transport)
    if nproc == 1:
        cmd = [PY, "student.py", "--config", str(p)]
    else:
        cmd = [ACCELERATE, "launch", "--multi_gpu", "--num_processes", str(nproc), "--main_process_port", "0"]
        cmd += ["student.py", "--config", str(p)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def run_in_process(tmp_path, capsys, student: dict, transport: dict | None = None):
    """student.train.run on a run file: (exit code, stderr) as `run_student` gives them."""
    from student.train import run

    p = write_run(tmp_path, student, transport)
    code = run(["--config", str(p)])
    return subprocess.CompletedProcess(["student.train.run"], code, "", capsys.readouterr().err)


def _assert_clear(proc, message):
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr.split("student error:")[0].split("\n")[-1]
    line = [x for x in proc.stderr.splitlines() if x.startswith("student error:")]
    assert line, proc.stderr[-3000:]


def test_config_error_is_one_line_exit_2(tmp_path, capsys):
    proc = run_in_process(tmp_path, capsys, {**TINY_STUDENT, "lr": -1})
    assert proc.returncode == 2
    _assert_clear(proc, "student.lr")
    assert "Traceback" not in proc.stderr


def test_empty_spool_folder_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    student = {**TINY_STUDENT, "mode": "spool", "spool_dir": str(tmp_path / "empty")}
    proc = run_in_process(tmp_path, capsys, student)
    assert proc.returncode == 2
    _assert_clear(proc, "has no *.safetensors files")
    assert "Traceback" not in proc.stderr


def test_hidden_size_mismatch_without_projection_is_a_clear_error(tmp_path, capsys):
    student = {**TINY_STUDENT, "projection": "never", "mode": "spool", "spool_dir": "x"}
    proc = run_in_process(tmp_path, capsys, student)
    assert proc.returncode == 2
    _assert_clear(proc, "student hidden size 32 != teacher hidden size 8")
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_missing_teacher_layer_stops_both_ranks_clearly(tmp_path):
    # Files go to ranks in name order (k0, k2, k4 -> rank 0): only rank 1's samples lack layer 3.
    spool = tmp_path / "spool"
    for i in range(6):
        write_sample(spool, sample(f"k{i}", 5, layers=(2, 3) if i % 2 == 0 else (2, 4)))
    student = {**TINY_STUDENT, "layer_map": [{"student_layer": 1, "teacher_layer": 3}], "mode": "spool",
               "spool_dir": str(spool)}  # fmt: skip
    proc = run_student(tmp_path, student, nproc=2, timeout=180)
    assert proc.returncode != 0
    assert "the teacher sends layers [2, 4] but the student needs teacher layer(s) [3]" in proc.stderr
    # Rank 0 had good data: it learns of the failure through the collective flag and stops too
    # (no hang in the next all-reduce).
    assert "another rank stopped with an error" in proc.stderr, proc.stderr[-3000:]


def test_teacher_protocol_version_mismatch_is_a_clear_error(tmp_path, capsys):
    """A fake teacher on a real socket answers HELLO with a message of protocol version 99."""
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def fake_teacher():
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        while not stop.is_set():
            if poller.poll(100):
                ident, *_ = router.recv_multipart()
                router.send_multipart([ident, msgpack.packb({"v": 99, "k": 3, "tid": "future"})])

    th = threading.Thread(target=fake_teacher, daemon=True)
    th.start()
    try:
        ep = f"tcp://127.0.0.1:{port}"
        transport = {"connect": [ep], "bind": [ep]}
        proc = run_in_process(tmp_path, capsys, {**TINY_STUDENT, "idle_flush_s": 0.2}, transport)
    finally:
        stop.set()
        th.join()
        router.close(linger=0)
    assert proc.returncode == 2
    _assert_clear(proc, "protocol version")
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_teacher_gone_exits_3_with_one_line_that_says_how_to_finish(tmp_path):
    """No teacher answers for transport.teacher_wait_s: exit code 3 and one line with what was
    trained, where the rest is and the two commands that finish the job."""
    ep = f"tcp://127.0.0.1:{faults.free_port()}"  # nobody listens there
    transport = {"connect": [ep], "bind": [ep], "teacher_wait_s": 3, "heartbeat_timeout_s": 1}
    proc = run_student(tmp_path, {**TINY_STUDENT, "idle_flush_s": 0.2}, transport)
    assert proc.returncode == 3, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("student stopped: ")]
    assert len(lines) == 1, proc.stderr[-3000:]
    line = lines[0]
    assert "no word from teacher" in line and "trained 0 samples (no checkpoint)" in line
    assert "spool folder runs/spool" in line
    run = str(tmp_path / "run.yaml")
    assert f"distill-teacher --config {run}" in line
    assert f"accelerate launch student.py --config {run}" in line and "resume_from" in line
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("path", sorted(ROOT.glob("configs/student_*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load_and_start_with_their_command(path):
    first = path.read_text().splitlines()[0]
    assert first.startswith("# accelerate launch ") and f"student.py --config configs/{path.name}" in first
    cfg, _ = load_student_config(str(path))
    assert cfg.layer_map


@pytest.mark.slow
@pytest.mark.parametrize("ahead", [False, True], ids=["fill", "fill_ahead"])
def test_two_ranks_with_accumulation_and_uneven_shares_match_a_single_process_reference(tmp_path, ahead):
    """The collective step logic, checked exactly: 2 ranks, grad_accum_steps=2, one sample per
    micro-batch, 5 files (rank 0 gets 3, rank 1 gets 2: the last micro-batch has a zero-weight rank
    and the last step is a partial flush). With SGD and equal-length samples every step must equal
    plain gradient descent on the mean loss of its micro-batches, each micro-batch the mean over its
    samples. The reference replays that in one process from the ledger and compares the weights.
    The same with `student.fill_ahead` (each micro-batch filled while the previous one trains)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from student.model import DistillModel, load_student
    from student.recipes.distill import Distill

    compute_loss = Distill().loss

    spool = tmp_path / "spool"
    samples = {f"k{i}": sample(f"k{i}", 6, layers=(2, 4), seed=i) for i in range(5)}
    for s in samples.values():
        write_sample(spool, s)
    student = {**TINY_STUDENT, "mode": "spool", "spool_dir": str(spool), "optimizer": "sgd", "lr": 0.5,
               "max_grad_norm": 0.0, "grad_accum_steps": 2, "max_samples_per_batch": 1,
               "losses": {"mse": 1.0, "cosine": 1.0, "nmse": 0.0}, "fill_ahead": ahead}  # fmt: skip
    proc = run_student(tmp_path, student, nproc=2, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert m["summary"]["steps"] == 2 and sorted(e[0] for e in m["trained"]) == sorted(samples)
    ahead_counts = [st["filled_ahead"] for st in m["summary"]["source_stats"]]
    assert ahead_counts == ([3, 3] if ahead else [0, 0])  # micro-batches 2-4 (then all done)

    cfg, _ = load_student_config(str(tmp_path / "run.yaml"))
    ref = DistillModel(load_student(cfg), [(1, 2)], 8, "auto")  # same seed, same init order
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in (1, 2):
        per_rank: dict[int, list[str]] = {}
        for key, rank, st in m["trained"]:
            if st == step:
                per_rank.setdefault(rank, []).append(key)
        n_micro = max(len(v) for v in per_rank.values())
        opt.zero_grad()
        for i in range(n_micro):
            keys = [v[i] for v in per_rank.values() if len(v) > i]
            for k in keys:
                loss, _ = compute_loss(ref, None, collate([samples[k]], [2]), cfg, None)
                (loss / len(keys) / n_micro).backward()
        opt.step()
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "model").state_dict()
    for name, p in ref.student.state_dict().items():
        torch.testing.assert_close(saved[name], p, atol=2e-5, rtol=1e-4, msg=name)
    proj = load_file(str(tmp_path / "out" / "model" / "distill_projections.safetensors"))
    torch.testing.assert_close(
        proj["s1_t2.weight"], ref.projections["s1_t2"].weight.detach(), atol=2e-5, rtol=1e-4
    )
    # And it trained: the weights moved away from the initial ones.
    init = DistillModel(load_student(cfg), [(1, 2)], 8, "auto")
    assert not torch.allclose(init.projections["s1_t2"].weight, ref.projections["s1_t2"].weight)


@pytest.mark.slow
@pytest.mark.parametrize("ahead", [False, True], ids=["fill", "fill_ahead"])
def test_two_ranks_given_the_same_keys_train_each_once(tmp_path, ahead):
    """Both ranks receive copies of the same keys (as after a redelivery): in the same micro-step
    the lower rank trains it, in a later one nobody does. Spool files named f00..f09 go to the ranks
    alternately (rank r takes files r, r+2, ...), one sample per micro-batch, so the schedule is
    known: micro-step m has rank 0's file 2m and rank 1's file 2m+1 (with `student.fill_ahead` too:
    the next micro-batch is filled while this one trains, from the same files)."""
    keys = ["k0", "k0", "k1", "k2", "k3", "k1", "k2", "k4", "k5", "k6"]  # file i holds keys[i]
    spool = tmp_path / "spool"
    spool.mkdir()
    for i, k in enumerate(keys):
        written = write_sample(tmp_path / "w" / str(i), sample(k, 6, layers=(2, 4), seed=i))
        written.rename(spool / f"f{i:02d}.safetensors")
    student = {**TINY_STUDENT, "mode": "spool", "spool_dir": str(spool), "max_samples_per_batch": 1,
               "fill_ahead": ahead}  # fmt: skip
    proc = run_student(tmp_path, student, nproc=2, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads((tmp_path / "out" / "metrics.json").read_text())
    by_rank: dict[int, list[str]] = {}
    for key, rank, _ in m["trained"]:
        by_rank.setdefault(rank, []).append(key)
    # m0: k0/k0 -> rank 0; m1: k1, k2; m2: k3, k1 (trained) ; m3: k2 (trained), k4; m4: k5, k6.
    assert by_rank == {0: ["k0", "k1", "k3", "k5"], 1: ["k2", "k4", "k6"]}, m["trained"]
    dropped = [st["dropped_duplicates"] for st in m["summary"]["source_stats"]]
    assert dropped == [1, 2]
    assert [st["filled_ahead"] for st in m["summary"]["source_stats"]] == ([5, 5] if ahead else [0, 0])
    assert sum(st["samples"] for st in m["steps"]) == 7


def _vllm_style_spool(folder: Path, n: int) -> list[str]:
    """Files as vLLM's ExampleHiddenStatesConnector writes them: nested, no metadata, a .lock beside."""
    from safetensors.torch import save_file

    names = []
    for i in range(n):
        d = folder / f"req-{i}"
        d.mkdir(parents=True)
        s = sample(f"r{i}", 4 + i, layers=(2, 4), seed=i)
        save_file({"hidden_states": s.tensors["hidden_states"], "token_ids": s.tensors["token_ids"]},
                  str(d / f"hs-{i}.safetensors"))  # fmt: skip
        (d / f"hs-{i}.safetensors.lock").touch()
        names.append(f"hs-{i}")
    return names


def test_vllm_connector_spool_needs_spool_layers(tmp_path):
    from student.sources import SpoolSource

    _vllm_style_spool(tmp_path / "vllm", 2)
    with pytest.raises(StudentError, match="set student.spool_layers"):
        SpoolSource(str(tmp_path / "vllm"), 0, 1, set()).get()
    got = SpoolSource(str(tmp_path / "vllm"), 0, 1, set(), layers=[2, 4]).get()
    assert got.layers == [2, 4] and got.key == "hs-0"


def test_student_trains_from_a_vllm_connector_folder(tmp_path, capsys):
    names = _vllm_style_spool(tmp_path / "vllm", 5)
    student = {**TINY_STUDENT, "mode": "spool", "spool_dir": str(tmp_path / "vllm"), "spool_layers": [2, 4]}
    proc = run_in_process(tmp_path, capsys, student)  # one process, as `python student.py` runs it
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert sorted(e[0] for e in m["trained"]) == names
    assert m["summary"]["tokens"] == sum(4 + i for i in range(5))


def test_student_from_a_checkpoint_folder(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from distill.config import validate
    from student.config import StudentConfig
    from student.model import load_student

    conf = Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, vocab_size=50)  # fmt: skip
    Qwen3ForCausalLM(conf).save_pretrained(tmp_path / "ckpt")
    cfg = validate(
        StudentConfig,
        {**{k: v for k, v in BASE.items() if k != "from_config"}, "model": str(tmp_path / "ckpt")},
    )
    lm = load_student(cfg)
    saved = Qwen3ForCausalLM.from_pretrained(tmp_path / "ckpt").state_dict()
    for k, v in lm.state_dict().items():
        torch.testing.assert_close(v, saved[k])
    with pytest.raises(StudentError, match="is not a folder"):
        load_student(
            validate(
                StudentConfig, {**cfg.model_dump(exclude={"from_config"}), "model": str(tmp_path / "no")}
            )
        )


# ---------------------------------------------------------------------------------------------
# Multi-node helpers (student/multinode.py, student/checkpoint.py): gloo interface, lost peers,
# checkpoints per node
# ---------------------------------------------------------------------------------------------


def test_gloo_ifname_left_alone_for_one_host_or_when_set():
    from student.multinode import pick_gloo_ifname

    assert (
        pick_gloo_ifname({"GLOO_SOCKET_IFNAME": "eth9", "MASTER_ADDR": "10.0.0.1", "WORLD_SIZE": "2"})[0]
        is None
    )
    assert pick_gloo_ifname({"MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "2"})[0] is None
    assert pick_gloo_ifname({"MASTER_ADDR": "10.0.0.1", "WORLD_SIZE": "1"})[0] is None


def test_gloo_ifname_is_the_interface_of_the_route_to_the_master():
    import psutil

    from student.multinode import pick_gloo_ifname

    # An address of this machine that is not loopback: its route's source is itself.
    addrs = [
        (n, a.address)
        for n, al in psutil.net_if_addrs().items()
        for a in al
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    ]
    if not addrs:
        pytest.skip("no non-loopback IPv4 address here")
    name, ip = addrs[0]
    got, why = pick_gloo_ifname({"MASTER_ADDR": ip, "WORLD_SIZE": "2"})
    assert got == name, why


def test_peer_failure_is_recognised_and_names_the_lost_host():
    from student.multinode import PeerTable, first_line, is_peer_failure

    e = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:538] Connection closed by peer "
        "[10.1.0.3]:29925. This is typically caused by a remote worker crashing."
    )
    assert is_peer_failure(e)
    assert not is_peer_failure(RuntimeError("CUDA out of memory"))
    assert not is_peer_failure(ValueError("Connection closed by peer"))
    t = PeerTable([(0, "a", "10.1.0.2"), (1, "a", "10.1.0.2"), (2, "b", "10.1.0.3"), (3, "b", "10.1.0.3")])
    assert t.gone(e, 0) == "rank 2,3 on host b (10.1.0.3)"
    assert first_line(e) == "Connection closed by peer [10.1.0.3]:29925"
    silent = t.gone(RuntimeError("Timed out waiting 600000ms for recv"), 0)
    assert silent == "rank 2,3 on host b (10.1.0.3) (no answer in time)"


def _fake_ckpt(d: Path, step: int, ranks, complete=True, latest=False):
    p = d / f"step_{step:07d}"
    p.mkdir(parents=True)
    for name in ("model.safetensors", "optimizer.bin", "custom_checkpoint_0.pkl", "ledger.json"):
        (p / name).write_bytes(b"x")
    for r in ranks:
        (p / f"random_states_{r}.pkl").write_bytes(b"x")
    if complete:
        (p / ".complete").write_text("")
    if latest:
        (d / "latest").write_text(p.name)
    return p


def test_resume_picks_the_newest_step_complete_on_every_rank(tmp_path):
    from student.checkpoint import choose_resume, local_checkpoints

    n0, n1 = tmp_path / "node0", tmp_path / "node1"  # checkpoint folders on two nodes' own disks
    _fake_ckpt(n0, 4, [0])
    _fake_ckpt(n0, 8, [0], latest=True)
    _fake_ckpt(n1, 4, [1])
    _fake_ckpt(n1, 8, [1], complete=False)  # the node died while saving step 8
    per_rank = [local_checkpoints(n0, 0), local_checkpoints(n1, 1)]
    assert per_rank == [{4: "step_0000004", 8: "step_0000008"}, {4: "step_0000004"}]
    assert choose_resume(per_rank, ["a", "b"]) == (4, None)
    assert choose_resume([{}, {}], ["a", "b"]) == (None, None)  # fresh start


def test_resume_refuses_a_partial_checkpoint_with_one_line(tmp_path):
    """The old layout on a second node: only random_states_1.pkl (the main process wrote the rest
    on node 0): rank 1 cannot load it, so the run refuses instead of starting rank 1 at step 0."""
    from student.checkpoint import choose_resume, local_checkpoints

    n0, n1 = tmp_path / "node0", tmp_path / "node1"
    _fake_ckpt(n0, 8, [0, 1], latest=True)
    (n1 / "step_0000008").mkdir(parents=True)
    (n1 / "step_0000008" / "random_states_1.pkl").write_bytes(b"x")
    per_rank = [local_checkpoints(n0, 0), local_checkpoints(n1, 1)]
    step, why = choose_resume(per_rank, ["a (10.0.0.2)", "b (10.0.0.3)"])
    assert step is None and "\n" not in why
    assert "cannot resume" in why and "rank 1 on b (10.0.0.3): none" in why


def test_a_rank_says_its_one_line_in_one_write(tmp_path):
    """Ranks share stderr: `student error: ...` goes out as one write with its newline (print()
    writes the text and the newline apart, and two ranks' lines ran into one in CI)."""
    import student.train as train

    out = tmp_path / "stderr.txt"
    calls: list[bytes] = []
    real = os.write
    with out.open("wb") as f:
        old = sys.stderr
        sys.stderr = open(f.fileno(), "w", closefd=False)  # noqa: SIM115 - restored below
        try:
            os.write = lambda fd, data: calls.append(bytes(data)) or real(fd, data)
            train.say("student error: " + "x" * 3000)
        finally:
            os.write = real
            sys.stderr = old
    assert calls == [b"student error: " + b"x" * 3000 + b"\n"]
    assert out.read_bytes() == calls[0]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_training_step_never_reads_a_device_value_on_the_host(attn):
    """On a GPU every read of a device value on the host (`.item()`, `bool(t)`) makes the host wait
    for the GPU, so it cannot prepare the next batch meanwhile. transformers reads a 2D attention
    mask that way to choose its kernel; with right padding the student passes none (causal attention
    alone: a real token's past is all real). Counted here on the CPU: no `_local_scalar_dense` in
    forward and backward, and the same loss and gradients as with the 2D mask, for a padded batch, an
    unpadded one and the one-padding-token batch of the zero-weight synchronising backward."""
    from host_reads import HostReads

    from student.data import empty_batch
    from student.model import DistillModel, load_student
    from student.recipes.distill import Distill

    cfg = load_student_config_dict({**TINY_STUDENT, "losses": {"nmse": 1.0, "cosine": 0.5, "ce": 0.5}})
    model = DistillModel(load_student(cfg), [(1, 2)], 8, "auto")
    model.student.set_attn_implementation(attn)
    batches = {
        "padded": collate([sample("a", 5, seed=1), sample("b", 3, seed=2), sample("c", 1, seed=5)], [2]),
        "unpadded": collate([sample("d", 4, seed=3), sample("e", 4, seed=4)], [2]),
        "empty": empty_batch([2], 8),
    }
    for name, host in batches.items():
        dev = host.to("cpu")
        runs = []
        for as_before in (False, True):  # as before: the 2D mask
            model.zero_grad(set_to_none=True)
            if as_before:
                model._attention_mask = lambda m: m.long()  # shadows the method on this instance
            with HostReads() as reads:
                loss, _ = Distill().loss(model, None, dev, cfg, None)
                (loss * (0.0 if name == "empty" else 1.0)).backward()
            if as_before:
                del model._attention_mask  # back to the class's method
            if not as_before:
                assert reads.n == 0, f"{name}: {reads.n} host reads of device values"
            runs.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
        (l1, g1), (l2, g2) = runs
        assert torch.isfinite(l1) and all(torch.isfinite(g).all() for g in g1), name
        torch.testing.assert_close(l1, l2)
        assert len(g1) == len(g2) > 0
        for a, b in zip(g1, g2, strict=True):
            torch.testing.assert_close(a, b)


def test_the_fill_ahead_thread_sets_an_indexed_cuda_device(monkeypatch):
    """torch.cuda.set_device refuses plain "cuda" (a student started without a launcher on one GPU
    gets that device): the filling thread sets the calling thread's current index instead. This
    machine has no CUDA device: current_device is replaced by one that answers 3 (the helper's
    choice is what is checked); the H100 run that found it trained 3000 of 3000 after the fix."""
    from student.loop import cuda_index

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert cuda_index(torch.device("cuda")) == 3
    assert cuda_index(torch.device("cuda", 1)) == 1
    assert cuda_index(torch.device("cpu")) is None

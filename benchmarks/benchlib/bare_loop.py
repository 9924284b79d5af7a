"""The bare loop of benchmarks/gpu_e2e.py (a child process): the same student, batches, loss
terms and optimizer with the teacher states already on the GPU: what the GPU can do."""

from __future__ import annotations

import collections
import json
import time
from pathlib import Path


def token_lengths(cfg_path: Path) -> dict[str, list[int]]:
    """key -> prompt token ids, as the teacher tokenizes them."""
    from distill.config import load_run_file
    from teacher.config import load_teacher_config
    from teacher.data import Prompter, iter_rows

    run = load_run_file(str(cfg_path), {})
    tcfg = load_teacher_config(run.teacher)
    prompter = Prompter(tcfg)
    return {k: prompter.token_ids(row) for k, row in iter_rows(tcfg)}


def plan_batches(
    ids: dict[str, list[int]], metrics: str | None, budget: int, packed: bool = False
) -> tuple[list[list[str]], str]:
    """The student's own batches (from metrics.json: keys grouped by optimizer step, in order) when
    there is one, else the dataset order through the student's TokenBudgetBatcher (`packed`: its
    budget counts tokens, as the student's packed layout does)."""
    from student.data import TokenBudgetBatcher

    class _S:
        def __init__(self, key, n):
            self.key, self.num_tokens = key, n

    groups: list[list[str]] = []
    how = "dataset order, TokenBudgetBatcher"
    if metrics and Path(metrics).exists():
        trained = json.loads(Path(metrics).read_text()).get("trained", [])
        by_step: dict[int, list[str]] = collections.OrderedDict()
        for key, _rank, step in trained:
            if key in ids:
                by_step.setdefault(int(step), []).append(key)
        if by_step:
            groups = [by_step[s] for s in sorted(by_step)]
            how = "the student's own batches (metrics.json trained, grouped by step)"
    if not groups:
        groups = [list(ids)]
    batches = []
    for g in groups:  # a step may hold several micro-batches: split by the same budget
        b = TokenBudgetBatcher(budget, packed=packed)
        for k in g:
            ready = b.push(_S(k, len(ids[k])))
            if ready:
                batches.append([s.key for s in ready])
        if b.pending:
            batches.append([s.key for s in b.flush()])
    return batches, how


def child_bare(args) -> dict:
    import torch

    from distill.protocol import Sample
    from student.config import load_student_config
    from student.data import Batch, collate
    from student.model import DistillModel, TeacherHead, load_student, teacher_config
    from student.recipes.base import build_optimizer
    from student.recipes.distill import Distill

    compute_loss = Distill().loss

    cfg, run = load_student_config(args.config, [])
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ids = token_lengths(Path(args.config))
    packed = getattr(cfg, "batch_layout", "padded") == "packed"  # the student's layout
    batches, how = plan_batches(ids, args.metrics, cfg.max_tokens_per_batch, packed)
    tconf = teacher_config(cfg)
    H, L = tconf.hidden_size, tconf.num_hidden_layers
    torch.manual_seed(0)
    student = load_student(cfg)
    model = DistillModel(
        student, [(p.student_layer, p.teacher_layer) for p in cfg.layer_map], H, cfg.projection
    ).to(dev)
    head = TeacherHead.from_checkpoint(cfg.teacher_model).to(dev) if cfg.losses.kl > 0 else None
    layer_ids = sorted({p.teacher_layer for p in cfg.layer_map} | ({L} if head else set()))
    opt = build_optimizer(cfg, model.parameters())
    amp = cfg.mixed_precision == "bf16" and dev.type == "cuda"
    # The student's attention backend and padding rule, where its version has them.
    cudnn = getattr(cfg, "cudnn_attention", None)
    if cudnn is not None and dev.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(bool(cudnn))
    pad_to = 1
    if cudnn is not None:
        pad_to = getattr(cfg, "pad_to_multiple_of", None) or (64 if dev.type == "cuda" and cudnn else 1)

    def padded(n: int) -> int:
        return -(-n // pad_to) * pad_to

    # Teacher states on the device, in the dtype the teacher sends (the loss upcasts, as in the
    # student): one random pool, each batch a view of its first B*T rows.
    tdtype = torch.float32 if (run.teacher or {}).get("dtype") == "float32" else torch.bfloat16

    def rows(b: list[str]) -> int:
        lens = [len(ids[k]) for k in b]
        return sum(lens) if packed else len(b) * padded(max(lens))

    max_rows = max(rows(b) for b in batches)
    pool = torch.randn(max_rows, len(layer_ids), H, device=dev, dtype=torch.float32).to(tdtype)
    out0 = {"bare_cudnn_attention": cudnn, "bare_pad_to": pad_to, "bare_teacher_dtype": str(tdtype)}
    out0["bare_batch_layout"] = "packed" if packed else "padded"
    dev_batches = []
    for b in batches:
        lens = [len(ids[k]) for k in b]
        if packed:  # one row, the samples one after another (student.batch_layout: packed)
            n = sum(lens)
            inp = torch.tensor([t for k in b for t in ids[k]], dtype=torch.long).view(1, n)
            host = Batch(inp, torch.ones(1, n, dtype=torch.bool), pool[:n], layer_ids, [n], segments=lens)
            dev_batches.append(host.to(dev))
            continue
        T = padded(max(lens))
        inp = torch.zeros(len(b), T, dtype=torch.long)
        mask = torch.zeros(len(b), T, dtype=torch.bool)
        for i, k in enumerate(b):
            inp[i, : lens[i]] = torch.tensor(ids[k])
            mask[i, : lens[i]] = True
        teacher = pool[: len(b) * T].view(len(b), T, len(layer_ids), H)
        dev_batches.append(Batch(inp.to(dev), mask.to(dev), teacher, layer_ids))  # padded: lengths None
    real_tokens = [int(b.mask.sum()) for b in dev_batches]
    if packed:  # the packed kernel path against the padded one, same samples: the loss must agree
        b0 = batches[0]
        lens = [len(ids[k]) for k in b0]
        inp = torch.zeros(len(b0), max(lens), dtype=torch.long)
        mask = torch.zeros(len(b0), max(lens), dtype=torch.bool)
        for i, k in enumerate(b0):
            inp[i, : lens[i]] = torch.tensor(ids[k])
            mask[i, : lens[i]] = True
        rows = dev_batches[0].teacher[0]  # [N, n, H]: each sample's rows in order
        pad_t = torch.zeros(len(b0), max(lens), *rows.shape[1:], device=dev, dtype=rows.dtype)
        off = 0
        for i, n in enumerate(lens):
            pad_t[i, :n] = rows[off : off + n]
            off += n
        as_padded = Batch(inp.to(dev), mask.to(dev), pad_t, layer_ids)
        with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
            lk = float(compute_loss(model, head, dev_batches[0], cfg, L)[0])
            lp = float(compute_loss(model, head, as_padded, cfg, L)[0])
        from student import packing

        out0.update(
            bare_packed_check_loss=[round(lk, 6), round(lp, 6)],
            bare_packed_check_rel=round(abs(lk - lp) / max(abs(lp), 1e-12), 6),
            bare_packed_varlen=packing._VARLEN is not None and dev.type == "cuda" and amp,
        )

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def step(batch):
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
            loss, _ = compute_loss(model, head, batch, cfg, L)
        loss.backward()
        if cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    out: dict = {"bare_batches_from": how, "bare_batches": len(dev_batches), "device": str(dev), **out0}
    if dev.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(0)
    for b in dev_batches[:3]:  # warm-up (kernels, allocator)
        step(b)
    sync()

    # 1) bare: device-resident batches, no host sync per step. The first pass meets every batch
    #    shape for the first time (per-shape costs: cuDNN attention plans, allocator growth), the
    #    second one runs the same batches again: that one is bare_loop_tok_s.
    def timed_pass(max_s):
        sync()
        t0 = time.perf_counter()
        n_tok = n = 0
        for b, nt in zip(dev_batches, real_tokens, strict=True):
            step(b)
            n_tok += nt
            n += 1
            if n % 8 == 0 and time.perf_counter() - t0 > max_s:
                break
        sync()
        return n, n_tok, time.perf_counter() - t0

    n, n_tok, dt_s = timed_pass(args.bare_max_s / 2)
    out.update(bare_cold_pass_tok_s=round(n_tok / dt_s, 1), bare_cold_pass_steps=n)
    n, n_tok, dt_s = timed_pass(args.bare_max_s / 2)
    out.update(
        bare_loop_tok_s=round(n_tok / dt_s, 1),
        bare_loop_steps=n,
        bare_loop_tokens=n_tok,
        bare_loop_s=round(dt_s, 3),
        bare_ms_per_step=round(1000 * dt_s / n, 2),
        bare_padded_tokens=sum(b.input_ids.numel() for b in dev_batches[:n]),
    )
    # 1b) one fixed shape, no padding: max_tokens_per_batch as [B, T] (the fixed-shape bare loop)
    t_fix = min(2048, cfg.max_tokens_per_batch)
    b_fix = max(1, cfg.max_tokens_per_batch // t_fix)
    fixed = Batch(
        torch.randint(0, tconf.vocab_size, (b_fix, t_fix), device=dev),
        torch.ones(b_fix, t_fix, dtype=torch.bool, device=dev),
        pool[: b_fix * t_fix].view(b_fix, t_fix, len(layer_ids), H)
        if b_fix * t_fix <= max_rows
        else torch.randn(b_fix, t_fix, len(layer_ids), H, device=dev).to(tdtype),
        layer_ids,
    )
    for _ in range(3):
        step(fixed)
    sync()
    t0 = time.perf_counter()
    reps = 0
    while reps < 40 and (reps < 5 or time.perf_counter() - t0 < 10):
        step(fixed)
        reps += 1
        if reps % 5 == 0:
            sync()
    sync()
    dt_s = time.perf_counter() - t0
    out["bare_fixed_shape"] = [b_fix, t_fix]
    out["bare_fixed_shape_tok_s"] = round(reps * b_fix * t_fix / dt_s, 1)
    # 2) per-phase GPU time of the bare step (synchronised timers, a few steps)
    ph = collections.defaultdict(float)
    k = min(10, len(dev_batches))
    for b in dev_batches[:k]:
        sync()
        t = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
            loss, _ = compute_loss(model, head, b, cfg, L)
        sync()
        ph["forward_loss"] += time.perf_counter() - t
        t = time.perf_counter()
        loss.backward()
        sync()
        ph["backward"] += time.perf_counter() - t
        t = time.perf_counter()
        if cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        ph["optimizer"] += time.perf_counter() - t
    out["bare_phase_ms_per_step"] = {kk: round(1000 * v / k, 2) for kk, v in ph.items()}
    # 3) as 1) but each batch built the student's way: host Samples (the teacher's dtype, all its
    #    layers, as received) -> student.data.collate (host) -> Batch.to(device), synchronised.
    n_layers_sent = len(run.teacher["layer_ids"]) if run.teacher else len(layer_ids)
    sent_ids = list(run.teacher["layer_ids"]) if run.teacher else layer_ids
    max_t = max(len(v) for v in ids.values())
    # Distinct buffers, a sample's each in turn, 1 GiB or more in all: collate reads memory that is
    # not in the CPU's caches, as it reads a received sample (one shared tensor would be warm after
    # the first batch and understate the copy several times over).
    one = torch.randn(max_t, n_layers_sent, H).to(tdtype)
    n_bufs = max(2, min(len(ids), -(-(1 << 30) // max(one.nbytes, 1))))
    host_hs = [one] + [one.clone() for _ in range(n_bufs - 1)]
    out["bare_with_student_collate_buffers"] = [n_bufs, one.nbytes]
    samples = {
        k: Sample(
            key=k,
            tensors={
                "hidden_states": host_hs[i % n_bufs][: len(v)],
                "token_ids": torch.tensor(v, dtype=torch.int64),
            },
            layers=sent_ids,
        )
        for i, (k, v) in enumerate(ids.items())
    }
    import inspect

    params = inspect.signature(collate).parameters  # the student's version: pinned, rounded T
    collate_kw = {}
    if "pin_memory" in params:
        collate_kw["pin_memory"] = dev.type == "cuda"
    if "pad_to_multiple_of" in params:
        collate_kw["pad_to_multiple_of"] = pad_to
    if "threads" in params:
        collate_kw["threads"] = cfg.collate_threads
    if "pack" in params:
        collate_kw["pack"] = packed
    out["bare_with_student_collate_kw"] = collate_kw
    ph2 = collections.defaultdict(float)
    t0 = time.perf_counter()
    n_tok = n = 0
    for bkeys, nt in zip(batches, real_tokens, strict=True):
        t = time.perf_counter()
        hb = collate([samples[k] for k in bkeys], layer_ids, **collate_kw)
        t1 = time.perf_counter()
        db = hb.to(dev)
        sync()
        t2 = time.perf_counter()
        step(db)
        sync()
        t3 = time.perf_counter()
        ph2["collate"] += t1 - t
        ph2["h2d"] += t2 - t1
        ph2["step"] += t3 - t2
        n_tok += nt
        n += 1
        if n >= 6 and time.perf_counter() - t0 > min(20.0, args.bare_max_s):
            break
    dt_s = time.perf_counter() - t0
    out["bare_with_student_collate_tok_s"] = round(n_tok / dt_s, 1)
    out["bare_with_student_collate_ms_per_step"] = {kk: round(1000 * v / n, 2) for kk, v in ph2.items()}
    out["bare_with_student_collate_steps"] = n
    return out

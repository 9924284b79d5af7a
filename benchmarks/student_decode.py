"""How many samples one CPU student process can receive, decode and batch (no model).

    .venv/bin/python benchmarks/student_decode.py [--tokens 1024] [--layers 4] [--hidden 4096] [--seconds 10]
    .venv/bin/python benchmarks/student_decode.py --collate-only [--hidden 2048] [--threads 1,2,4]

A Publisher (this process) sends Qwen3-8B-sized samples (default 1024 tokens x 4 layers x 4096, bf16
= 32 MiB) as fast as credit allows to ONE student process, over the shared-memory path and over tcp.
The student decodes each sample, picks the layers a layer map needs, and collates token-budget
batches with student/data.py (a real copy into padded batch tensors), then acks. Prints samples/s,
tokens/s and GB/s per path; a teacher at ~27k prefill tokens/s (one H200, Qwen3-8B) needs
~26 samples/s of 1024 tokens. Last line: one JSON object.

--collate-only: no transport; student.data.collate of 16 samples of 600 to `--tokens - 1` tokens
(half of `--layers` layers picked, evenly spaced) with each `student.collate_threads` count of
`--threads`, 20 rounds after one warm-up: ms per batch and GB/s of teacher rows.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distill.config import SpoolConfig, TransportConfig  # noqa: E402
from distill.protocol import Sample  # noqa: E402
from distill.transport import Publisher, Subscriber  # noqa: E402

MiB = 1 << 20


def student(ep: str, shm: str, layer_ids: list[int], budget: int, out_q) -> None:
    from student.data import TokenBudgetBatcher, collate

    torch.set_num_threads(1)
    cfg = TransportConfig(connect=[ep], shm=shm, credit_samples=32, credit_bytes=2 << 30)
    batcher = TokenBudgetBatcher(budget)
    n = tokens = nbytes = batches = 0
    t0 = None
    t_last = None
    with Subscriber(cfg) as sub:
        while True:
            s = sub.get(timeout=0.5)
            if s is None:  # END, or nothing came for a while: what is held is trained and acked
                rest = batcher.flush()
                if rest:
                    collate(rest, layer_ids)
                    sub.ack(rest)
                    t_last = time.perf_counter()
                if sub.finished:  # the teacher sends END once every sample is acked
                    break
                continue
            if t0 is None:
                t0 = time.perf_counter()
            full = batcher.push(s)
            if not full and batcher.full:  # no further sample could join: do not wait for one
                full = batcher.flush()
            if full:
                collate(full, layer_ids)
                sub.ack(full)
                batches += 1
                t_last = time.perf_counter()
            n += 1
            tokens += s.num_tokens
            nbytes += s.nbytes
        dt = (t_last or time.perf_counter()) - (t0 or time.perf_counter())
    out_q.put({"samples": n, "tokens": tokens, "bytes": nbytes, "batches": batches, "seconds": dt})


def run(shm: str, args, ctx) -> dict:
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    ep = f"tcp://127.0.0.1:{port}"
    sample_bytes = args.tokens * args.layers * args.hidden * 2
    cfg = TransportConfig(bind=[ep], shm=shm, shm_bytes=24 * sample_bytes, max_buffer_bytes=32 * sample_bytes)
    pool = [torch.randn(args.tokens, args.layers, args.hidden).bfloat16() for _ in range(4)]
    ids = torch.arange(args.tokens)
    out_q = ctx.Queue()
    layer_ids = list(range(1, args.layers + 1))
    with Publisher(cfg, SpoolConfig(dir=f"/tmp/bench-decode-spool-{os.getpid()}")) as pub:
        p = ctx.Process(
            target=student, args=(ep, shm, layer_ids[: max(1, args.layers // 2)], args.budget, out_q)
        )
        p.start()
        while pub.stats()["students"] < 1:
            time.sleep(0.01)
        t_end = time.monotonic() + args.seconds
        i = 0
        while time.monotonic() < t_end:
            st = pub.stats()
            if st["submitted"] - st["acked"] >= 16:  # keep the student busy, never spool
                time.sleep(0.001)
                continue
            pub.submit(
                Sample(
                    key=f"k{i}", tensors={"hidden_states": pool[i % 4], "token_ids": ids}, layers=layer_ids
                )
            )
            i += 1
        pub.close_input()
        pub.wait_done(120)
        r = out_q.get(timeout=120)
        p.join()
    r["samples_per_s"] = r["samples"] / r["seconds"]
    r["tokens_per_s"] = r["tokens"] / r["seconds"]
    r["gbs"] = r["bytes"] / r["seconds"] / 1e9
    return r


def collate_only(args) -> dict:
    """student.data.collate alone, at each thread count (the process's own torch threads: 1, as
    under `accelerate launch`)."""
    import random

    from student.data import collate

    torch.set_num_threads(1)
    rng = random.Random(0)
    layer_ids = list(range(1, args.layers + 1))
    picked = layer_ids[1::2] or layer_ids[:1]
    samples = []
    for i in range(16):
        n = rng.randint(min(600, args.tokens - 1), args.tokens - 1)
        hs = torch.randn(n, args.layers, args.hidden).bfloat16()
        ids = torch.arange(n)
        samples.append(Sample(key=f"k{i}", tensors={"hidden_states": hs, "token_ids": ids}, layers=layer_ids))
    nbytes = sum(s.num_tokens for s in samples) * len(picked) * args.hidden * 2
    out = {"batch_mb": round(nbytes / 1e6, 1)}
    for threads in [int(x) for x in args.threads.split(",")]:
        collate(samples, picked, threads=threads)
        t0 = time.perf_counter()
        for _ in range(20):
            collate(samples, picked, threads=threads)
        dt = (time.perf_counter() - t0) / 20
        print(
            f"collate_threads {threads}: {dt * 1e3:.1f} ms a batch, {nbytes / dt / 1e9:.1f} GB/s", flush=True
        )
        out[f"threads_{threads}_ms"] = round(dt * 1e3, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--budget", type=int, default=8192, help="tokens per batch")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--collate-only", action="store_true", help="time student.data.collate alone")
    ap.add_argument("--threads", default="1,2,4", help="--collate-only: collate_threads counts")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    res = {"machine": f"{platform.node()} {os.cpu_count()} cores", "command": "python " + " ".join(sys.argv)}
    if args.collate_only:
        res.update(collate_only(args))
        print(json.dumps(res))
        return
    for shm in ("auto", "off"):
        r = run(shm, args, ctx)
        name = "shm" if shm == "auto" else "tcp"
        print(
            f"{name}: {r['samples_per_s']:.1f} samples/s, {r['tokens_per_s']:.0f} tokens/s, {r['gbs']:.2f} GB/s "
            f"({r['samples']} samples of {args.tokens} tokens x {args.layers} layers x {args.hidden}, {r['batches']} batches)",
            flush=True,
        )
        for k in ("samples_per_s", "tokens_per_s", "gbs"):
            res[f"{name}_{k}"] = round(r[k], 2)
    res["teacher_need_samples_per_s_h200_qwen3_8b"] = round(27000 / args.tokens, 1)
    print(json.dumps(res))


if __name__ == "__main__":
    main()

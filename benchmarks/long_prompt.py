#!/usr/bin/env python3
"""Memory the connector's staging takes for one long sample, whole vs in pieces (teacher.staging_bytes).

No vLLM: a hidden-state cache of vLLM's layout ([blocks, L, block_size, H], the request's blocks
scattered in it) is built on `--device`, and each mode takes one sample of `--tokens` tokens off it
with the connector's own code (teacher/connector/staging.py) into a fresh destination of the sample's size
(what the Publisher holds), checked bitwise against one gather. Each mode runs in a fresh process:

    whole         the path of a sample within the bound: one gather (+ fp8 quantization) of the
                  whole block; CUDA: into a pinned buffer sized as the pool sizes it
    pieces:<MiB>  the path of a sample over a bound of <MiB>: Pieces.run

Reported per mode: `staging_peak_bytes` (the connector's own counter: the largest gather's tensors or
pinned buffer), the measured growth of the process beyond the cache and the destination
(CPU: peak RSS, `ru_maxrss`; CUDA: `torch.cuda.max_memory_allocated` beyond the cache), the pinned
bytes (CUDA) and the seconds. One `RESULT_JSON {...}` line at the end.

    python benchmarks/long_prompt.py --tokens 32768 --layers 4 --hidden 4096 --dtype bfloat16
    python benchmarks/long_prompt.py --tokens 32768 --layers 4 --hidden 4096 --device cuda --fp8
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MiB = 1 << 20


def _one(a) -> dict:
    import torch

    from distill import fp8
    from teacher.connector.staging import (
        SLACK,
        Pieces,
        gather_rows,
        piece_tokens,
        slot_mapping,
        stage_whole,
        token_bytes,
    )

    dev = torch.device(a.device)
    dtype = getattr(torch, a.dtype)
    bs = 16
    blocks = -(-a.tokens // bs) + 8
    torch.manual_seed(0)
    kv = torch.randn(blocks, a.layers, bs, a.hidden, dtype=dtype, device=dev)
    order = torch.randperm(blocks)[: -(-a.tokens // bs)].tolist()
    slots = slot_mapping(order, bs, a.tokens).to(dev)
    perm = torch.arange(a.layers - 1, -1, -1, device=dev)  # a reorder, as with unsorted layer ids
    quantize = a.fp8
    cuda = dev.type == "cuda"
    shape = [a.tokens, a.layers, a.hidden]
    dsts = [torch.empty(shape, dtype=fp8.FP8 if quantize else dtype)]
    if quantize:
        dsts.append(torch.empty(shape[:2], dtype=torch.float32))
    sample_bytes = sum(t.numel() * t.element_size() for t in dsts)
    for t in dsts:
        t.view(torch.uint8).fill_(0)  # touched: counted in the RSS baseline
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    pinned = 0
    stream = torch.cuda.Stream() if cuda else None
    if a.mode == "whole":
        staging = None
        if cuda:  # the pool's buffer for it: a power of two >= the staged bytes (as the connector)
            host_token = (
                a.layers * a.hidden + 4 * a.layers if quantize else a.layers * a.hidden * kv.element_size()
            )
            need = a.tokens * host_token + SLACK
            pinned = 1 << max(20, (need - 1).bit_length())
            if a.bound:
                pinned = min(pinned, max(a.bound * MiB, need))
            staging = torch.empty(pinned, dtype=torch.uint8, pin_memory=True)
        with torch.cuda.stream(stream) if cuda else nullcontext():
            hosts, peak = stage_whole(kv, slots, perm, quantize, staging)
            if cuda:
                ev = torch.cuda.Event()
                ev.record(stream)
        if cuda:
            ev.synchronize()
            peak = max(peak, pinned)
        for d, h in zip(dsts, hosts, strict=True):
            d.copy_(h)
    else:
        bound = int(a.mode.split(":")[1]) * MiB
        per = token_bytes(a.layers, a.hidden, kv.element_size(), quantize)
        staging = torch.empty(bound, dtype=torch.uint8, pin_memory=True) if cuda else None
        pinned = bound if cuda else 0
        p = Pieces(kv, slots, perm, quantize, piece_tokens(bound, per), stream=stream, staging=staging)
        p.run(dsts)
        peak = max(p.peak, pinned)
    took = time.perf_counter() - t0
    grow = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
    out = {
        "mode": a.mode,
        "staging_peak_bytes": peak,
        "seconds": round(took, 3),
        "sample_bytes": sample_bytes,
    }
    if cuda:
        out["device_peak_bytes"] = torch.cuda.max_memory_allocated() - base
        out["pinned_bytes"] = pinned
    else:
        out["host_growth_bytes"] = grow  # beyond the cache and the (touched) destination
    rows = gather_rows(kv, slots, perm)
    want = list(fp8.quantize(rows)) if quantize else [rows]
    out["bitwise_equal"] = all(
        torch.equal(d.view(torch.uint8), w.cpu().view(torch.uint8)) for d, w in zip(dsts, want, strict=True)
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--fp8", action="store_true", help="teacher.hidden_dtype: fp8")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--modes", default="whole,pieces:512,pieces:64")
    ap.add_argument("--bound", type=int, default=0, help="(whole) the pool's limit in MiB; 0: none")
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.mode:
        print(json.dumps(_one(a)))
        return
    results = []
    for mode in a.modes.split(","):
        args = [
            sys.executable,
            __file__,
            "--mode",
            mode,
            "--tokens",
            str(a.tokens),
            "--layers",
            str(a.layers),
        ]
        args += ["--hidden", str(a.hidden), "--dtype", a.dtype, "--device", a.device, "--bound", str(a.bound)]
        args += ["--fp8"] if a.fp8 else []
        r = subprocess.run(args, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"long_prompt: mode {mode} failed: {r.stderr.strip().splitlines()[-1:]}")
        results.append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
    settings = {k: getattr(a, k) for k in ("tokens", "layers", "hidden", "dtype", "fp8", "device")}
    print("RESULT_JSON " + json.dumps({"settings": settings, "modes": results}))


if __name__ == "__main__":
    main()

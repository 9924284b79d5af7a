"""Measure an exported EAGLE-3 draft in vLLM: mean acceptance length and the greedy outputs.

    python -m student.eagle3.evaluate --target runs/tiny-llama --draft runs/eagle3-tiny/draft \\
        --prompts prompts.jsonl [--k 3] [--max-tokens 48] [--out result.json]
    python -m student.eagle3.evaluate --target ... --prompts ...      # no draft: the target alone
    python -m student.eagle3.evaluate --target ... --draft none --draft A --draft B ...  # one process

Greedy decoding (temperature 0), `ignore_eos`. Per configuration one JSON object: `drafts`,
`draft_tokens`, `accepted`, `accepted_per_pos`, `mean_acceptance_length` (1 + accepted / drafts:
tokens gained per target step, vLLM's own definition) and `outputs` (generated token ids per
prompt); printed as a list in --draft order (also written to --out). `--prompts`: a JSONL file of {"text": ...} or {"prompt": ...} rows, or one prompt per
line of a text file. vLLM is imported here only (student/ training never needs it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def read_prompts(path: str) -> list[str]:
    out = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            out.append(line)
            continue
        out.append(row.get("text") or row.get("prompt") if isinstance(row, dict) else str(row))
    return out


def spec_metrics(metrics) -> dict:
    """vLLM's spec-decode counters from `llm.get_metrics()`."""
    got = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}
    names = {
        "vllm:spec_decode_num_drafts": "drafts",
        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted",
    }
    for m in metrics:
        if m.name in names:
            got[names[m.name]] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            got["accepted_per_pos"] = [int(v) for v in m.values]
    got["mean_acceptance_length"] = 1.0 + got["accepted"] / got["drafts"] if got["drafts"] else None
    return got


def run(
    target: str,
    draft: str | None,
    prompts: list[str],
    k: int,
    max_tokens: int,
    dtype: str,
    gpu_mem: float = 0.5,
) -> dict:
    import gc

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    spec = {"method": "eagle3", "model": draft, "num_speculative_tokens": k} if draft else None
    llm = LLM(
        model=target,
        dtype=dtype,
        enforce_eager=True,
        max_model_len=512,
        gpu_memory_utilization=gpu_mem,  # a GPU shared with the process that trained the draft
        disable_log_stats=False,
        speculative_config=spec,
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    result = spec_metrics(llm.get_metrics()) if draft else {}
    result["outputs"] = [list(o.outputs[0].token_ids) for o in outs]
    result["draft"] = draft
    llm.llm_engine.engine_core.shutdown()  # the engine process ends before the next one starts
    del llm
    gc.collect()
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True, help="target (teacher) checkpoint folder")
    ap.add_argument(
        "--draft", action="append", default=[], help="exported EAGLE-3 draft folder, or none (repeatable)"
    )
    ap.add_argument("--prompts", required=True, help="JSONL ({'text': ...}) or one prompt per line")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", help="also write the JSON result here")
    ap.add_argument(
        "--gpu-memory-utilization", type=float, default=0.5, help="vLLM's share of the GPU (ignored on CPU)"
    )
    args = ap.parse_args(argv)
    drafts = [None if d in ("", "none") else d for d in args.draft] or [None]
    for p, what in ((args.target, "--target"), *((d, "--draft") for d in drafts)):
        if p and not (Path(p) / "config.json").is_file():
            print(f"eagle3.evaluate error: {what} {p!r} has no config.json", file=sys.stderr)
            sys.exit(2)
    prompts = read_prompts(args.prompts)
    results = [
        run(args.target, d, prompts, args.k, args.max_tokens, args.dtype, args.gpu_memory_utilization)
        for d in drafts
    ]
    text = json.dumps(results)
    if args.out:
        Path(args.out).write_text(text)
    print(text, flush=True)


if __name__ == "__main__":
    main()

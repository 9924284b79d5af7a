#!/usr/bin/env python3
"""Teacher-side throughput on a GPU host: vLLM prefill with and without hidden-state delivery.

One command runs every mode, each in a fresh Python process (one vLLM engine at a time; engines
do not share GPU memory well), and ends with one JSON line (``RESULT_JSON {...}``) holding every
figure and the ratios against plain prefill.

Modes (name[:receivers][@repeats] on ``--modes``):

    A    plain prefill, no extraction (the reference)
    B    vLLM's ExampleHiddenStatesConnector writing one safetensors file per request to
         ``--storage`` (/dev/shm), and a reader *process* (8 threads) that loads every file with
         vLLM's ``load_hidden_states`` while ``generate()`` runs, checks it and deletes it
    B8   as B with C8's layer ids: what 8 layers cost vLLM's own extraction and file path
    C    our connector (teacher/connector/plugin.py) streaming to student-side receiver process(es)
         (``distill.transport.Subscriber``) on this host, ``transport.shm=auto`` (shared memory)
    C4   as C with ``pinned_buffers: 4`` (the old default: most copies take the synchronous path)
    Csc  as C, serial copies: connector ``copy_threads: 1`` and 1 torch thread per receiver
         (C: the connector's default 4 copy threads, ``--receiver-threads`` per receiver)
    C1   as C with 1 layer id (``--layers1``);  C8: as C with 8 layer ids (``--layers8``)
    D    as C over tcp with ``transport.shm=off``; ``D:4`` spreads the load over 4 receivers
         (4 tcp connections, the publisher hands each sample to one student by credit)
    Dr   as D as a student on another host sees it: the teacher on its defaults (``shm=auto``:
         its ring exists, samples are copied from the device straight into ring slots) and the
         receivers with ``shm=off`` (they cannot map it): every frame goes over tcp out of the
         slot, no host copy on the teacher;  D8r: the same with C8's layers
    Cx, C8x, Dx   as C, C8, D with ``transport.checksum: xxh3`` (one xxh3-64 pass over every
         byte on the connector's sender thread)
    Ct, C8t, Dt   as C, C8, D with ``transport.checksum: xxh3-tree`` given explicitly (the
         default: 4 MiB leaves, each hashed by the copy thread that wrote it out of pinned memory)
    Cn, C8n, Dn   as C, C8, D with ``transport.checksum: none``
    Cp, C8p, Dp   as C, C8, D with ``pinned_buffers: 64`` (the default, given explicitly)
    Ch, C8h, Dh   as C, C8, D with ``pinned_buffers: 32`` (half the default)
    Ck, C8k, Dk   as C, C8, D with ``copy_threads: 8`` (twice the default)
    Cb, C8b, Db   as Co, C8o, Do with ``pinned_background: true`` (the pool's new pinned buffers
         made off the engine thread)
    Cg, C8g, Dg   as C, C8, D with ``pinned_bytes`` 4 GiB given explicitly (the default: one block
         pinned while the engine starts, each sample's copy a range of its size out of it)
    Cr, C8r  as C, C8 with ``ring_staging: false``: each sample through a pinned staging buffer and
         a host copy into its ring slot (C: copied from the device straight into the page-locked
         ring slot)
    Co, C8o, Do   as C, C8, D with ``pinned_bytes: 0`` (the growing pool of ``pinned_buffers``
         buffers, each pinned on the engine thread when no idle one is large enough)
    Drc, D8rc  as Dr, D8r with ``transport.connections: 4`` on each receiver and
         ``transport.io_threads: 4`` on the teacher (given explicitly: the default on 16 cores)
    D8   as D with C8's layers (shared memory off on both sides)
    Cl, C8l, Dl, D8l, Drl, D8rl  as C, C8, D, D8, Dr, D8r with one lane: ``transport.connections:
         1`` on each receiver and ``transport.io_threads: 1`` on the teacher (unset, both are a
         quarter of the host's cores, 1 to 4)
    Cs, C8s, Ds, Drs, D8rs  as C, C8, D, Dr, D8r with a 1 GiB ring (``transport.shm_bytes``; the
         default is 2 GiB)
    Cw, C8w, Dw, D8w, D8lw, D8rlw, C_fp8w, C_loss_maskw  as C, C8, D, D8, D8l, D8rl, C_fp8,
         C_loss_mask with ``sender_threads: 4`` (four threads place samples: a spool write does not
         hold the samples behind it)
    Dc, D8c  as D, and D with C8's layers, with ``transport.chunk_bytes`` 1 MiB (tensors in 1 MiB
         frames, joined by the receiver: the default with CURVE)
    C_fp8 as C with ``hidden_dtype: fp8`` (float8 e4m3 + per-token scales on the wire; the
         receivers get bf16 back from ``Subscriber.get``); Ct_fp8 the same with xxh3-tree
    C_loss_mask  as C with ``capture: loss_mask`` and a chat-like loss mask: each request's
         kv_transfer_params carry ``loss_spans`` [[prompt_len // 2, prompt_len]] (the second half
         is the "assistant" answer), so each sample holds the states of half its tokens
    C_pieces  as C with ``staging_bytes`` 16 MiB, below one sample: every sample is copied off
         the cache in pieces by the sender thread (the long-prompt path, teacher/connector/staging.py)
    T    our transport alone, no vLLM: Publisher -> Subscriber(s) of samples of the same size
         (``--prompt-len`` x layers x hidden bf16), over shm and over tcp

Every received sample is checked: hidden_states shape [prompt_len, num_layers, hidden] (C_loss_mask:
the second half's rows, and ``positions`` naming them) and dtype bf16, token_ids equal to the prompt that produced it, the sample key (ours) naming that prompt,
and layer ids; the receiver copies the hidden states once (as a student moving them to its GPU
would), so B and C both read every byte.

Timing: a warm-up ``generate()`` first (its samples are received and checked too), then
``--repeats`` timed passes over the same prompts; per pass ``generate_tok_s`` (prompt tokens /
generate() wall time) and ``e2e_tok_s`` (until the last sample of the pass was received and
checked). Medians over the passes are reported.

The model: Qwen3-8B's architecture with random weights (``load_format="dummy"``; the config.json
is written into --model-dir), no tokenizer (``skip_tokenizer_init``, prompts are token ids).

Every mode runs on the defaults except what its line above names; each mode's effective
connector settings (checksum included) are in its record and in the summary's ``settings``, and
the connector's own account of where its time went (``connector``: the engine thread's
synchronous copies and waits, the sender thread's seconds) is read from the engine's log.

Example (GPU host, vLLM importable; no --modes: A, B, C, C8, D, C_fp8, C_loss_mask):
    python3 benchmarks/gpu_teacher.py --num-prompts 1024 --prompt-len 1024 --repeats 1 \\
        --commit $(git rev-parse --short HEAD) --out-dir /tmp/gpu_teacher
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import queue
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from distill.config import TransportConfig  # noqa: E402  (the transport's own defaults: modes ...d)

QWEN3_8B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# name -> (kind, layer set, shm setting, connector settings); receivers and repeats come from the
# mode string.
MODES = {
    "A": ("plain", None, None, {}),
    "B": ("file", "layers", None, {}),
    "B8": ("file", "layers8", None, {}),  # vLLM's file path with C8's layers: its own cost of 8 layers
    "C": ("ours", "layers", "auto", {}),
    "C4": ("ours", "layers", "auto", {"pinned_buffers": 4}),  # the first run's default
    "Csc": ("ours", "layers", "auto", {"copy_threads": 1, "receiver_threads": 1}),  # serial copies
    "C1": ("ours", "layers1", "auto", {}),
    "C8": ("ours", "layers8", "auto", {}),
    "D": ("ours", "layers", "off", {}),
    "T": ("transport", "layers", None, {}),
}
for _n, _c in (("x", "xxh3"), ("n", "none"), ("t", "xxh3-tree")):  # the same, another digest
    for _m in ("C", "C8", "D"):
        _kind, _layers, _shm, _extra = MODES[_m]
        MODES[_m + _n] = (_kind, _layers, _shm, {**_extra, "transport": {"checksum": _c}})
_KNOBS = (
    ("p", {"pinned_buffers": 64}),
    ("h", {"pinned_buffers": 32}),
    ("k", {"copy_threads": 8}),
    ("b", {"pinned_bytes": 0, "pinned_background": True}),  # the pool, new buffers made off the engine thread
    ("g", {"pinned_bytes": 4 << 30}),  # one 4 GiB block pinned at engine start (the default), explicitly
    ("o", {"pinned_bytes": 0}),  # the growing pool instead of the block
    ("r", {"ring_staging": False}),  # pinned staging and a host copy into the ring (not straight in)
)
for _n, _extra in _KNOBS:  # the sender's knobs
    for _m in ("C", "C8", "D"):
        _kind, _layers, _shm, _base = MODES[_m]
        MODES[_m + _n] = (_kind, _layers, _shm, {**_base, **_extra})
# the teacher's ring on (its default), the receivers not mapping it: a student on another host
_REMOTE = {"receiver_transport": {"shm": "off"}}
MODES["Dr"] = ("ours", "layers", "auto", _REMOTE)
MODES["D8r"] = ("ours", "layers8", "auto", _REMOTE)
# as Dr, D8r with 4 connections per receiver and 4 I/O threads on the teacher (what unset gives on
# 16 cores, explicitly)
_LANES = {"receiver_transport": {"shm": "off", "connections": 4}, "transport": {"io_threads": 4}}
MODES["Drc"] = ("ours", "layers", "auto", _LANES)
MODES["D8rc"] = ("ours", "layers8", "auto", _LANES)
# the transport's own defaults for the ring, the publisher's memory bound and the credit window
# (teacher and receivers): what every mode runs on unless --shm-bytes, ... are given
_LIB_TRANSPORT = {
    k: TransportConfig.model_fields[k].default for k in ("shm_bytes", "max_buffer_bytes", "credit_samples")
}
for _m in ("C", "C8", "D", "Dr", "D8r"):  # the ring of 1 GiB (the default until 2 GiB), side by side
    assert _m + "s" not in MODES, _m + "s"  # (a mode of that name defined above would be replaced)
    _kind, _layers, _shm, _base = MODES[_m]
    MODES[_m + "s"] = (
        _kind,
        _layers,
        _shm,
        {**_base, "transport": {**_base.get("transport", {}), "shm_bytes": 1 << 30}},
    )
MODES["D8"] = ("ours", "layers8", "off", {})
for _m in ("C", "C8", "D", "D8", "Dr", "D8r"):  # one connection per receiver, one teacher I/O thread
    _kind, _layers, _shm, _base = MODES[_m]
    MODES[_m + "l"] = (
        _kind,
        _layers,
        _shm,
        {
            **_base,
            "transport": {**_base.get("transport", {}), "io_threads": 1},
            "receiver_transport": {**_base.get("receiver_transport", {}), "connections": 1},
        },
    )
MODES["Dc"] = ("ours", "layers", "off", {"transport": {"chunk_bytes": 1 << 20}})
MODES["D8c"] = ("ours", "layers8", "off", {"transport": {"chunk_bytes": 1 << 20}})
MODES["C_fp8"] = ("ours", "layers", "auto", {"hidden_dtype": "fp8"})  # teacher.hidden_dtype: fp8
MODES["Ct_fp8"] = ("ours", "layers", "auto", {"hidden_dtype": "fp8", "transport": {"checksum": "xxh3-tree"}})
# teacher.staging_bytes below one sample (32 MiB at 4 layers): every sample in pieces (teacher/connector/staging.py)
MODES["C_pieces"] = ("ours", "layers", "auto", {"staging_bytes": 16 << 20})
# teacher.capture: loss_mask with half of every prompt masked (chat_mask: the benchmark's own flag)
MODES["C_loss_mask"] = ("ours", "layers", "auto", {"capture": "loss_mask", "chat_mask": True})
for _m in ("C", "C8", "D", "D8", "D8l", "D8rl", "C_fp8", "C_loss_mask"):  # teacher.sender_threads: 4
    _kind, _layers, _shm, _base = MODES[_m]
    MODES[_m + "w"] = (_kind, _layers, _shm, {**_base, "sender_threads": 4})
DEFAULT_MODES = "A,B,C,C8,D,C_fp8,C_loss_mask"


def chat_spans(prompt_len: int) -> list[list[int]]:
    """C_loss_mask's loss spans: the second half of the prompt is trained (a chat answer)."""
    return [[prompt_len // 2, prompt_len]]


def log(*a):
    print(f"[gpu_teacher {time.strftime('%H:%M:%S')}]", *a, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", default=DEFAULT_MODES, help="comma-separated mode[:receivers][@repeats]")
    p.add_argument("--commit", default=None, help="the commit measured (recorded in RESULT_JSON)")
    p.add_argument("--model-dir", default="/tmp/qwen3-8b-dummy", help="config.json written here if missing")
    p.add_argument("--tiny", action="store_true", help="a tiny Qwen3 config instead (harness smoke test)")
    p.add_argument("--num-prompts", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--warmup-prompts", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2, help="timed generate() passes per engine (median)")
    p.add_argument("--layers", default="2,18,33,36", help="layer ids of B, C, D, T")
    p.add_argument("--layers1", default="36", help="layer ids of C1")
    p.add_argument("--layers8", default="2,7,12,18,23,28,33,36", help="layer ids of C8")
    p.add_argument("--storage", default="/dev/shm/gpu_teacher_hs", help="B: file folder")
    p.add_argument("--spool-dir", default="/dev/shm/gpu_teacher_spool", help="C/D: our spool folder")
    p.add_argument("--port", type=int, default=5601, help="C/D/T: first tcp port")
    p.add_argument(
        "--shm-bytes", type=int, default=None, help="C/T: our shared-memory ring size (unset: the default)"
    )
    p.add_argument(
        "--max-buffer-bytes",
        type=int,
        default=None,
        help="C/D/T: publisher memory bound (unset: the default)",
    )
    p.add_argument("--credit-samples", type=int, default=None, help="receivers' credit (unset: the default)")
    p.add_argument("--connector-class", default="DistillHiddenStatesConnector")
    p.add_argument("--connector-module", default="teacher.connector")
    p.add_argument("--key-param", default="sample_key", help="kv_transfer_params key carrying the sample key")
    p.add_argument("--connector-extra", default="{}", help="JSON merged into our kv_connector_extra_config")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-cudagraph-capture-size", type=int, default=32)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--reader-threads", type=int, default=8, help="B: threads of the reader process")
    p.add_argument(
        "--receiver-threads", type=int, default=4, help="C/D/T: torch threads of each receiver (its copy)"
    )
    p.add_argument("--transport-samples", type=int, default=256, help="T: samples per case")
    p.add_argument("--phase-timeout", type=float, default=240.0, help="most seconds to wait for samples")
    p.add_argument("--step-timeout", type=int, default=420, help="most seconds per mode process")
    p.add_argument(
        "--total-budget-s",
        type=int,
        default=900,
        help="the orchestrator cuts the running mode past this, and starts a mode only if the"
        " time left covers the longest mode so far (60 s before the first); the seven default"
        " modes took 752 s on a fresh H100 host (vLLM compiling), 474 s with its compile cache warm",
    )
    p.add_argument("--out-dir", default="/tmp/gpu_teacher", help="per-mode JSON and logs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-one", default=None, help=argparse.SUPPRESS)  # child: run this mode
    args = p.parse_args(argv)
    for k, v in _LIB_TRANSPORT.items():  # unset: the transport's own default
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def parse_mode(text: str, default_repeats: int):
    name, repeats, receivers = text.strip(), default_repeats, 1
    if "@" in name:
        name, r = name.split("@", 1)
        repeats = int(r)
    if ":" in name:
        name, n = name.split(":", 1)
        receivers = int(n)
    if name not in MODES:
        raise SystemExit(f"unknown mode {name!r}; known: {', '.join(MODES)}")
    return name, receivers, repeats


def time_needed(mode: str, walls: list[tuple[str, float]]) -> float:
    """Seconds to reserve for `mode` before starting it (a mode cut half-way gives no ratio):
    15% over the last finished mode of the same kind and layer set (its compiled graphs are then
    cached), else the longest mode so far (a new layer set or kind compiles again); at least 60.
    `walls`: (mode, wall seconds) of the modes run so far, in order."""
    kind_layers = MODES[parse_mode(mode, 1)[0]][:2]
    same = [w for m, w in walls if MODES[parse_mode(m, 1)[0]][:2] == kind_layers]
    return max(60.0, 1.15 * same[-1] if same else max([0.0, *(w for _, w in walls)]))


def layer_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def model_config(args) -> dict:
    cfg = dict(QWEN3_8B_CONFIG)
    if args.tiny:
        cfg.update(
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            max_window_layers=4,
            vocab_size=4096,
        )
    path = os.path.join(args.model_dir, "config.json")
    if not os.path.exists(path):
        os.makedirs(args.model_dir, exist_ok=True)
        with open(path, "w") as f:
            json.dump(cfg, f, indent=2)
    from teacher.config import model_config

    return model_config(args.model_dir)


def make_prompts(args, vocab: int):
    """Deterministic prompts: (warm-up prompts, timed prompts), lists of token-id lists."""
    import numpy as np

    rng = np.random.default_rng(args.seed)
    hi = min(vocab, 151_000)  # clear of Qwen's special tokens
    lo = 100 if hi > 1000 else 1
    warm = rng.integers(lo, hi, (args.warmup_prompts, args.prompt_len)).tolist()
    timed = rng.integers(lo, hi, (args.num_prompts, args.prompt_len)).tolist()
    return warm, timed


# ----------------------------------------------------------------------------------------------
# Receiver processes (spawned; they never touch CUDA)
# ----------------------------------------------------------------------------------------------


class Checker:
    """Checks one received sample against the prompt that produced it."""

    def __init__(self, args, vocab: int, hidden: int, layers: list[int]):
        import torch

        self.torch = torch
        warm, timed = make_prompts(args, vocab)
        self.warm, self.timed = warm, timed
        self.by_head = {tuple(p[:16]): (None, p) for p in warm + timed}
        self.layers = list(layers)
        # C_loss_mask: the sample holds the rows of its loss spans only, named by `positions`
        spans = chat_spans(args.prompt_len) if getattr(args, "chat_mask", False) else [[0, args.prompt_len]]
        self.positions = [i for a, b in spans for i in range(a, b)]
        self.shape = (len(self.positions), len(layers), hidden)
        self.partial = len(self.positions) < args.prompt_len

    def expected(self, key, ids):
        """(key, prompt) the sample should match. Keys: w-<i> warm-up, p<pass>-<i> timed prompt i,
        t-<i> transport-only (warm-up prompt i mod n); no key (vLLM's files): found by the ids."""
        if key:
            head, _, idx = key.partition("-")
            try:
                if head == "w":
                    return key, self.warm[int(idx)]
                if head.startswith("p"):
                    return key, self.timed[int(idx)]
                if head == "t":
                    return key, self.warm[int(idx) % len(self.warm)]
            except (ValueError, IndexError):
                return None, None
        return self.by_head.get(tuple(ids[:16].tolist()), (None, None))

    def check(self, hs, ids, key=None, layers=None, positions=None, scale=None) -> dict:
        torch = self.torch
        k, prompt = self.expected(key, ids)
        copy = hs.clone()  # read every byte once, as a student moving it to its GPU would
        # fp8 (teacher.hidden_dtype: fp8): the student uploads the float8 bytes and their scales
        # and dequantizes on its GPU, so this receiver keeps them as they came (dequantize=False)
        fp8_ok = (
            hs.dtype == torch.float8_e4m3fn
            and scale is not None
            and tuple(scale.shape) == tuple(hs.shape[:2])
        )
        held = positions.tolist() if positions is not None else None
        r = {
            "shape": tuple(hs.shape) == self.shape
            and (held == self.positions if self.partial else positions is None),
            "dtype": hs.dtype == torch.bfloat16 or fp8_ok,
            "ids": prompt is not None
            and ids.numel() == len(prompt)
            and bool(torch.equal(ids.to(torch.long), torch.tensor(prompt, dtype=torch.long))),
            "key": key is None or k == key,
            "layers": layers is None or list(layers) == self.layers,
            "nbytes": hs.numel() * hs.element_size()
            + ids.numel() * ids.element_size()
            + (scale.numel() * scale.element_size() if scale is not None else 0),
        }
        del copy
        return r


def _report(res_q, idx, r):
    res_q.put(
        (
            "s",
            idx,
            time.monotonic(),
            r["nbytes"],
            all(r[c] for c in ("shape", "dtype", "ids", "key", "layers")),
            {c: r[c] for c in ("shape", "dtype", "ids", "key", "layers")},
        )
    )


def file_reader_main(idx, args, vocab, hidden, layers, ctrl_q, res_q):
    """B's reader process: load every file the engine writes, check it, delete it."""
    import torch

    torch.set_num_threads(1)
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states,
        load_hidden_states,
    )

    chk = Checker(args, vocab, hidden, layers)
    res_q.put(("ready", idx))
    seen: set[str] = set()
    ex = ThreadPoolExecutor(args.reader_threads)
    errors = []

    def read_one(path):
        try:
            data = load_hidden_states(path)
            r = chk.check(data["hidden_states"], data["token_ids"])
            cleanup_hidden_states(path)
            _report(res_q, idx, r)
        except Exception as e:  # reported, never silent
            errors.append(repr(e))
            res_q.put(("err", idx, repr(e)))

    cpu0 = time.process_time()
    while True:
        try:
            msg = ctrl_q.get_nowait()
        except queue.Empty:
            msg = None
        if msg == "stop":
            break
        for n in os.listdir(args.storage):
            if n.endswith(".safetensors") and n not in seen:
                seen.add(n)
                ex.submit(read_one, os.path.join(args.storage, n))
        time.sleep(0.002)
    ex.shutdown(wait=True)
    res_q.put(
        (
            "stats",
            idx,
            {"files_seen": len(seen), "errors": errors[:5], "cpu_s": round(time.process_time() - cpu0, 2)},
        )
    )


def subscriber_main(idx, args, vocab, hidden, layers, endpoints, shm, ctrl_q, res_q):
    """C/D/T's student-side receiver: every sample is checked, copied once and acked."""
    import torch

    torch.set_num_threads(args.receiver_threads)  # the copy below is split over these
    sys.path.insert(0, REPO)
    from distill.config import TransportConfig
    from distill.transport import Subscriber

    chk = Checker(args, vocab, hidden, layers)
    # the receivers' own settings (Dr: shm off, a student on another host) over the mode's shm
    own = {"shm": shm, **getattr(args, "receiver_transport", {})}
    cfg = TransportConfig(connect=endpoints, credit_samples=args.credit_samples, **own)
    sub = Subscriber(cfg, dequantize=False)  # fp8 stays fp8, as in a student (dequantized on its GPU)
    sub.start()
    res_q.put(("ready", idx))
    cpu0 = time.process_time()
    errors = []
    busy = 0.0  # seconds checking (one copy of every byte) and acking: this receiver's own work
    while True:
        try:
            if ctrl_q.get_nowait() == "stop":
                break
        except queue.Empty:
            pass
        try:
            s = sub.get(timeout=0.05)
        except Exception as e:
            errors.append(repr(e))
            res_q.put(("err", idx, repr(e)))
            time.sleep(0.05)
            continue
        if s is None:
            continue
        t_got = time.monotonic()
        try:
            r = chk.check(
                s.tensors["hidden_states"],
                s.tensors["token_ids"],
                s.key,
                s.layers,
                s.positions,
                s.tensors.get("hidden_scale"),
            )
            _report(res_q, idx, r)
        except Exception as e:
            errors.append(repr(e))
            res_q.put(("err", idx, repr(e)))
        sub.ack(s)
        busy += time.monotonic() - t_got
    st = {}
    try:
        st = dict(sub.stats())
    finally:
        sub.close()
    st.update(errors=errors[:5], cpu_s=round(time.process_time() - cpu0, 2), busy_s=round(busy, 3))
    res_q.put(("stats", idx, st))


class Receivers:
    """Starts receiver processes and gathers what they report."""

    def __init__(self, ctx, n, target, targs):
        self.res_q = ctx.Queue()
        self.ctrls = [ctx.Queue() for _ in range(n)]
        self.procs = [
            ctx.Process(target=target, args=(i, *targs, self.ctrls[i], self.res_q), daemon=True)
            for i in range(n)
        ]
        self.samples = []  # (t, nbytes, ok, detail)
        self.errors = []
        self.stats = {}
        self.ready = set()
        self.cv = threading.Condition()
        for p in self.procs:
            p.start()
        self._t = threading.Thread(target=self._pump, daemon=True)
        self._t.start()

    def _pump(self):
        while True:
            try:
                m = self.res_q.get(timeout=0.5)
            except queue.Empty:
                if not any(p.is_alive() for p in self.procs):
                    return
                continue
            except (EOFError, OSError):
                return
            with self.cv:
                if m[0] == "s":
                    self.samples.append((m[2], m[3], m[4], m[5], m[1]))
                elif m[0] == "ready":
                    self.ready.add(m[1])
                elif m[0] == "err":
                    self.errors.append(m[2])
                elif m[0] == "stats":
                    self.stats[m[1]] = m[2]
                self.cv.notify_all()

    def wait_ready(self, timeout):
        with self.cv:
            return self.cv.wait_for(lambda: len(self.ready) == len(self.procs), timeout)

    def wait_count(self, n, timeout):
        with self.cv:
            self.cv.wait_for(lambda: len(self.samples) >= n, timeout)
            return len(self.samples)

    def window(self, start, end):
        with self.cv:
            part = self.samples[start:end]
        return {
            "samples": len(part),
            "ok": sum(1 for s in part if s[2]),
            "bytes": sum(s[1] for s in part),
            "t_last": max((s[0] for s in part), default=None),
            "per_receiver": {str(i): sum(1 for s in part if s[4] == i) for i in range(len(self.procs))},
            "failed": [s[3] for s in part if not s[2]][:3],
        }

    def stop(self, timeout=30):
        for q in self.ctrls:
            q.put("stop")
        with self.cv:
            self.cv.wait_for(lambda: len(self.stats) == len(self.procs), timeout)
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.terminate()
        return {str(k): v for k, v in sorted(self.stats.items())}


# ----------------------------------------------------------------------------------------------
# CPU accounting: which threads were busy during a timed pass (to say what bounds a mode)
# ----------------------------------------------------------------------------------------------


def cpu_snapshot():
    import psutil

    snap = {}
    me = psutil.Process(os.getpid())
    for pr in [me, *me.children(recursive=True)]:
        try:
            pname = pr.name()
            for th in pr.threads():
                try:
                    with open(f"/proc/{pr.pid}/task/{th.id}/comm") as f:
                        tname = f.read().strip()
                except OSError:
                    tname = "?"
                snap[(pr.pid, th.id)] = (f"{pname}:{pr.pid}/{tname}", th.user_time + th.system_time)
        except (psutil.Error, OSError):
            continue
    return snap


def cpu_delta(a, b, wall, top=8):
    rows = []
    per_proc: dict[str, float] = {}
    for k, (name, t1) in b.items():
        d = t1 - a.get(k, (name, 0.0))[1]
        rows.append((d, name))
        pn = name.split("/")[0]
        per_proc[pn] = per_proc.get(pn, 0.0) + d
    rows.sort(reverse=True)
    return {
        "top_threads_core_frac": [[n, round(d / wall, 2)] for d, n in rows[:top] if d > 0],
        "per_process_cores": {
            k: round(v / wall, 2) for k, v in sorted(per_proc.items(), key=lambda x: -x[1]) if v > 0.01 * wall
        },
    }


# ----------------------------------------------------------------------------------------------
# One mode, in its own process
# ----------------------------------------------------------------------------------------------


def our_connector_extra(args, shm, endpoint, mode_extra):
    """kv_connector_extra_config for our connector (teacher/connector/plugin.py)."""
    extra = {
        "transport": {
            "bind": [endpoint],
            "shm": shm,
            "shm_bytes": args.shm_bytes,
            "max_buffer_bytes": args.max_buffer_bytes,
            "credit_samples": args.credit_samples,
        },
        "spool": {"dir": args.spool_dir},
    }
    for more in (mode_extra, json.loads(args.connector_extra)):
        for k, v in more.items():
            if isinstance(v, dict) and isinstance(extra.get(k), dict):
                extra[k] = {**extra[k], **v}
            else:
                extra[k] = v
    return extra


def effective_settings(kind, extra) -> dict:
    """What a reader needs to see of a mode's configuration: every data-path setting in effect
    (defaults included), so the checksum that was on is never a guess."""
    if kind != "ours":
        return {"connector": "ExampleHiddenStatesConnector"} if kind == "file" else {}
    sys.path.insert(0, REPO)
    from teacher.config import ConnectorConfig

    cc = ConnectorConfig.from_extra(extra)
    t = cc.transport
    return {
        "checksum": t.checksum,
        "chunk_bytes": t.wire_chunk_bytes,
        "shm": t.shm,
        "shm_bytes": t.shm_bytes,
        "max_buffer_bytes": t.max_buffer_bytes,
        "credit_samples": t.credit_samples,
        "credit_bytes": t.credit_bytes,
        "io_threads": t.io_threads,
        "copy_threads": cc.copy_threads,
        "sender_threads": cc.sender_threads,
        "pinned_buffers": cc.pinned_buffers,
        "pinned_background": cc.pinned_background,
        "pinned_bytes": cc.pinned_bytes,
        "ring_staging": cc.ring_staging,
        "queue_samples": cc.queue_samples,
        "hidden_dtype": cc.hidden_dtype,
        "capture": cc.capture,
        "staging_bytes": cc.staging_bytes,
    }


_CONNECTOR_LOG = {
    "placed": re.compile(r"distill: samples placed: (\{.*?\}); pinned staging buffers: (\d+)"),
    "pinned_block": re.compile(r"distill: pinned block: (\d+) bytes, at most (\d+) bytes out at once"),
    "timing": re.compile(r"distill: connector timing: (\{.*?\})"),
    "publisher": re.compile(r"distill: publisher closed: (\{.*\})"),
    "cuda_allocator": re.compile(r"distill: cuda allocator: (\{.*?\})"),
    # the same counters from the first engine step on (vLLM's start-up and graph capture left out)
    "cuda_allocator_run": re.compile(r"distill: cuda allocator since the first step: (\{.*?\})"),
}


def connector_report(log_path) -> dict:
    """The connector's shutdown lines from a mode's log (its own account of where time went)."""
    out = {}
    try:
        with open(log_path, errors="replace") as f:
            text = f.read()
    except OSError:
        return out
    for name, rx in _CONNECTOR_LOG.items():
        found = list(rx.finditer(text))
        if not found:
            continue
        m = found[-1]  # the last one (the timed engine's shutdown)
        try:
            out[name] = ast.literal_eval(m.group(1))
        except (ValueError, SyntaxError):
            out[name] = m.group(1)[:400]
        if name == "placed":
            out["pinned_buffers_allocated"] = int(m.group(2))  # the block: most ranges out at once
        if name == "pinned_block":
            out[name] = {"bytes": int(m.group(1)), "peak_bytes": int(m.group(2))}
    pub = out.get("publisher")
    if isinstance(pub, dict):  # the figures that say whether the ring or memory ran out
        keep = ("sent", "bytes_sent", "acked", "spooled", "shm_samples", "shm_full", "spool_full_waits")
        keep += ("sessions_peak", "chunked")
        out["publisher"] = {k: pub[k] for k in keep if k in pub}
    return out


def run_transport_only(args, hf, res):
    """T: Publisher -> Subscriber(s) of teacher-sized samples, no vLLM and no GPU."""
    import multiprocessing as mp

    import torch

    sys.path.insert(0, REPO)
    from distill.config import SpoolConfig, TransportConfig
    from distill.protocol import Sample
    from distill.transport import Publisher

    layers = layer_list(args.layers)
    hidden = hf["hidden_size"]
    warm, _ = make_prompts(args, hf["vocab_size"])
    ids = [torch.tensor(p, dtype=torch.long) for p in warm]
    hs = torch.randn(args.prompt_len, len(layers), hidden).to(torch.bfloat16)
    ctx = mp.get_context("spawn")
    cases = res.setdefault("transport", [])
    n = args.transport_samples
    port = args.port + 50
    for shm, nrecv in (("auto", 1), ("off", 1), ("off", 4)):
        port += 1
        ep = f"tcp://127.0.0.1:{port}"
        case = {
            "shm": shm,
            "receivers": nrecv,
            "samples": n,
            "sample_bytes": hs.numel() * 2 + ids[0].numel() * 8,
        }
        spool = os.path.join(args.spool_dir, f"t{port}")
        pub = None
        rx = None
        try:
            pub = Publisher(
                TransportConfig(
                    bind=[ep],
                    shm=shm,
                    shm_bytes=args.shm_bytes,
                    max_buffer_bytes=args.max_buffer_bytes,
                    credit_samples=args.credit_samples,
                ),
                SpoolConfig(dir=spool),
            )
            pub.start()
            rx = Receivers(ctx, nrecv, subscriber_main, (args, hf["vocab_size"], hidden, layers, [ep], shm))
            rx.wait_ready(60)
            t_w = time.monotonic()
            while pub.stats().get("students", 0) < nrecv and time.monotonic() - t_w < 30:
                time.sleep(0.01)
            case["students_seen"] = pub.stats().get("students")
            snap0 = cpu_snapshot()
            t0 = time.monotonic()
            where = {"stream": 0, "spool": 0}
            for i in range(n):
                # keep the publisher's buffer below its bound so nothing spools (we measure the wire)
                while pub.stats().get("buffered_bytes", 0) > args.max_buffer_bytes // 2:
                    time.sleep(0.0005)
                w = pub.submit(
                    Sample(
                        key=f"t-{i}",
                        tensors={"hidden_states": hs, "token_ids": ids[i % len(ids)]},
                        layers=layers,
                        meta={},
                    )
                )
                where["stream" if str(w).startswith("stream:") else "spool"] += 1
            t_sub = time.monotonic()
            got = rx.wait_count(n, args.phase_timeout)
            t1 = time.monotonic()
            win = rx.window(0, n)
            wall = (win["t_last"] or t1) - t0
            case.update(
                where=where,
                received=got,
                ok=win["ok"],
                per_receiver=win["per_receiver"],
                submit_s=round(t_sub - t0, 3),
                wall_s=round(wall, 3),
                gb_per_s=round(win["bytes"] / 1e9 / wall, 3) if wall > 0 else None,
                samples_per_s=round(got / wall, 1) if wall > 0 else None,
                cpu=cpu_delta(snap0, cpu_snapshot(), max(wall, 1e-6)),
                failed=win["failed"],
            )
            pub.close_input()
            case["wait_done"] = bool(pub.wait_done(timeout=30))
            case["publisher_stats"] = dict(pub.stats())
            log(f"T shm={shm} receivers={nrecv}: {got}/{n} ok={win['ok']} {case['gb_per_s']} GB/s")
        except Exception as e:
            import traceback

            traceback.print_exc()
            case["error"] = repr(e)
        finally:
            if rx is not None:
                case["receiver_stats"] = rx.stop()
                case["receiver_errors"] = rx.errors[:5]
            if pub is not None:
                try:
                    pub.close()
                except Exception as e:
                    case["close_error"] = repr(e)
            shutil.rmtree(spool, ignore_errors=True)
        cases.append(case)


def run_one(args):
    name, receivers, repeats = parse_mode(args.run_one, args.repeats)
    kind, layer_key, shm, mode_extra = MODES[name]
    mode_extra = dict(mode_extra)
    args.receiver_threads = mode_extra.pop("receiver_threads", args.receiver_threads)
    args.chat_mask = mode_extra.pop("chat_mask", False)
    args.receiver_transport = mode_extra.pop("receiver_transport", {})  # Dr, Drc: the receivers' own
    receiver_shm = args.receiver_transport.get("shm", shm)  # Dr: receivers that cannot map the ring
    args.credit_samples = mode_extra.get("transport", {}).get("credit_samples", args.credit_samples)
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    hf = model_config(args)
    hidden = hf["hidden_size"]
    layers = layer_list(getattr(args, layer_key)) if layer_key else []
    res = {
        "mode": args.run_one,
        "name": name,
        "kind": kind,
        "settings": effective_settings(
            kind, our_connector_extra(args, shm, f"tcp://127.0.0.1:{args.port}", mode_extra)
        )
        | (
            {
                f"receiver_{k}": v
                for k, v in {
                    "shm": receiver_shm,
                    # the receivers' connections as they take them (unset: by this host's cores)
                    "connections": TransportConfig(**args.receiver_transport).connections,
                    **args.receiver_transport,
                }.items()
            }
            if kind == "ours"
            else {}
        ),
        "layers": layers,
        "receivers": receivers,
        "shm": shm,
        "receiver_shm": receiver_shm,
        "receiver_threads": args.receiver_threads if kind in ("ours", "transport") else None,
        "repeats": repeats,
        "num_prompts": args.num_prompts,
        "prompt_len": args.prompt_len,
    }
    t_start = time.monotonic()
    if kind == "transport":
        run_transport_only(args, hf, res)
        res["total_wall_s"] = round(time.monotonic() - t_start, 1)
        return res

    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    rx = None
    endpoint = f"tcp://127.0.0.1:{args.port}"
    if kind == "file":
        shutil.rmtree(args.storage, ignore_errors=True)
        os.makedirs(args.storage, exist_ok=True)
        rx = Receivers(ctx, 1, file_reader_main, (args, hf["vocab_size"], hidden, layers))
    elif kind == "ours":
        shutil.rmtree(args.spool_dir, ignore_errors=True)
        rx = Receivers(
            ctx,
            receivers,
            subscriber_main,
            (args, hf["vocab_size"], hidden, layers, [endpoint], receiver_shm),
        )

    import torch
    import vllm
    from vllm import LLM, SamplingParams

    sys.path.insert(0, REPO)
    from teacher.config import extraction_engine_args

    res["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__}
    kw = dict(
        model=args.model_dir,
        load_format="dummy",
        dtype="bfloat16",
        skip_tokenizer_init=True,
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tensor_parallel_size,
        seed=args.seed,
    )
    if args.max_cudagraph_capture_size and not args.enforce_eager:
        kw["max_cudagraph_capture_size"] = args.max_cudagraph_capture_size
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if kind == "file":
        kw.update(
            extraction_engine_args(
                layers,
                {"shared_storage_path": args.storage, "num_writer_threads": 8},
                connector="ExampleHiddenStatesConnector",
                module=None,
            )
        )
    elif kind == "ours":
        kw.update(
            extraction_engine_args(
                layers,
                our_connector_extra(args, shm, endpoint, mode_extra),
                connector=args.connector_class,
                module=args.connector_module,
            )
        )
    res["llm_kwargs"] = kw
    log("LLM(", json.dumps(kw), ")")
    t0 = time.monotonic()
    llm = LLM(**kw)
    res["engine_init_s"] = round(time.monotonic() - t0, 1)
    log(f"engine ready in {res['engine_init_s']} s")
    try:  # whether the engine launches step N+1 while N runs (the connector's hooks then overlap it)
        res["async_scheduling"] = bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling)
    except AttributeError:
        res["async_scheduling"] = None
    try:
        res["gpu"] = torch.cuda.get_device_name(0)
    except Exception:
        res["gpu"] = None
    if rx is not None and not rx.wait_ready(120):
        res["error"] = "receivers not ready"
        log(res["error"])

    warm, timed = make_prompts(args, hf["vocab_size"])

    def batch(prompts, prefix):
        ps = [{"prompt_token_ids": p} for p in prompts]
        spans = {"loss_spans": chat_spans(args.prompt_len)} if args.chat_mask else {}
        if kind == "ours":  # the sample key travels in the request's kv_transfer_params
            sps = [
                SamplingParams(
                    max_tokens=1,
                    temperature=0.0,
                    detokenize=False,
                    extra_args={"kv_transfer_params": {args.key_param: f"{prefix}-{i}", **spans}},
                )
                for i in range(len(prompts))
            ]
        else:
            sps = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        return ps, sps

    def where(outs):
        c = {}
        for o in outs:
            ktp = o.kv_transfer_params or {}
            if kind == "file":
                w = "file" if ktp.get("hidden_states_path") else "none"
            else:  # ours: "destination" is stream | spool (the Publisher may still spool a sample)
                w = str(ktp.get("destination", "none"))
            c[w] = c.get(w, 0) + 1
        return c

    received = 0

    def one_pass(prompts, prefix):
        nonlocal received
        ps, sps = batch(prompts, prefix)
        snap0 = cpu_snapshot()
        t_a = time.monotonic()
        outs = llm.generate(ps, sps, use_tqdm=False)
        t_b = time.monotonic()
        tokens = len(prompts) * args.prompt_len
        r = {
            "prompts": len(prompts),
            "generate_s": round(t_b - t_a, 3),
            "generate_tok_s": round(tokens / (t_b - t_a), 1),
        }
        if rx is not None:
            r["where"] = where(outs)
            if prefix != "w" and outs and outs[0].kv_transfer_params:
                r["kv_transfer_params_example"] = outs[0].kv_transfer_params
            got = rx.wait_count(received + len(prompts), args.phase_timeout)
            win = rx.window(received, received + len(prompts))
            received = got
            t_c = win["t_last"] or time.monotonic()
            e2e = max(t_c, t_b) - t_a
            r.update(
                received=win["samples"],
                ok=win["ok"],
                # monotonic clock (one per host, shared by every process): where the time after
                # generate() went (`tail` in the summary: the sender's last placement vs this)
                t_generate_end=round(t_b, 4),
                t_last_received=round(t_c, 4),
                e2e_s=round(e2e, 3),
                e2e_tok_s=round(tokens / e2e, 1),
                hs_gb=round(win["bytes"] / 1e9, 3),
                hs_gb_per_s=round(win["bytes"] / 1e9 / e2e, 3),
                per_receiver=win["per_receiver"],
                failed=win["failed"],
            )
            if win["samples"] < len(prompts):
                r["missing"] = len(prompts) - win["samples"]
            if kind == "ours":  # samples the Publisher spooled instead of streaming (left on disk)
                r["spool_files_after"] = sum(
                    1 for _, _, fs in os.walk(args.spool_dir) for f in fs if f.endswith(".safetensors")
                )
        r["cpu"] = cpu_delta(snap0, cpu_snapshot(), max(t_b - t_a, 1e-6))
        return r

    try:
        if args.warmup_prompts:
            w = one_pass(warm, "w")
            res["warmup"] = w
            log("warm-up:", json.dumps(w))
        res["passes"] = []
        for i in range(repeats):
            p = one_pass(timed, f"p{i}")  # keys unique per pass: students skip keys seen before
            res["passes"].append(p)
            log(f"pass {i + 1}:", json.dumps({k: v for k, v in p.items() if k != "cpu"}))
            if p.get("missing"):
                break
    except Exception as e:
        import traceback

        traceback.print_exc()
        res["error"] = repr(e)
    if rx is not None:
        res["receiver_stats"] = rx.stop()
        res["receiver_errors"] = rx.errors[:5]
    gens = [p["generate_tok_s"] for p in res.get("passes", [])]
    e2es = [p["e2e_tok_s"] for p in res.get("passes", []) if "e2e_tok_s" in p]
    if gens:
        res["generate_tok_s_median"] = round(statistics.median(gens), 1)
    if e2es:
        res["e2e_tok_s_median"] = round(statistics.median(e2es), 1)
    if rx is not None:
        n_exp = args.warmup_prompts + args.num_prompts * len(res.get("passes", []))
        n_ok = res.get("warmup", {}).get("ok", 0) + sum(p.get("ok", 0) for p in res.get("passes", []))
        res["all_checks_ok"] = bool(gens) and n_ok == n_exp and len(rx.samples) == n_exp
        res["samples_checked"] = n_ok
    res["total_wall_s"] = round(time.monotonic() - t_start, 1)
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as e:
        log("shutdown:", repr(e))
    return res


# ----------------------------------------------------------------------------------------------
def collect_results(out_dir: str, commit: str | None) -> dict:
    """Every mode record in `out_dir`, by mode name (also from an earlier command on the same host,
    so a table can be run over several calls). With `commit` set, a record of another commit (or
    of none) is left out and said in one line: a stale folder never mixes into the summary."""
    results = {}
    for n in sorted(os.listdir(out_dir)):
        if n.endswith(".json") and n != "summary.json":
            with open(os.path.join(out_dir, n)) as f:
                r = json.load(f)
            if commit is not None and r.get("commit") != commit:
                log(f"{n} left out of the summary: commit {r.get('commit')}, not {commit}")
                continue
            name = r.get("name") or parse_mode(r.get("mode", n[:-5]), 1)[0]
            rcv = r.get("receivers") or 1
            results[name + (f":{rcv}" if rcv > 1 else "")] = r
    return results


# Orchestrator: every mode in a fresh process, then one summary
# ----------------------------------------------------------------------------------------------


def _tail(r: dict) -> dict:
    """Where the last timed pass's time after generate() went, each relative to its end (negative:
    before it): the engine thread queued the last sample for the sender (`queued_s`; the
    connector's `last_queued_t`), the sender had its rows off the device (`on_host_s`), placed it
    (`sender_s`; `last_placed_t`), and the receivers had checked the last one (`receivers_s`). A
    sender_s close to receivers_s: the sender was behind; a small sender_s: the receivers were."""
    passes = r.get("passes") or []
    if not passes or "t_generate_end" not in passes[-1]:
        return {}
    p = passes[-1]
    out = {"receivers_s": round(p["t_last_received"] - p["t_generate_end"], 3)}
    timing = ((r.get("connector") or {}).get("timing")) or {}
    if not isinstance(timing, dict):
        return out
    for key, name in (
        ("last_queued_t", "queued_s"),
        ("last_on_host_t", "on_host_s"),
        ("last_placed_t", "sender_s"),
    ):
        if timing.get(key):
            out[name] = round(timing[key] - p["t_generate_end"], 3)
    return out


def summarize(results: dict, args) -> dict:
    a = results.get("A", {}).get("generate_tok_s_median")
    out = {
        "machine": None,
        "gpu": None,
        "commit": args.commit,
        "workload": f"{args.num_prompts} prompts x {args.prompt_len} tokens",
        "e2e_over_A": {},
        "generate_over_A": {},
        "settings": {m: r.get("settings") for m, r in results.items()},
        "modes": {},
        "ratios_vs_A": {},
    }
    for mode, r in results.items():
        out["machine"] = out["machine"] or r.get("gpu")
        m = {
            k: r.get(k)
            for k in (
                "layers",
                "receivers",
                "shm",
                "generate_tok_s_median",
                "e2e_tok_s_median",
                "all_checks_ok",
                "samples_checked",
                "engine_init_s",
                "async_scheduling",
                "error",
                "settings",
                "connector",
            )
            if r.get(k) is not None
        }
        m["generate_tok_s"] = [p["generate_tok_s"] for p in r.get("passes", [])]
        if any("e2e_tok_s" in p for p in r.get("passes", [])):
            m["e2e_tok_s"] = [p.get("e2e_tok_s") for p in r.get("passes", [])]
            m["hs_gb_per_s"] = [p.get("hs_gb_per_s") for p in r.get("passes", [])]
            m["where"] = [p.get("where") for p in r.get("passes", [])]
        if "transport" in r:
            m["transport"] = [
                {
                    k: c.get(k)
                    for k in (
                        "shm",
                        "receivers",
                        "gb_per_s",
                        "samples_per_s",
                        "received",
                        "ok",
                        "where",
                        "error",
                    )
                }
                for c in r["transport"]
            ]
        tail = _tail(r)
        if tail:
            m["tail"] = tail
        rs = r.get("receiver_stats") or {}
        if rs:
            m["receivers_busy_s"] = {k: v.get("busy_s") for k, v in rs.items() if isinstance(v, dict)}
        out["modes"][mode] = m
        if a and mode != "A":
            rat = {}
            if r.get("generate_tok_s_median"):
                rat["generate"] = round(r["generate_tok_s_median"] / a, 3)
            if r.get("e2e_tok_s_median"):
                rat["e2e"] = round(r["e2e_tok_s_median"] / a, 3)
            if rat:
                out["ratios_vs_A"][mode] = rat
            if "e2e" in rat:
                out["e2e_over_A"][mode] = rat["e2e"]
            if "generate" in rat:
                out["generate_over_A"][mode] = rat["generate"]
    out["gpu"] = out["machine"]
    return out


def orchestrate(args, argv):
    os.makedirs(args.out_dir, exist_ok=True)
    env = dict(os.environ)
    env.update(
        VLLM_USE_FLASHINFER_SAMPLER="0",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    # vLLM's worker processes must import teacher.connector: put the repository on their path
    env["PYTHONPATH"] = REPO + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        parse_mode(m, args.repeats)  # fail early on a typo
    t_begin = time.monotonic()
    current = {}

    def on_signal(signum, frame):  # never leave a mode's process group behind
        if current.get("pid"):
            try:
                os.killpg(current["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
        raise SystemExit(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    walls: list[tuple[str, float]] = []  # (mode, wall seconds) of each mode run so far
    for m in modes:
        tag = m.replace(":", "x").replace("@", "r")
        left = args.total_budget_s - (time.monotonic() - t_begin)
        need = time_needed(m, walls)  # a mode cut half-way gives no ratio: start only what can end
        if left - 15 < need:  # (15 s: the margin kept below for stopping a mode and its report)
            log(f"=== mode {m} skipped: {left:.0f} s left of --total-budget-s, it needs about {need:.0f}")
            continue
        js, lg = os.path.join(args.out_dir, f"{tag}.json"), os.path.join(args.out_dir, f"{tag}.log")
        t0 = time.monotonic()
        log(f"=== mode {m}")
        with open(lg, "w") as f:
            p = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), *argv, "--run-one", m],
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
            current["pid"] = p.pid
            try:
                rc = p.wait(min(args.step_timeout, left - 15))
            except subprocess.TimeoutExpired:
                rc = "timeout"
            for sig in (signal.SIGTERM, signal.SIGKILL):  # whatever the mode left behind
                try:
                    os.killpg(p.pid, sig)
                    time.sleep(2)
                except ProcessLookupError:
                    break
            current["pid"] = None
        res = None
        with open(lg) as f:
            for line in f:
                if line.startswith("RESULT_JSON "):
                    res = json.loads(line[len("RESULT_JSON ") :])
        if res is None:
            with open(lg) as f:
                tail = f.readlines()[-40:]
            nm, rcv, _ = parse_mode(m, 1)
            res = {
                "mode": m,
                "name": nm,
                "receivers": rcv,
                "error": f"no result (rc={rc})",
                "log_tail": [t.rstrip()[:400] for t in tail],
            }
        res["rc"] = rc
        rep = connector_report(lg)
        if rep:
            res["connector"] = rep
        res["step_wall_s"] = round(time.monotonic() - t0, 1)
        res["commit"] = args.commit
        walls.append((m, res["step_wall_s"]))
        with open(js, "w") as f:
            json.dump(res, f, indent=1)
        brief = {
            k: res.get(k)
            for k in (
                "generate_tok_s_median",
                "e2e_tok_s_median",
                "all_checks_ok",
                "engine_init_s",
                "error",
                "step_wall_s",
            )
        }
        log(f"mode {m} rc={rc}: {json.dumps(brief)}")
        if res.get("log_tail"):
            print("\n".join(res["log_tail"][-25:]), flush=True)
        for d in (args.storage, args.spool_dir):
            shutil.rmtree(d, ignore_errors=True)
    results = collect_results(args.out_dir, args.commit)
    summary = summarize(results, args)
    with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
        json.dump({"summary": summary, "results": results}, f, indent=1)
    print("RESULT_JSON " + json.dumps(summary), flush=True)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.run_one:
        res = run_one(args)
        print("RESULT_JSON " + json.dumps(res), flush=True)
        return
    orchestrate(args, argv)


if __name__ == "__main__":
    main()

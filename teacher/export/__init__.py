"""`distill-export --format speculators|specforge --spool DIR --out DIR [--teacher MODEL_DIR]`

Turns a spool folder (one safetensors file per sample in vLLM's layout, distill/spool.py) into the
on-disk layout that an EAGLE-3 trainer reads as its own offline data. This module is the CLI, the
argument checks and the shared reading/checking of the spool files; the layouts and their writers
are teacher/export/speculators.py (speculators 0.9.0: a `datasets` folder, hs_{row}.safetensors
hard links, token_freq.pt) and teacher/export/specforge.py (SpecForge 0.2.0: .ckpt files with the
post-norm last layer, and a run file); teacher/export/plan.py reads the teacher folder (layer
count, hidden size, final RMSNorm) and picks the layers.

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
from safetensors import SafetensorError

from distill.errors import SpoolChecksumError
from distill.protocol import Sample
from distill.spool import list_spool, read_spool_file
from teacher.errors import ExportError
from teacher.export.plan import (
    FinalNorm,
    LayerPlan,
    TeacherInfo,
    eagle3_layer_ids,
    load_final_norm,
    plan_layers,
    teacher_info,
)
from teacher.export.specforge import SPECFORGE_GROUP, SPECFORGE_RUN, SpecForgeWriter, specforge_yaml
from teacher.export.speculators import (
    ARROW_BATCH,
    DEFAULT_DRAFT_VOCAB,
    SpeculatorsWriter,
    speculators_command,
)

__all__ = [
    "ARROW_BATCH",
    "DEFAULT_DRAFT_VOCAB",
    "FORMATS",
    "KEYS_FILE",
    "MANIFEST",
    "SPECFORGE_GROUP",
    "SPECFORGE_RUN",
    "ExportError",
    "ExportResult",
    "FinalNorm",
    "LayerPlan",
    "TeacherInfo",
    "eagle3_layer_ids",
    "export",
    "load_final_norm",
    "main",
    "plan_layers",
    "teacher_info",
    "trainer_flags",
]

FORMATS = ("speculators", "specforge")
MANIFEST = "distill_export.json"
KEYS_FILE = "keys.txt"


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


@dataclass
class _Source:
    """The checked spool: its files, the first one read, the layer plan and the tensors' shape."""

    spool: Path
    files: list[Path]
    first: Sample
    plan: LayerPlan
    hidden: int
    dtype: torch.dtype
    info: TeacherInfo | None
    norm: FinalNorm | None


@dataclass
class _Tally:
    """What the conversion loop counted."""

    keys: list[str] = field(default_factory=list)
    token_freq: Counter = field(default_factory=Counter)
    tokens: int = 0
    masked: int = 0
    no_mask: int = 0
    unsupervised: int = 0
    nbytes: int = 0


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


def _check_args(fmt: str, spool: Path, out: Path, teacher: str | None) -> list[Path]:
    """The arguments that need no spool file read: --spool, --out, and --teacher's need."""
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
    return files


def _open_source(
    fmt: str,
    spool: Path,
    out: Path,
    teacher: str | None,
    aux_layers: list[int] | None,
    layer_ids: list[int] | None,
) -> _Source:
    """Check the arguments, the teacher and the first spool file; plan the layers."""
    files = _check_args(fmt, spool, out, teacher)
    info = teacher_info(teacher) if teacher else None
    norm = load_final_norm(info) if fmt == "specforge" else None

    first = _read(files[0])
    _whole(files[0], first)
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
    return _Source(spool, files, first, plan, hidden, dtype, info, norm)


def _whole(path: Path, s: Sample) -> None:
    """Refuse a sample that holds some positions only (teacher.capture: loss_mask): both layouts
    train an EAGLE-3 draft, which attends to every earlier position's states (the prompt's too)."""
    if s.positions is not None:
        raise ExportError(
            f"{path} holds the states of {s.positions.shape[0]} of its {s.num_tokens} tokens "
            "(teacher.capture: loss_mask); draft training data needs every position's: export the "
            "spool of a teacher run with teacher.capture: all"
        )


def _checked_tensors(src: _Source, path: Path, s: Sample) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One spool file's hidden states and token ids checked against the first file's; the token
    ids (int64) and its loss mask (None when the file has none)."""
    _whole(path, s)
    layers = src.plan.layers
    hs = s.tensors["hidden_states"]
    ids = s.tensors.get("token_ids")
    file_layers = list(s.layers) if s.layers else layers
    if file_layers != layers:
        raise ExportError(
            f"mixed layers: {path} holds layers {file_layers}, {src.files[0]} holds {layers}: "
            "export one teacher run's spool at a time"
        )
    if hs.dim() != 3 or hs.shape[1] != len(layers) or hs.shape[2] != src.hidden or hs.dtype != src.dtype:
        raise ExportError(
            f"{path}: hidden_states {list(hs.shape)} {hs.dtype} does not match the other files' "
            f"[num_tokens, {len(layers)}, {src.hidden}] {src.dtype}"
        )
    if ids is None or ids.dim() != 1 or ids.shape[0] != hs.shape[0]:
        raise ExportError(f"{path}: token_ids missing or not [{hs.shape[0]}] (one per hidden state)")
    return ids.to(torch.long), s.tensors.get("loss_mask")


def _loss_mask(path: Path, ids: torch.Tensor, mask: torch.Tensor | None, tally: _Tally) -> torch.Tensor:
    """The file's loss mask as int64 0/1 (all ones, counted, for a file without one)."""
    if mask is None:
        tally.no_mask += 1
        return torch.ones(ids.shape[0], dtype=torch.long)
    if mask.dim() != 1 or mask.shape[0] != ids.shape[0]:
        raise ExportError(f"{path}: loss_mask {list(mask.shape)} is not [{ids.shape[0]}]")
    return (mask != 0).to(torch.long)


def _convert(src: _Source, writer, tally: _Tally, log, progress_every_s: float, t0: float) -> None:
    """Read, check and write every spool file (all-zero masks left out), with progress lines."""
    files = src.files
    last_report = time.monotonic()
    for i, path in enumerate(files):
        s = src.first if i == 0 else _read(path)
        ids, mask = _checked_tensors(src, path, s)
        mask = _loss_mask(path, ids, mask, tally)
        n_masked = int(mask.sum())
        if n_masked == 0:
            tally.unsupervised += 1
            continue
        row = len(tally.keys)
        writer.add(row, path, s, ids, mask)
        tally.keys.append(s.key)
        uniq, counts = ids[mask.bool()].unique(return_counts=True)
        tally.token_freq.update(dict(zip(uniq.tolist(), counts.tolist(), strict=True)))
        tally.tokens += int(ids.numel())
        tally.masked += n_masked
        hs = s.tensors["hidden_states"]
        tally.nbytes += hs.numel() * hs.element_size()
        now = time.monotonic()
        if now - last_report >= progress_every_s:
            last_report = now
            rate = (i + 1) / max(now - t0, 1e-9)
            log(
                f"{i + 1}/{len(files)} samples, {_fmt_bytes(tally.nbytes)} of hidden states, "
                f"{rate:.0f} samples/s, about {(len(files) - i - 1) / rate:.0f} s left"
            )
    if not tally.keys:
        raise ExportError(
            f"every one of the {len(files)} samples has an all-zero loss_mask: nothing to train on"
        )


def _manifest(fmt: str, src: _Source, teacher: str | None, tally: _Tally, writer, flags: str) -> dict:
    plan = src.plan
    return {
        "format": fmt,
        "spool": str(src.spool.resolve()),
        "teacher": str(Path(teacher).resolve()) if teacher else None,
        "layers": plan.layers,
        "aux_layers": plan.aux,
        "last_layer": plan.last,
        "hidden_size": src.hidden,
        "dtype": str(src.dtype).replace("torch.", ""),
        "samples": len(tally.keys),
        "tokens": tally.tokens,
        "loss_tokens": tally.masked,
        "loss_mask": "from the spool"
        if not tally.no_mask
        else f"all ones for {tally.no_mask} file(s) without one",
        "skipped_all_zero_loss_mask": tally.unsupervised,
        "rows": f"row i is line i of {KEYS_FILE}",
        "written": writer.summary(),
        "trainer": flags,
    }


def _work_dir(out: Path) -> Path:
    """The sibling folder the export is built in (renamed to `out` at the end)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    work.chmod(0o777 & ~umask)  # mkdtemp makes it 0700; --out is an ordinary folder
    return work


def _after_notes(log, fmt: str, src: _Source, tally: _Tally) -> None:
    """The warning about files without a loss mask, and SpecForge's need of an index json."""
    info = src.info
    if tally.no_mask:
        log(
            f"warning: {tally.no_mask} of {len(src.files)} spool files carry no loss_mask "
            "(written before the teacher sent one): exported with a mask of all ones, so the trainer also trains on prompt tokens"
        )
    if fmt == "specforge" and info and not list(Path(info.path).glob("*.safetensors.index.json")):
        log(
            f"note: SpecForge 0.2.0 loads the teacher's lm_head only through a *.safetensors.index.json "
            f"(specforge/modeling/target/target_head.py) and {info.path} has none: add one "
            '({"weight_map": {"lm_head.weight": "model.safetensors", ...}}) before training'
        )


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
    out = Path(out)
    src = _open_source(fmt, Path(spool), out, teacher, aux_layers, layer_ids)
    plan, info = src.plan, src.info
    work = _work_dir(out)
    writer = None
    tally = _Tally()
    try:  # from here on a failure (the writer's own start included) leaves no .partial- folder
        writer = (
            SpeculatorsWriter(work, plan) if fmt == "speculators" else SpecForgeWriter(work, plan, src.norm)
        )
        _convert(src, writer, tally, log, progress_every_s, t0)
        writer.finish(tally.token_freq)
        (work / KEYS_FILE).write_text("".join(f"{k}\n" for k in tally.keys))
        flags = trainer_flags(fmt, out, plan, info, draft_vocab_size)
        if fmt == "specforge":
            (work / SPECFORGE_RUN).write_text(specforge_yaml(out, plan, info))
        manifest = _manifest(fmt, src, teacher, tally, writer, flags)
        (work / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(work, out)
    except BaseException:
        if writer is not None:
            writer.abort()
        shutil.rmtree(work, ignore_errors=True)
        raise
    _after_notes(log, fmt, src, tally)
    return ExportResult(
        out=out,
        fmt=fmt,
        plan=plan,
        samples=len(tally.keys),
        tokens=tally.tokens,
        masked_tokens=tally.masked,
        no_mask_files=tally.no_mask,
        skipped_unsupervised=tally.unsupervised,
        detail=writer.summary(),
        flags=flags,
        seconds=time.monotonic() - t0,
    )


# ---------------------------------------------------------------------------------------------
# What to run next
# ---------------------------------------------------------------------------------------------


def trainer_flags(
    fmt: str, out: Path, plan: LayerPlan, info: TeacherInfo | None, draft_vocab_size: int | None
) -> str:
    """The command line that trains an EAGLE-3 draft on the export, for `fmt`'s trainer."""
    if fmt == "speculators":
        return speculators_command(out, plan, info, draft_vocab_size)
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
    print("train with (on CUDA GPUs: the trainer needs one):")
    print(f"  {r.flags}")
    return 0

"""`distill-export`'s checks of the teacher and the layers: the teacher folder's facts (layer count,
hidden size, final RMSNorm) and which spool layers are EAGLE-3's three aux layers and the last.

Layer ids are vLLM's (0 = embeddings, k = output of decoder layer k-1, n = last layer, pre-norm).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from distill.config import eagle3_layer_ids
from distill.errors import ConfigError
from teacher.errors import ExportError

# The final norm's weight in common checkpoints (text models, then multimodal wrappers).
_NORM_KEYS = (
    "model.norm.weight",
    "model.language_model.norm.weight",
    "language_model.model.norm.weight",
    "model.text_model.norm.weight",
    "transformer.norm.weight",
    "transformer.ln_f.weight",
)


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

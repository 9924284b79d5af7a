"""The student model, its projections, and the teacher's frozen head (final norm + LM head).

`DistillModel` wraps a transformers causal LM and one linear projection per mapped layer pair, so
one `accelerator.prepare` (one DDP wrapper) covers every trained parameter. Its forward returns the
student's logits and its mapped states, projected to the teacher's width.

The teacher's head is loaded from the teacher checkpoint without building the teacher: the final
norm module's class comes from the architecture (built on the meta device), its weights and the
LM head's are read from the checkpoint's safetensors files. Logits never cross the wire: the
teacher sends its last layer (id L, before the final norm) and the student recomputes
`lm_head(norm(h_L))`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from student import packing
from student.config import StudentConfig
from student.errors import StudentError

PROJECTIONS_FILE = "distill_projections.safetensors"
PROJECTIONS_META = "distill_projections.json"


def _load_student(cfg: StudentConfig) -> nn.Module:
    """The student causal LM: from a checkpoint folder, or freshly initialised from a config dict."""
    if cfg.model is not None:
        if not Path(cfg.model).is_dir():
            raise StudentError(f"student.model {cfg.model!r} is not a folder (a save_pretrained checkpoint)")
        return AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
    conf = dict(cfg.from_config or {})
    model_type = conf.pop("model_type")
    try:
        config = AutoConfig.for_model(model_type, **conf)
    except (ValueError, KeyError) as e:
        raise StudentError(f"student.from_config: {e}") from None
    torch.manual_seed(cfg.seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def load_student(cfg: StudentConfig) -> nn.Module:
    """The student causal LM (a checkpoint folder or a config dict), its attention set for the
    batch layout: `packing.packed_attention` when `student.batch_layout` is packed."""
    model = _load_student(cfg)
    if cfg.batch_layout == "packed":
        packing.use_packed_attention(model)
    return model


def teacher_config(cfg: StudentConfig) -> PretrainedConfig | None:
    if cfg.teacher_model is None:
        return None
    p = Path(cfg.teacher_model)
    if not (p / "config.json").is_file():
        raise StudentError(f"student.teacher_model {cfg.teacher_model!r} has no config.json")
    return AutoConfig.from_pretrained(cfg.teacher_model)


def decoder_norm(model: nn.Module) -> nn.Module:
    """The final norm of a transformers decoder (`model.model.norm` for Llama/Qwen-style models)."""
    base = getattr(model, "base_model", model)
    for name in ("norm", "final_layernorm", "ln_f"):
        mod = getattr(base, name, None)
        if isinstance(mod, nn.Module):
            return mod
    raise StudentError(
        f"cannot find the final norm of {type(model).__name__}: this architecture is not supported"
    )


def checkpoint_tensors(folder: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """Read the named tensors from a (possibly sharded) safetensors checkpoint; absent names are skipped."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {weight_map[n] for n in names if n in weight_map}
    else:
        files = {"model.safetensors"} if (folder / "model.safetensors").is_file() else set()
    if not files:
        raise StudentError(f"teacher checkpoint {str(folder)!r} has no safetensors weights for {names}")
    out = {}
    for f in files:
        with safe_open(str(folder / f), framework="pt") as fh:
            for n in names:
                if n in fh.keys():  # noqa: SIM118 (safe_open is not a dict)
                    out[n] = fh.get_tensor(n)
    return out


class TeacherHead(nn.Module):
    """Frozen teacher final norm + LM head: teacher logits from the teacher's last layer (pre-norm)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Linear):
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head
        self.requires_grad_(False)

    @classmethod
    def from_checkpoint(cls, folder: str) -> TeacherHead:
        tconf = AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(tconf)
        norm = decoder_norm(skeleton)
        names = {}  # checkpoint tensor name -> (module, parameter name)
        for pname, _ in norm.named_parameters():
            names[_param_name(skeleton, norm, pname)] = (norm, pname)
        head_w = "lm_head.weight"
        if getattr(tconf, "tie_word_embeddings", False):
            head_w = _param_name(skeleton, skeleton.get_input_embeddings(), "weight")
        lm_head = nn.Linear(tconf.hidden_size, tconf.vocab_size, bias=False, device="meta")
        names[head_w] = (lm_head, "weight")
        tensors = checkpoint_tensors(Path(folder), list(names))
        missing = [n for n in names if n not in tensors]
        if missing:
            raise StudentError(f"teacher checkpoint {folder!r} lacks {missing} (needed for the KL term)")
        norm.to_empty(device="cpu")
        lm_head.to_empty(device="cpu")
        for n, (mod, pname) in names.items():
            getattr(mod, pname).data.copy_(tensors[n].float())
        if any(True for _ in norm.buffers()):  # RMSNorm/LayerNorm have none; anything else is unknown
            raise StudentError(
                f"the final norm of {type(skeleton).__name__} has buffers: not supported for KL"
            )
        return cls(norm.float(), lm_head.float())

    @torch.no_grad()
    def forward(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, H_t] teacher last layer (before the final norm) -> [B, T, V] teacher logits."""
        return self.lm_head(self.norm(last_hidden))


def _param_name(root: nn.Module, sub: nn.Module, pname: str) -> str:
    for prefix, mod in root.named_modules():
        if mod is sub:
            return f"{prefix}.{pname}" if prefix else pname
    raise StudentError(f"module {type(sub).__name__} not found in {type(root).__name__}")


class DistillModel(nn.Module):
    """Student LM + one projection per layer pair (identity when widths match and none is forced).

    forward(input_ids [B, T], mask [B, T], segments) -> (logits [B, T, V], [per pair: [B, T, H_t]]).
    Student layer ids follow the teacher's convention: id L_s is the last decoder layer's output
    BEFORE the final norm, captured with a forward pre-hook on the norm (transformers'
    hidden_states[L_s] is after it).
    """

    def __init__(
        self, student: nn.Module, pairs: list[tuple[int, int]], teacher_hidden: int, projection: str
    ):
        super().__init__()
        self.student = student
        scfg = student.config
        self.num_layers = scfg.num_hidden_layers
        self.pairs = pairs  # (student_layer, teacher_layer) per layer_map entry
        for s_layer, _ in pairs:
            if s_layer > self.num_layers:
                raise StudentError(
                    f"layer_map names student layer {s_layer}, the student has ids 0..{self.num_layers}"
                )
        width = scfg.hidden_size
        if projection == "never" and pairs and width != teacher_hidden:
            raise StudentError(
                f"student hidden size {width} != teacher hidden size {teacher_hidden} and "
                "student.projection is 'never': allow projections (projection: auto) or use a student "
                "of the teacher's width"
            )
        use_proj = projection == "always" or (projection == "auto" and width != teacher_hidden)
        # "s{student}_t{teacher}" -> Linear(H_s, H_t); empty when no projection is used.
        self.projections = nn.ModuleDict(
            {f"s{s}_t{t}": nn.Linear(width, teacher_hidden) for s, t in pairs} if use_proj else {}
        )
        self._prenorm: torch.Tensor | None = None  # set by the hook on each forward
        decoder_norm(student).register_forward_pre_hook(self._grab_prenorm)

    def _attention_mask(self, mask: torch.Tensor) -> torch.Tensor | None:
        """None (causal attention alone) with SDPA or eager attention. With right padding a real
        token's causal past holds real tokens only, so the padding mask changes nothing the losses
        read (they skip padding positions), and without it SDPA may use its flash kernel for every
        batch, and transformers does not read the mask on the device to choose (two host
        synchronisations a forward on a GPU). Other attention implementations get the 2D mask."""
        if getattr(self.student.config, "_attn_implementation", None) in ("sdpa", "eager", packing.ATTENTION):
            return None
        return mask.long()

    def _grab_prenorm(self, module, args):
        self._prenorm = args[0]

    def forward(self, input_ids: torch.Tensor, mask: torch.Tensor, segments: packing.Segments | None = None):
        """`mask`: True on real tokens, right padding (as `student.data.Batch` holds it).
        `segments`: a packed row (`Batch.packing`): each sample its own positions and attention."""
        if segments is not None:
            out = self.student(
                input_ids=input_ids,
                position_ids=segments.position_ids,
                output_hidden_states=True,
                distill_packed=segments,
            )
        else:
            out = self.student(
                input_ids=input_ids, attention_mask=self._attention_mask(mask), output_hidden_states=True
            )
        hidden = list(out.hidden_states)
        hidden[self.num_layers] = self._prenorm  # id L_s = before the final norm
        self._prenorm = None
        mapped = []
        for s, t in self.pairs:
            h = hidden[s]
            key = f"s{s}_t{t}"
            mapped.append(self.projections[key](h) if key in self.projections else h)
        return out.logits, mapped

    def save_projections(self, folder: Path) -> None:
        """Write the projections (if any) beside the saved student (distill_projections.safetensors)."""
        meta = {
            "pairs": [list(p) for p in self.pairs],
            "projections": sorted(self.projections),
            "note": "Linear(student_hidden -> teacher_hidden) per layer pair, key s{student}_t{teacher}",
        }
        (folder / PROJECTIONS_META).write_text(json.dumps(meta, indent=1))
        if len(self.projections):
            save_file(
                {k: v.detach().cpu().contiguous() for k, v in self.projections.state_dict().items()},
                str(folder / PROJECTIONS_FILE),
            )

"""What a student trains: the model it builds, the loss of one micro-batch, the files it leaves.

The loop (student/loop.py) calls exactly three things from here: `build_model` once, `compute_loss`
on every micro-batch, `save_model` once at the end. A recipe other than hidden-state distillation
dispatches in these three functions (and the optimizer in `build_optimizer`).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator

from student import eagle3, losses
from student.config import StudentConfig
from student.data import Batch, StudentError
from student.model import DistillModel, TeacherHead, load_student, teacher_config

# every loss term compute_loss can report (recipe eagle3: each TTT step's loss and top-1 agreement)
TERMS = ("mse", "cosine", "nmse", "kl", "ce", *eagle3.TERMS)


def reported_terms(cfg: StudentConfig) -> list[str]:
    """The terms this config's steps record (metrics.json, log lines)."""
    if cfg.recipe == "eagle3":
        return eagle3.reported_terms(cfg)
    return [k for k in ("mse", "cosine", "nmse", "kl", "ce") if getattr(cfg.losses, k) > 0]


@dataclass
class Built:
    """The trained model and what the batches it takes must carry."""

    model: DistillModel  # the student and its projections (one DDP wrapper covers both)
    head: TeacherHead | None  # the teacher's frozen final norm + LM head (for KL), on the device
    layer_ids: list[int]  # teacher layer ids every batch carries
    teacher_hidden: int  # the teacher's hidden size
    teacher_last: (
        int | None
    )  # the teacher's last layer id (before its final norm); None without a teacher_model


def build_model(cfg: StudentConfig, device: torch.device) -> Built:
    """Student, projections and the frozen teacher head; StudentError (one line) on a mismatch."""
    if cfg.recipe == "eagle3":  # the draft; `head`: the teacher's frozen embeddings, norm, LM head
        draft, frozen, layer_ids = eagle3.build_draft(cfg)
        return Built(draft, frozen.to(device), layer_ids, draft.config.target_hidden_size, layer_ids[-1])
    tconf = teacher_config(cfg)
    teacher_hidden = tconf.hidden_size if tconf is not None else cfg.teacher_hidden_size
    teacher_last = tconf.num_hidden_layers if tconf is not None else None
    for p in cfg.layer_map:
        if teacher_last is not None and p.teacher_layer > teacher_last:
            raise StudentError(
                f"layer_map names teacher layer {p.teacher_layer}; the teacher has ids 0..{teacher_last}"
            )
    student = load_student(cfg)
    model = DistillModel(
        student, [(p.student_layer, p.teacher_layer) for p in cfg.layer_map], teacher_hidden, cfg.projection
    )
    head = None
    if cfg.losses.kl > 0:
        head = TeacherHead.from_checkpoint(cfg.teacher_model).to(device)
        if head.lm_head.out_features != student.config.vocab_size:
            raise StudentError(
                f"KL needs one vocabulary: teacher vocab {head.lm_head.out_features}, student "
                f"{student.config.vocab_size}"
            )
    # Teacher layer ids every batch carries: the mapped ones, plus the last one for KL.
    layer_ids = sorted({p.teacher_layer for p in cfg.layer_map} | ({teacher_last} if head else set()))
    return Built(model, head, layer_ids, teacher_hidden, teacher_last)


def compute_loss(model, head: TeacherHead | None, batch: Batch, cfg: StudentConfig, teacher_last: int | None):
    """Weighted sum of the configured loss terms on one micro-batch.

    Hidden-state terms are averaged over layer pairs with the pairs' weights. Teacher states come in
    the dtype the teacher sent (bf16 from a bf16 teacher) and are upcast to fp32 here, on the
    device, per layer used. Returns the loss and a dict of the unweighted terms (detached).
    """
    if cfg.recipe == "eagle3":
        return eagle3.draft_loss(model, head, batch, cfg)
    if batch.lengths is not None:  # a packed host batch (collate): pad it where it is
        batch = batch.to(batch.input_ids.device)
    logits, mapped = model(batch.input_ids, batch.mask)
    w = cfg.losses
    pos = {lid: i for i, lid in enumerate(batch.layer_ids)}  # teacher layer id -> index in batch.teacher
    terms: dict[str, torch.Tensor] = {}
    pair_total = sum(p.weight for p in cfg.layer_map) or 1.0
    lm = batch.loss_mask if cfg.loss_on == "masked" else None  # None: every real token counts
    held = batch.held  # teacher.capture: loss_mask: terms that read the teacher's states count held positions
    lm_t = held if lm is None else (lm if held is None else lm & held)
    for name, fn in (("mse", losses.mse), ("cosine", losses.cosine), ("nmse", losses.nmse)):
        if getattr(w, name) > 0:
            terms[name] = (
                sum(
                    p.weight
                    * fn(
                        h.float(),
                        batch.teacher[:, :, pos[p.teacher_layer]].float(),
                        batch.mask,
                        loss_mask=lm_t,
                    )
                    for p, h in zip(cfg.layer_map, mapped, strict=True)
                )
                / pair_total
            )
    if w.kl > 0:
        teacher_logits = head(batch.teacher[:, :, pos[teacher_last]].float())
        terms["kl"] = losses.kl(logits, teacher_logits, batch.mask, cfg.temperature, loss_mask=lm, held=held)
    if w.ce > 0:
        terms["ce"] = losses.ce(logits, batch.input_ids, batch.mask, loss_mask=lm)
    loss = sum(getattr(w, k) * v for k, v in terms.items())
    return loss, {k: v.detach() for k, v in terms.items()}


def unused_parameters(cfg: StudentConfig, model: DistillModel) -> bool:
    """Whether some trainable parameter can get no gradient (DDP then needs find_unused_parameters).

    The logits (kl, ce) reach every student parameter; without them the final norm, the LM head
    and the layers above the deepest mapped one get none. Projections get one from a hidden-state
    term (mse, cosine, nmse) only."""
    if cfg.recipe == "eagle3":
        return False  # every draft parameter is on the path of every step's loss
    w = cfg.losses
    uses_logits = w.kl > 0 or w.ce > 0
    hidden_terms = w.mse + w.cosine + w.nmse > 0
    return not uses_logits or (len(model.projections) > 0 and not hidden_terms)


def build_optimizer(cfg: StudentConfig, params):
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def save_model(accelerator: Accelerator, model, cfg: StudentConfig, final: Path) -> None:
    """The final student (main process): save_pretrained, its projections, the tokenizer files."""
    unwrapped = accelerator.unwrap_model(model)
    if cfg.recipe == "eagle3":  # vLLM's EAGLE-3 layout (student/eagle3.py, export_draft)
        eagle3.export_draft(unwrapped, final, eagle3.export_dtype(cfg))
        return
    unwrapped.student.save_pretrained(final)
    unwrapped.save_projections(final)
    copy_tokenizer(cfg, final)


def copy_tokenizer(cfg: StudentConfig, dest: Path) -> None:
    """Copy tokenizer files from the student checkpoint, else the teacher's (ids come from it)."""
    for src in (cfg.model, cfg.teacher_model):
        if src is None:
            continue
        files = [
            p
            for p in Path(src).glob("*")
            if p.name.startswith(("tokenizer", "special_tokens", "vocab", "merges"))
        ]
        if files:
            for p in files:
                shutil.copy(p, dest / p.name)
            return

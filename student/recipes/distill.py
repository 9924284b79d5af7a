"""Recipe `distill`: a transformers causal LM trained on the teacher's hidden states and logits.

Loss terms (student.losses, weights in `student.losses`): mse / cosine / nmse between mapped student
layers (through projections when widths differ) and teacher layers, KL to the teacher's logits
(recomputed from its streamed last layer through its frozen final norm and LM head), CE on the
tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate import Accelerator

from student import losses
from student.config import StudentConfig
from student.data import Batch
from student.errors import StudentError
from student.model import DistillModel, TeacherHead, load_student, teacher_config
from student.recipes.base import Built, Recipe, copy_tokenizer

HIDDEN_TERMS = ("mse", "cosine", "nmse")


class Distill(Recipe):
    name = "distill"
    TERMS = (*HIDDEN_TERMS, "kl", "ce")
    partial_positions = True  # hidden terms and KL read held positions only (Batch.held)

    def build(self, cfg: StudentConfig, device: torch.device) -> Built:
        """Student, projections and the frozen teacher head."""
        tconf = teacher_config(cfg)
        teacher_hidden = tconf.hidden_size if tconf is not None else cfg.teacher_hidden_size
        teacher_last = tconf.num_hidden_layers if tconf is not None else None
        for p in cfg.layer_map:
            if teacher_last is not None and p.teacher_layer > teacher_last:
                raise StudentError(
                    f"layer_map names teacher layer {p.teacher_layer}; the teacher has ids 0..{teacher_last}"
                )
        student = load_student(cfg)
        pairs = [(p.student_layer, p.teacher_layer) for p in cfg.layer_map]
        model = DistillModel(student, pairs, teacher_hidden, cfg.projection)
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
        return Built(self, model, head, layer_ids, teacher_hidden, teacher_last)

    def loss(self, model, head, batch: Batch, cfg: StudentConfig, teacher_last: int | None):
        """Weighted sum of the configured loss terms on one micro-batch.

        Hidden-state terms are averaged over layer pairs with the pairs' weights. Teacher states
        come in the dtype the teacher sent (bf16 from a bf16 teacher) and are upcast to fp32 here,
        on the device, per layer used.
        """
        if batch.lengths is not None:  # a packed host batch (collate): pad it where it is
            batch = batch.to(batch.input_ids.device)
        logits, mapped = model(batch.input_ids, batch.mask, batch.packing)
        w = cfg.losses
        pos = {lid: i for i, lid in enumerate(batch.layer_ids)}  # teacher layer id -> index in batch.teacher
        terms: dict[str, torch.Tensor] = {}
        pair_total = sum(p.weight for p in cfg.layer_map) or 1.0
        lm = batch.loss_mask if cfg.loss_on == "masked" else None  # None: every real token counts
        held = (
            batch.held
        )  # teacher.capture: loss_mask: terms reading the teacher's states count held positions
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
            terms["kl"] = losses.kl(
                logits, teacher_logits, batch.mask, cfg.temperature, loss_mask=lm, held=held, ends=batch.ends
            )
        if w.ce > 0:
            terms["ce"] = losses.ce(logits, batch.input_ids, batch.mask, loss_mask=lm, ends=batch.ends)
        loss = sum(getattr(w, k) * v for k, v in terms.items())
        return loss, {k: v.detach() for k, v in terms.items()}

    def reported_terms(self, cfg: StudentConfig) -> list[str]:
        return [k for k in self.TERMS if getattr(cfg.losses, k) > 0]

    def unused_parameters(self, cfg: StudentConfig, model) -> bool:
        """The logits (kl, ce) reach every student parameter; without them the final norm, the LM
        head and the layers above the deepest mapped one get none. Projections get one from a
        hidden-state term (mse, cosine, nmse) only."""
        w = cfg.losses
        uses_logits = w.kl > 0 or w.ce > 0
        hidden_terms = w.mse + w.cosine + w.nmse > 0
        return not uses_logits or (len(model.projections) > 0 and not hidden_terms)

    def save(self, accelerator: Accelerator, model, cfg: StudentConfig, final: Path) -> None:
        """save_pretrained, the projections, the tokenizer files."""
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.student.save_pretrained(final)
        unwrapped.save_projections(final)
        copy_tokenizer(cfg, final)

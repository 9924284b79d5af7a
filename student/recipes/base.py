"""The recipe interface: what the student loop asks of whatever it trains.

A `Recipe` builds the trained model (`build` -> `Built`), computes the loss of one micro-batch
(`loss`), names the terms its steps record (`reported_terms`) and saves the final model (`save`).
`build_optimizer` and `copy_tokenizer` are shared by every recipe.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn

from student.config import StudentConfig
from student.data import Batch


@dataclass
class Built:
    """The trained model and what the batches it takes must carry."""

    recipe: Recipe  # what built it: the loop computes losses and saves through it
    model: nn.Module  # the trained module (one DDP wrapper covers it)
    head: nn.Module | None  # frozen teacher parts on the device (KL's norm + LM head; a draft's)
    layer_ids: list[int]  # teacher layer ids every batch carries
    teacher_hidden: int  # the teacher's hidden size
    teacher_last: int | None  # the teacher's last layer id (before its final norm); None: unknown


class Recipe:
    """One way of training a student from the teacher's samples.

    Attributes:
        name: `student.recipe` in the run file.
        TERMS: every loss term `loss` may report (the metrics vector has a slot for each).
        partial_positions: whether it trains on samples that hold some token positions only
            (`teacher.capture: loss_mask`); when False such a sample is refused in one line.
    """

    name: str = ""
    TERMS: tuple[str, ...] = ()
    partial_positions: bool = True

    def build(self, cfg: StudentConfig, device: torch.device) -> Built:
        """The model, its frozen teacher parts on `device`, and the layers batches must carry;
        StudentError (one line) when the config and the teacher do not fit together."""
        raise NotImplementedError

    def loss(
        self,
        model: nn.Module,
        head: nn.Module | None,
        batch: Batch,
        cfg: StudentConfig,
        teacher_last: int | None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of one micro-batch and its unweighted terms (detached), on the device."""
        raise NotImplementedError

    def reported_terms(self, cfg: StudentConfig) -> list[str]:
        """The terms this config's steps record (metrics.json, log lines)."""
        raise NotImplementedError

    def unused_parameters(self, cfg: StudentConfig, model: nn.Module) -> bool:
        """Whether some trainable parameter can get no gradient (DDP then needs
        find_unused_parameters)."""
        return False

    def save(self, accelerator: Accelerator, model: nn.Module, cfg: StudentConfig, final: Path) -> None:
        """The final model into `final` (main process)."""
        raise NotImplementedError


def build_optimizer(cfg: StudentConfig, params):
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


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


__all__ = ["Built", "Recipe", "build_optimizer", "copy_tokenizer"]

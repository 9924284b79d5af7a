"""Recipe `eagle3`: an EAGLE-3 draft of the teacher (the model, its loss and export: student/eagle3/draft.py).

The draft attends to every earlier position's teacher states, so samples that hold some positions
only (`teacher.capture: loss_mask`) are refused.
"""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate import Accelerator

from student.config import StudentConfig
from student.data import Batch
from student.eagle3 import draft as eagle3
from student.recipes.base import Built, Recipe


class Eagle3(Recipe):
    name = "eagle3"
    TERMS = eagle3.TERMS  # each TTT step's loss and top-1 agreement
    partial_positions = False
    # unused_parameters: the base's False (every draft parameter is on every step's loss path)

    def build(self, cfg: StudentConfig, device: torch.device) -> Built:
        """The draft; `head`: the teacher's frozen embeddings, norm and LM head."""
        draft, frozen, layer_ids = eagle3.build_draft(cfg)
        return Built(
            self, draft, frozen.to(device), layer_ids, draft.config.target_hidden_size, layer_ids[-1]
        )

    def loss(self, model, head, batch: Batch, cfg: StudentConfig, teacher_last: int | None):
        return eagle3.draft_loss(model, head, batch, cfg)

    def reported_terms(self, cfg: StudentConfig) -> list[str]:
        return eagle3.reported_terms(cfg)

    def save(self, accelerator: Accelerator, model, cfg: StudentConfig, final: Path) -> None:
        """vLLM's EAGLE-3 layout (student/eagle3/draft.py, export_draft)."""
        eagle3.export_draft(accelerator.unwrap_model(model), final, eagle3.export_dtype(cfg))

"""`distill-export --format specforge`: the writer of SpecForge's offline EAGLE-3 layout, taken
from the framework's source (the PyPI wheel named below), not from its docs, and its run file:

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

SpecForge's `aux_hidden_state_layer_ids` counts decoder layers from 0 (SGLang captures before layer
i+1), so it is ours (vLLM's layer ids) minus one.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from distill.protocol import Sample
from teacher.export.plan import FinalNorm, LayerPlan, TeacherInfo

SPECFORGE_GROUP = 5000  # files per rows_{a}-{b} folder (as SpecForge's prepare_hidden_states.py)
SPECFORGE_RUN = "specforge_run.yaml"


class SpecForgeWriter:
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


def specforge_yaml(out: Path, plan: LayerPlan, info: TeacherInfo | None) -> str:
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

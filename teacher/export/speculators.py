"""`distill-export --format speculators`: the writer of speculators' offline EAGLE-3 layout, taken
from the framework's source (the PyPI wheel named below), not from its docs:

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
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import save_file

from distill.protocol import Sample
from teacher.export.plan import LayerPlan, TeacherInfo

ARROW_BATCH = 1024  # rows per record batch of the speculators dataset (bounded memory)
DEFAULT_DRAFT_VOCAB = 32000


class SpeculatorsWriter:
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


def speculators_command(
    out: Path, plan: LayerPlan, info: TeacherInfo | None, draft_vocab_size: int | None
) -> str:
    """speculators' command line that trains an EAGLE-3 draft on the export in `out`."""
    verifier = str(Path(info.path).resolve()) if info else "<teacher model folder>"
    vocab = draft_vocab_size or (
        min(DEFAULT_DRAFT_VOCAB, info.vocab_size) if info and info.vocab_size else DEFAULT_DRAFT_VOCAB
    )
    return (
        f"speculators train --speculator-type eagle3 --verifier-name-or-path {verifier} "
        f"--data-path {out.resolve()} --target-layer-ids {' '.join(map(str, plan.aux))} "
        f"--draft-vocab-size {vocab} --on-missing raise"
    )

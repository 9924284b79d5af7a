"""Dataset rows for the teacher: JSONL, Parquet, or a local Hugging Face `datasets` folder.

Rows are read lazily (memory stays flat for any dataset size) and turned into (key, token ids):
a `input_ids` column (pre-tokenized) is used as is; a `text` column is tokenized; a `messages` column ([{"role", "content"}, ...]) goes through
the model's chat template first (with the generation prompt when the last turn is not the
assistant's). Keys come from `key_field`, or are "row-<n>".
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from distill.config import ConfigError
from teacher.config import TeacherConfig


def dataset_format(cfg: TeacherConfig) -> str:
    if cfg.dataset_format != "auto":
        return cfg.dataset_format
    p = Path(cfg.dataset)
    if p.is_dir():
        return "hf"
    if p.suffix == ".parquet":
        return "parquet"
    if p.suffix in (".jsonl", ".json"):
        return "jsonl"
    raise ConfigError(
        f"teacher.dataset: cannot tell the format of {cfg.dataset!r} from its name; "
        "set teacher.dataset_format to jsonl, parquet or hf"
    )


def _jsonl(path: Path) -> Iterator[dict]:
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ConfigError(f"teacher.dataset: {path}:{n} is not valid JSON: {e}") from None
            if not isinstance(row, dict):
                raise ConfigError(f"teacher.dataset: {path}:{n} is not a JSON object")
            yield row


def _parquet(path: Path) -> Iterator[dict]:
    import pyarrow.parquet as pq

    try:
        f = pq.ParquetFile(path)
    except Exception as e:
        raise ConfigError(f"teacher.dataset: {path} is not a readable Parquet file: {e}") from None
    for batch in f.iter_batches(batch_size=256):
        yield from batch.to_pylist()


def _hf_folder(path: Path, split: str) -> Iterator[dict]:
    """A folder from `datasets.Dataset(Dict).save_to_disk`: Arrow stream files listed in state.json."""
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        if split not in splits:
            raise ConfigError(f"teacher.split: {split!r} is not a split of {path} (splits: {splits})")
        path = path / split
    state = path / "state.json"
    if not state.is_file():
        raise ConfigError(
            f"teacher.dataset: {path} is not a Hugging Face datasets folder (no state.json); "
            "write it with Dataset.save_to_disk, or point at a .jsonl / .parquet file"
        )
    try:
        files = [d["filename"] for d in json.loads(state.read_text())["_data_files"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"teacher.dataset: cannot read {state}: {e}") from None
    import pyarrow as pa

    for name in files:
        try:
            reader = pa.ipc.open_stream(str(path / name))
        except Exception as e:
            raise ConfigError(f"teacher.dataset: {path / name} is not an Arrow stream file: {e}") from None
        for batch in reader:
            yield from batch.to_pylist()


def iter_rows(cfg: TeacherConfig) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield (key, row) for the first `max_samples` rows. Raises ConfigError on unreadable input."""
    p = Path(cfg.dataset)
    if not p.exists():
        raise ConfigError(f"teacher.dataset: {cfg.dataset!r} does not exist")
    fmt = dataset_format(cfg)
    try:
        rows = {
            "jsonl": lambda: _jsonl(p),
            "parquet": lambda: _parquet(p),
            "hf": lambda: _hf_folder(p, cfg.split),
        }[fmt]()
    except OSError as e:
        raise ConfigError(f"teacher.dataset: cannot read {cfg.dataset!r}: {e}") from None
    seen: set[str] = set()
    for i, row in enumerate(rows):
        if cfg.max_samples is not None and i >= cfg.max_samples:
            return
        if cfg.key_field is not None and cfg.key_field in row:
            key = str(row[cfg.key_field])
        else:
            key = f"row-{i}"
        if not key or "\n" in key or "\r" in key or "\t" in key or key.startswith("!"):
            raise ConfigError(
                f"teacher.dataset: row {i} has key {key!r}: sample keys may not be empty, contain a "
                "newline or a tab, or start with '!' (the journal holds one key per line)"
            )
        if key in seen:
            raise ConfigError(
                f"teacher.dataset: key {key!r} appears twice (row {i}); sample keys must be unique"
            )
        seen.add(key)
        if not any(f in row for f in (cfg.messages_field, cfg.text_field, cfg.tokens_field)):
            raise ConfigError(
                f"teacher.dataset: row {i} ({key!r}) has neither {cfg.text_field!r} nor "
                f"{cfg.messages_field!r} nor {cfg.tokens_field!r} (columns: {sorted(row)}); "
                "set teacher.text_field / messages_field / tokens_field"
            )
        yield key, row


def check_dataset(cfg: TeacherConfig) -> list[str]:
    """Read the dataset through once (rows only, no tokenizing) so that a bad row, a bad or
    duplicate key or an unreadable file fails before vLLM starts. Returns the keys of the rows
    used, in order (what the run must deliver)."""
    keys = [k for k, _ in iter_rows(cfg)]
    if not keys:
        raise ConfigError(f"teacher.dataset: {cfg.dataset!r} has no rows")
    return keys


class Prompter:
    """Turns dataset rows into prompt token ids with the model's own tokenizer."""

    def __init__(self, cfg: TeacherConfig):
        self.cfg = cfg
        self._tok = None  # loaded on first use: pre-tokenized datasets need no tokenizer

    @property
    def tok(self):
        if self._tok is None:
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(self.cfg.model)
        return self._tok

    def token_ids(self, row: dict[str, Any]) -> list[int]:
        ids = row.get(self.cfg.tokens_field)
        if ids is not None:
            return [int(x) for x in ids]
        msgs = row.get(self.cfg.messages_field)
        if msgs is not None:
            if not getattr(self.tok, "chat_template", None):
                raise ConfigError(
                    f"teacher.model: {self.cfg.model!r} has no chat template, but the dataset has "
                    f"{self.cfg.messages_field!r} rows"
                )
            gen_prompt = bool(msgs) and msgs[-1].get("role") != "assistant"
            text = self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen_prompt)
            return list(self.tok(text, add_special_tokens=False)["input_ids"])
        return list(self.tok(row[self.cfg.text_field])["input_ids"])

"""Dataset rows for the teacher: JSONL, Parquet, or a local Hugging Face `datasets` folder.

Rows are read lazily (memory stays flat for any dataset size) and turned into (key, token ids):
a `input_ids` column (pre-tokenized) is used as is; a `text` column is tokenized; a `messages` column ([{"role", "content"}, ...]) goes through
the model's chat template first (with the generation prompt when the last turn is not the
assistant's). Keys come from `key_field`, or are "row-<n>".
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
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


_NOT_JSON = object()  # marker: a JSONL line that is not a JSON object (the reason follows)


def _jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, row) per non-blank line; a line that is not a JSON object yields
    (line, (_NOT_JSON, reason)) so that a skip policy can go on past it."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                yield n, (_NOT_JSON, f"not valid JSON ({e})")
                continue
            if not isinstance(row, dict):
                yield n, (_NOT_JSON, f"not a JSON object (a JSON {type(row).__name__})")
                continue
            yield n, row


def _parquet(path: Path) -> Iterator[tuple[int, dict]]:
    import pyarrow.parquet as pq

    try:
        f = pq.ParquetFile(path)
    except Exception as e:
        raise ConfigError(f"teacher.dataset: {path} is not a readable Parquet file: {e}") from None
    n = 0
    for batch in f.iter_batches(batch_size=256):
        for row in batch.to_pylist():
            yield n, row
            n += 1


def _hf_folder(path: Path, split: str) -> Iterator[tuple[int, dict]]:
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

    n = 0
    for name in files:
        try:
            reader = pa.ipc.open_stream(str(path / name))
        except Exception as e:
            raise ConfigError(f"teacher.dataset: {path / name} is not an Arrow stream file: {e}") from None
        for batch in reader:
            for row in batch.to_pylist():
                yield n, row
                n += 1


@dataclass
class BadRow:
    """A dataset row that cannot be used; `where` is `<file>:<line>` (JSONL) or `<path> row <n>`."""

    where: str
    key: str | None  # None: no key could be read (invalid JSON, ...)
    reason: str

    def line(self) -> str:
        k = f" ({self.key!r})" if self.key is not None else ""
        return f"{self.where}{k}: {self.reason}"

    def record(self) -> dict[str, Any]:
        return {"key": self.key, "where": self.where, "reason": self.reason}


def model_vocab_size(model: str) -> int | None:
    """vocab_size from the model folder's config.json; None if unknown."""
    from teacher.config import model_config

    try:
        v = model_config(model).get("vocab_size")
    except ConfigError:
        return None
    return v if _is_int(v) and v > 0 else None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def row_problem(cfg: TeacherConfig, row: dict[str, Any], vocab_size: int | None = None) -> str | None:
    """Why this row cannot be turned into a prompt (None: it can). The field used is the first of
    tokens_field, messages_field, text_field that is present and not null (as `Prompter`)."""
    fields = (cfg.tokens_field, cfg.messages_field, cfg.text_field)
    used = next((f for f in fields if row.get(f) is not None), None)
    if used is None:
        nulls = [f for f in fields if f in row]
        if nulls:
            return f"field {nulls[0]!r} is null"
        return (
            f"has neither {cfg.text_field!r} nor {cfg.messages_field!r} nor {cfg.tokens_field!r} "
            f"(columns: {sorted(row)}); set teacher.text_field / messages_field / tokens_field"
        )
    v = row[used]
    if used == cfg.tokens_field:
        if not isinstance(v, list | tuple):
            return f"field {used!r} must be a list of token ids, got {type(v).__name__}"
        if not v:
            return f"field {used!r} is an empty list"
        bad = [x for x in v if not _is_int(x) or x < 0 or (vocab_size is not None and x >= vocab_size)]
        if bad:
            limit = f" < vocab_size {vocab_size}" if vocab_size is not None else ""
            return f"field {used!r} holds invalid token ids {bad[:5]} (must be integers >= 0{limit})"
        return None
    if used == cfg.messages_field:
        if not isinstance(v, list | tuple):
            return f"field {used!r} must be a list of {{role, content}} messages, got {type(v).__name__}"
        if not v:
            return f"field {used!r} is an empty list"
        for j, m in enumerate(v):
            if not isinstance(m, dict):
                return f"message {j} of {used!r} is not an object, got {type(m).__name__}"
            role = m.get("role")
            if not isinstance(role, str) or not role:
                return f"message {j} of {used!r} has no 'role' string"
            content = m.get("content")
            if content is None and not m.get("tool_calls"):
                return f"message {j} of {used!r} has no 'content'"
            if content is not None and not isinstance(content, str | list):
                return f"message {j} of {used!r}: 'content' must be a string, got {type(content).__name__}"
        if not any(isinstance(m.get("content"), str | list) and m.get("content") for m in v):
            return f"field {used!r}: every message is empty"
        return None
    if not isinstance(v, str):
        return f"field {used!r} must be a string, got {type(v).__name__}"
    if not v.strip():
        return f"field {used!r} is empty" if not v else f"field {used!r} is whitespace only"
    return None


def _bad_key(key: str) -> str | None:
    if not key or "\n" in key or "\r" in key or "\t" in key or key.startswith("!"):
        return (
            f"key {key!r}: sample keys may not be empty, contain a newline or a tab, or start with "
            "'!' (the journal holds one key per line)"
        )
    return None


def scan_rows(
    cfg: TeacherConfig, vocab_size: int | None = None
) -> Iterator[tuple[str, dict[str, Any], str] | BadRow]:
    """Every row of the first `max_samples`: (key, row, where) when usable, else a BadRow. Raises
    ConfigError only for an unreadable dataset (missing file, not Parquet, ...)."""
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
    if vocab_size is None:
        vocab_size = model_vocab_size(cfg.model)
    seen: set[str] = set()
    for i, (n, row) in enumerate(rows):
        if cfg.max_samples is not None and i >= cfg.max_samples:
            return
        where = f"{p}:{n}" if fmt == "jsonl" else f"{p} row {n}"
        if isinstance(row, tuple) and row and row[0] is _NOT_JSON:
            yield BadRow(where, None, row[1])
            continue
        if cfg.key_field is not None and row.get(cfg.key_field) is not None:
            key = str(row[cfg.key_field])
        else:
            key = f"row-{i}"
        why = _bad_key(key)
        if why is not None:
            yield BadRow(where, None, why)
            continue
        if key in seen:
            yield BadRow(where, key, f"key {key!r} appears twice; sample keys must be unique")
            continue
        seen.add(key)
        why = row_problem(cfg, row, vocab_size)
        if why is not None:
            yield BadRow(where, key, why)
            continue
        yield key, row, where


def iter_rows(cfg: TeacherConfig) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield (key, row) of the usable rows (bad rows were reported by `check_dataset`)."""
    for item in scan_rows(cfg):
        if not isinstance(item, BadRow):
            yield item[0], item[1]


def check_dataset(
    cfg: TeacherConfig, vocab_size: int | None = None, report=None, length=None
) -> tuple[list[str], list[BadRow]]:
    """Read the dataset through once, before vLLM starts: every row is checked (JSON, key, field
    present and not null, non-empty text, well-formed chat messages, valid token ids). Each bad
    row goes to `report(BadRow)` (one line each). `teacher.on_bad_row: fail` raises ConfigError
    when there is any; `skip` returns them. `length(row)`: when given (on_too_long=fail), every
    usable row's prompt length is checked against max_model_len - max_tokens (ConfigError). Returns (keys of the usable rows in order, bad rows)."""
    keys: list[str] = []
    bad: list[BadRow] = []
    for item in scan_rows(cfg, vocab_size):
        if isinstance(item, BadRow):
            bad.append(item)
            if report is not None:
                report(item)
        else:
            keys.append(item[0])
            if length is not None:
                n, limit = length(item[1]), cfg.max_model_len - cfg.max_tokens
                if n > limit:
                    raise ConfigError(
                        f"teacher.dataset: {item[2]} ({item[0]!r}): {n} prompt tokens > max_model_len - "
                        f"max_tokens = {limit} (teacher.on_too_long=fail; or set it to skip or truncate)"
                    )
    if bad and cfg.on_bad_row == "fail":
        first = bad[0].line()
        more = f" (and {len(bad) - 1} more bad rows)" if len(bad) > 1 else ""
        raise ConfigError(f"teacher.dataset: {first}{more}; fix the rows or set teacher.on_bad_row=skip")
    if not keys:
        raise ConfigError(
            f"teacher.dataset: {cfg.dataset!r} has no rows"
            + (f" that can be used ({len(bad)} bad)" if bad else "")
        )
    return keys, bad


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

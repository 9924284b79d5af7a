"""Dataset rows for the teacher: JSONL, Parquet, or a local Hugging Face `datasets` folder.

Rows are read lazily (memory stays flat for any dataset size) and turned into (key, token ids):
a `input_ids` column (pre-tokenized) is used as is; a `text` column is tokenized; a `messages` column ([{"role", "content"}, ...]) goes through
the model's chat template first (with the generation prompt when the last turn is not the
assistant's). Keys come from `key_field`, or are "row-<n>".
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distill.errors import ConfigError
from teacher.config import TeacherConfig, loads_strict
from teacher.errors import DuplicateField


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


def _utf8_problem(raw: bytes) -> str | None:
    """Why a line is not UTF-8 text (None: it is)."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}: {e.reason})"
    return None


def _lone_surrogate(row: Any) -> bool:
    """A JSON \\udXXX escape without its pair: a string that is no text (it cannot be encoded)."""
    try:
        json.dumps(row, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, row) per non-blank line; a line that is not a JSON object (or not UTF-8 text,
    or an object with a field twice) yields (line, (_NOT_JSON, reason)) so that a skip policy can go
    on past it."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            why = _utf8_problem(raw)
            if why is not None:
                yield n, (_NOT_JSON, why)
                continue
            line = raw.decode("utf-8")
            if not line.strip():
                continue
            try:
                row = loads_strict(line)
            except DuplicateField as e:
                yield n, (_NOT_JSON, str(e))
                continue
            except ValueError as e:
                yield n, (_NOT_JSON, f"not valid JSON ({e})")
                continue
            if not isinstance(row, dict):
                yield n, (_NOT_JSON, f"not a JSON object (a JSON {type(row).__name__})")
                continue
            if "\\u" in line and _lone_surrogate(row):
                yield n, (_NOT_JSON, "not valid UTF-8 (a \\u escape of half a surrogate pair)")
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
    """A folder from `datasets.Dataset(Dict).save_to_disk`, read with `datasets.load_from_disk`
    (memory-mapped Arrow: rows are read in batches, memory stays flat)."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"teacher.dataset: {path} is a folder (a Hugging Face datasets folder), but the `datasets` "
            "package is not installed: pip install datasets (or point at a .jsonl / .parquet file)"
        ) from None
    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError:
        raise ConfigError(
            f"teacher.dataset: {path} is not a Hugging Face datasets folder (no state.json); "
            "write it with Dataset.save_to_disk, or point at a .jsonl / .parquet file"
        ) from None
    except Exception as e:
        raise ConfigError(f"teacher.dataset: cannot read the datasets folder {path}: {e}") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ConfigError(f"teacher.split: {split!r} is not a split of {path} (splits: {list(ds)})")
        ds = ds[split]
    n = 0
    for batch in ds.iter(batch_size=256):
        cols = list(batch)
        for i in range(len(batch[cols[0]]) if cols else 0):
            yield n, {c: batch[c][i] for c in cols}
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
        return _mask_problem(cfg, row, len(v))
    if row.get(cfg.loss_mask_field) is not None:
        return (
            f"field {cfg.loss_mask_field!r} (teacher.loss_mask_field) goes with pre-tokenized rows "
            f"({cfg.tokens_field!r}) only; {used!r} rows get their mask from the tokenizer"
        )
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


def _mask_problem(cfg: TeacherConfig, row: dict[str, Any], num_tokens: int) -> str | None:
    """Why the pre-tokenized row's loss mask column cannot be used (None: absent/null or fine)."""
    m = row.get(cfg.loss_mask_field)
    if m is None:
        return None
    f = cfg.loss_mask_field
    if not isinstance(m, list | tuple):
        return f"field {f!r} must be a list of 0/1 values, got {type(m).__name__}"
    if len(m) != num_tokens:
        return (
            f"field {f!r} has {len(m)} values for {num_tokens} tokens in {cfg.tokens_field!r} (must be equal)"
        )
    bad = [x for x in m if x not in (0, 1) or not isinstance(x, int)]
    if bad:
        return f"field {f!r} holds values {bad[:5]} (must be 0 or 1)"
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
    chat_checked = False
    for item in scan_rows(cfg, vocab_size):
        if isinstance(item, BadRow):
            bad.append(item)
            if report is not None:
                report(item)
        else:
            keys.append(item[0])
            if not chat_checked and _has_assistant_turn(cfg, item[1]):
                # The loss mask of chat rows needs the template's markers or a prefix-stable
                # template: find out on the first such row, before vLLM starts.
                chat_checked = True
                try:
                    Prompter(cfg).encode_mask(item[1])
                except ConfigError as e:
                    raise ConfigError(f"{e} (first found at {item[2]})") from None
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


_GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")


def mask_spans(mask: list[int]) -> list[list[int]]:
    """[start, end) spans of the 1s of a 0/1 list (how a loss mask travels to the connector)."""
    spans: list[list[int]] = []
    start = None
    for i, x in enumerate(mask):
        if x and start is None:
            start = i
        elif not x and start is not None:
            spans.append([start, i])
            start = None
    if start is not None:
        spans.append([start, len(mask)])
    return spans


def spans_mask(spans: list[list[int]], n: int) -> list[int]:
    """The 0/1 list of length `n` with 1 on `spans` (clipped to n); inverse of `mask_spans`."""
    m = [0] * n
    for s, e in spans:
        for i in range(max(s, 0), min(e, n)):
            m[i] = 1
    return m


class Prompter:
    """Turns dataset rows into prompt token ids, and their loss mask, with the model's own tokenizer.

    The loss mask (1 = train on this token) of a prompt:
      * pre-tokenized rows: the `loss_mask_field` column when present, else all ones (all zeros when
        generated tokens are kept: then the generated tokens are the ones to train on);
      * plain text rows: all ones (all zeros when generated tokens are kept);
      * chat rows: 1 on the assistant turns' tokens. A template with `{% generation %}` markers gives
        them (transformers' `return_assistant_tokens_mask`); otherwise each assistant message's
        tokens are the characters that rendering messages[:j+1] adds to rendering messages[:j] with
        the generation prompt (its content and the turn's closing tokens), mapped to tokens by their
        character offsets. A template that does not render a prefix of the conversation as a prefix
        of the whole (e.g. one that drops earlier turns' reasoning) raises ConfigError: use
        generation markers or pre-tokenized rows with a loss mask column.
    Generated tokens (include_output_tokens) are always 1: the connector adds them.
    """

    def __init__(self, cfg: TeacherConfig):
        self.cfg = cfg
        self._tok = None  # loaded on first use: pre-tokenized datasets need no tokenizer
        # Generated tokens are kept: those are what to train on, not a text row's prompt.
        self.generates = bool(cfg.include_output_tokens)
        self.last_spans: list[list[int]] = []  # loss spans of the row token_ids saw last

    @property
    def tok(self):
        if self._tok is None:
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(self.cfg.model)
        return self._tok

    def token_ids(self, row: dict[str, Any]) -> list[int]:
        """The prompt's token ids; its loss mask, as spans, is left in `last_spans` (what the
        request's kv_transfer_params carry as `loss_spans`)."""
        ids, self.last_spans = self.encode(row)
        return ids

    def encode(self, row: dict[str, Any]) -> tuple[list[int], list[list[int]]]:
        """(prompt token ids, loss spans): the loss mask as [start, end) spans over the prompt."""
        ids, mask = self.encode_mask(row)
        return ids, mask_spans(mask)

    def encode_mask(self, row: dict[str, Any]) -> tuple[list[int], list[int]]:
        """(prompt token ids, loss mask over them as a 0/1 list)."""
        default = 0 if self.generates else 1
        ids = row.get(self.cfg.tokens_field)
        if ids is not None:
            ids = [int(x) for x in ids]
            m = row.get(self.cfg.loss_mask_field)
            if m is None:
                return ids, [default] * len(ids)
            if len(m) != len(ids):  # checked before vLLM starts (row_problem); the file changed since
                raise ConfigError(
                    f"teacher.dataset: row {self._key(row)}: {self.cfg.loss_mask_field!r} has {len(m)} "
                    f"values for {len(ids)} tokens"
                )
            return ids, [1 if x else 0 for x in m]
        msgs = row.get(self.cfg.messages_field)
        if msgs is not None:
            return self._chat(row, msgs)
        ids = list(self.tok(row[self.cfg.text_field])["input_ids"])
        return ids, [default] * len(ids)

    def _key(self, row: dict[str, Any]) -> str:
        k = row.get(self.cfg.key_field) if self.cfg.key_field else None
        return repr(str(k)) if k is not None else "(no key)"

    def has_generation_markers(self) -> bool:
        t = getattr(self.tok, "chat_template", None)
        return isinstance(t, str) and _GENERATION_MARK.search(t) is not None

    def _render(self, msgs, gen_prompt: bool) -> str:
        try:
            return self.tok.apply_chat_template(list(msgs), tokenize=False, add_generation_prompt=gen_prompt)
        except Exception as e:  # a template that raises (jinja's raise_exception, a missing field, ...)
            raise ConfigError(
                f"teacher.model: the chat template of {self.cfg.model!r} failed on {len(msgs)} messages: "
                f"{type(e).__name__}: {e}"
            ) from None

    def _chat(self, row, msgs) -> tuple[list[int], list[int]]:
        tok = self.tok
        if not getattr(tok, "chat_template", None):
            raise ConfigError(
                f"teacher.model: {self.cfg.model!r} has no chat template, but the dataset has "
                f"{self.cfg.messages_field!r} rows"
            )
        gen_prompt = bool(msgs) and msgs[-1].get("role") != "assistant"
        if self.has_generation_markers():
            out = tok.apply_chat_template(
                list(msgs),
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=True,
                add_generation_prompt=gen_prompt,
            )
            return list(out["input_ids"]), [1 if x else 0 for x in out["assistant_masks"]]
        text = self._render(msgs, gen_prompt)
        # Character span of each assistant message: what rendering it adds after the prefix that
        # ends with the generation prompt.
        spans: list[tuple[int, int]] = []
        for j, m in enumerate(msgs):
            if m.get("role") != "assistant":
                continue
            before = self._render(msgs[:j], True)
            upto = self._render(msgs[: j + 1], False)
            if not (upto.startswith(before) and text.startswith(upto)):
                raise ConfigError(
                    f"teacher.dataset: row {self._key(row)}: the chat template of {self.cfg.model!r} is not "
                    f"prefix-stable (rendering the first {j + 1} messages is not a prefix of the whole "
                    "conversation), so the assistant tokens cannot be found; give the template "
                    "{% generation %} markers, or use pre-tokenized rows with a "
                    f"{self.cfg.loss_mask_field!r} column"
                )
            spans.append((len(before), len(upto)))
        if getattr(tok, "is_fast", False):
            enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
            ids = list(enc["input_ids"])
            mask = [int(any(s <= a < e for s, e in spans)) for a, _ in enc["offset_mapping"]]
            return ids, mask
        # A slow tokenizer has no offsets: each span's token range is found by tokenizing the
        # prefixes, which must tokenize as prefixes of the whole.
        ids = list(tok(text, add_special_tokens=False)["input_ids"])
        mask = [0] * len(ids)
        for s, e in spans:
            a = tok(text[:s], add_special_tokens=False)["input_ids"]
            b = tok(text[:e], add_special_tokens=False)["input_ids"]
            if ids[: len(b)] != b or b[: len(a)] != a:
                raise ConfigError(
                    f"teacher.dataset: row {self._key(row)}: the tokenizer of {self.cfg.model!r} does not "
                    "tokenize the conversation's prefixes as prefixes (and has no character offsets), so "
                    "the assistant tokens cannot be found; use a fast tokenizer, {% generation %} markers, "
                    f"or pre-tokenized rows with a {self.cfg.loss_mask_field!r} column"
                )
            for i in range(len(a), len(b)):
                mask[i] = 1
        return ids, mask


def _has_assistant_turn(cfg: TeacherConfig, row: dict[str, Any]) -> bool:
    if row.get(cfg.tokens_field) is not None:
        return False
    msgs = row.get(cfg.messages_field)
    return isinstance(msgs, list | tuple) and any(
        isinstance(m, dict) and m.get("role") == "assistant" for m in msgs
    )

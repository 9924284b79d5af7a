"""Dataset formats the teacher reads: JSONL text / chat messages, Parquet, a datasets folder."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from distill.errors import ConfigError
from teacher.config import TeacherConfig, model_num_layers
from teacher.data import Prompter, check_dataset, iter_rows
from testkit.tiny import build_tiny_model, write_tiny_chat_dataset, write_tiny_dataset


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def _cfg(model, dataset, **kw) -> TeacherConfig:
    return TeacherConfig(model=str(model), dataset=str(dataset), layer_ids=[1], **kw)


def test_jsonl_text_keys_and_limit(model, tmp_path):
    ds = write_tiny_dataset(tmp_path / "d.jsonl", 10)
    cfg = _cfg(model, ds, max_samples=4)
    rows = list(iter_rows(cfg))
    assert [k for k, _ in rows] == [f"row-{i:05d}" for i in range(4)]
    assert len(check_dataset(cfg)[0]) == 4
    p = Prompter(cfg)
    assert p.token_ids(rows[0][1]) == p.tok(rows[0][1]["text"])["input_ids"]
    # No key column: the row number.
    assert [k for k, _ in iter_rows(_cfg(model, ds, key_field=None, max_samples=2))] == ["row-0", "row-1"]


def test_chat_messages_use_the_chat_template(model, tmp_path):
    ds = write_tiny_chat_dataset(tmp_path / "c.jsonl", 6)
    cfg = _cfg(model, ds)
    p = Prompter(cfg)
    for _, row in iter_rows(cfg):
        msgs = row["messages"]
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs)
        text += "<|im_start|>assistant\n"  # the last turn is the user's: generation prompt added
        assert p.token_ids(row) == p.tok(text, add_special_tokens=False)["input_ids"]


def test_parquet_and_hf_folder(model, tmp_path):
    rows = [json.loads(x) for x in write_tiny_dataset(tmp_path / "d.jsonl", 7).read_text().splitlines()]
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, tmp_path / "d.parquet")
    assert [r for _, r in iter_rows(_cfg(model, tmp_path / "d.parquet"))] == rows

    # A `datasets.save_to_disk` folder (DatasetDict with a train split), read with load_from_disk.
    import datasets  # a dev dependency (pyproject.toml)

    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "hf"))
    assert [r for _, r in iter_rows(_cfg(model, tmp_path / "hf"))] == rows
    with pytest.raises(ConfigError, match="teacher.split: 'test' is not a split"):
        list(iter_rows(_cfg(model, tmp_path / "hf", split="test")))
    # A single Dataset folder (no splits), and a folder that is not one.
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    assert [r for _, r in iter_rows(_cfg(model, tmp_path / "one"))] == rows
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="is not a Hugging Face datasets folder"):
        list(iter_rows(_cfg(model, tmp_path / "empty")))


def test_unreadable_files_fail(model, tmp_path):
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match="has no rows"):
        check_dataset(_cfg(model, empty))
    with pytest.raises(ConfigError, match="not a readable Parquet file"):
        (tmp_path / "x.parquet").write_text("nope")
        check_dataset(_cfg(model, tmp_path / "x.parquet"))


# Each kind of bad row, and its exact line (after "<file>:<line>").
BAD_ROWS = [
    ('{"id": "e", "text": ""}', "('e'): field 'text' is empty"),
    ('{"id": "w", "text": "  \\n "}', "('w'): field 'text' is whitespace only"),
    ('{"id": "n", "text": null}', "('n'): field 'text' is null"),
    ("not json", ": not valid JSON (Expecting value: line 1 column 1 (char 0))"),
    ("[1, 2]", ": not a JSON object (a JSON list)"),
    ('{"id": "i", "text": 5}', "('i'): field 'text' must be a string, got int"),
    (
        '{"id": "b", "body": "x"}',
        "('b'): has neither 'text' nor 'messages' nor 'input_ids' (columns: ['body', 'id'])",
    ),
    ('{"id": "m0", "messages": []}', "('m0'): field 'messages' is an empty list"),
    (
        '{"id": "m1", "messages": "hi"}',
        "('m1'): field 'messages' must be a list of {role, content} messages, got str",
    ),
    ('{"id": "m2", "messages": [{"content": "x"}]}', "('m2'): message 0 of 'messages' has no 'role' string"),
    ('{"id": "m3", "messages": [{"role": "user"}]}', "('m3'): message 0 of 'messages' has no 'content'"),
    (
        '{"id": "m4", "messages": [{"role": "user", "content": 3}]}',
        "('m4'): message 0 of 'messages': 'content' must be a string, got int",
    ),
    (
        '{"id": "m5", "messages": [{"role": "user", "content": ""}]}',
        "('m5'): field 'messages': every message is empty",
    ),
    ('{"id": "t0", "input_ids": []}', "('t0'): field 'input_ids' is an empty list"),
    (
        '{"id": "t1", "input_ids": [1, -2, "x", true]}',
        "('t1'): field 'input_ids' holds invalid token ids [-2, 'x', True] (must be integers >= 0 < vocab_size 4096)",
    ),
    (
        '{"id": "t2", "input_ids": [1, 4096]}',
        "('t2'): field 'input_ids' holds invalid token ids [4096] (must be integers >= 0 < vocab_size 4096)",
    ),
    ('{"id": "ok", "text": "dup"}', "('ok'): key 'ok' appears twice; sample keys must be unique"),
    (
        '{"id": "!lost", "text": "x"}',
        ": key '!lost': sample keys may not be empty, contain a newline or a tab, or start with '!' (the journal holds one key per line)",
    ),
    ('{"id": "a\\tb", "text": "x"}', ": key 'a\\tb': sample keys may not be empty"),
    ('{"id": "", "text": "x"}', ": key '': sample keys may not be empty"),
    ('{"id": "d", "text": "a", "text": "b"}', ": field 'text' appears twice in one JSON object"),
    (
        '{"id": "d2", "messages": [{"role": "user", "content": "a", "role": "assistant"}]}',
        ": field 'role' appears twice in one JSON object",
    ),
    ('{"id": "s\\udc80", "text": "x"}', ": not valid UTF-8 (a \\u escape of half a surrogate pair)"),
]


@pytest.mark.parametrize("line, expected", BAD_ROWS, ids=[e.split(":")[0] or row[:10] for row, e in BAD_ROWS])
def test_each_bad_row_kind_fails_with_file_line_and_reason(model, tmp_path, line, expected):
    ds = tmp_path / "d.jsonl"
    ds.write_text('{"id": "ok", "text": "fine"}\n\n' + line + '\n{"id": "z", "text": "also fine"}\n')
    lines = []
    with pytest.raises(ConfigError) as e:
        check_dataset(_cfg(model, ds), report=lambda b: lines.append(b.line()))
    assert len(lines) == 1 and lines[0].startswith(f"{ds}:3") and expected in lines[0], lines
    assert str(e.value) == f"teacher.dataset: {lines[0]}; fix the rows or set teacher.on_bad_row=skip"
    # skip: the rest of the dataset is used (one invalid JSON line does not stop it)
    keys, bad = check_dataset(_cfg(model, ds, on_bad_row="skip"))
    assert keys == ["ok", "z"] and [b.line() for b in bad] == lines
    assert [k for k, _ in iter_rows(_cfg(model, ds, on_bad_row="skip"))] == ["ok", "z"]


def test_invalid_utf8_in_text_or_key_is_a_bad_row_naming_file_and_line(model, tmp_path):
    """Bytes that are not UTF-8 in a row's text or key: refused like any bad row (one line with
    file and line), never read with replacement characters (the key would become 'k\\ufffd(')."""
    ds = tmp_path / "u.jsonl"
    ds.write_bytes(
        b'{"id": "ok", "text": "fine"}\n'
        b'{"id": "t", "text": "caf\xe9 au lait"}\n'
        b'{"id": "k\xff(", "text": "x"}\n'
        b'{"id": "z", "text": "\xf0\x9f\x99\x82 is fine"}\n'
    )
    lines = []
    with pytest.raises(ConfigError) as e:
        check_dataset(_cfg(model, ds), report=lambda b: lines.append(b.line()))
    assert lines == [
        f"{ds}:2: not valid UTF-8 (byte 0xe9 at column 25: invalid continuation byte)",
        f"{ds}:3: not valid UTF-8 (byte 0xff at column 10: invalid start byte)",
    ]
    assert str(e.value) == (
        f"teacher.dataset: {lines[0]} (and 1 more bad rows); fix the rows or set teacher.on_bad_row=skip"
    )
    keys, bad = check_dataset(_cfg(model, ds, on_bad_row="skip"))
    assert keys == ["ok", "z"] and [b.key for b in bad] == [None, None]
    assert [r["text"] for _, r in iter_rows(_cfg(model, ds, on_bad_row="skip"))] == ["fine", "🙂 is fine"]


def test_model_config_json_with_a_field_twice_is_refused(model, tmp_path):
    """The model's config.json naming a field twice (json would keep the last silently): one line
    naming the file, the field and the lines it is at."""
    import shutil

    m = tmp_path / "m"
    shutil.copytree(model, m)
    text = (m / "config.json").read_text()
    (m / "config.json").write_text(text.rstrip().removesuffix("}") + ',\n  "num_hidden_layers": 36\n}\n')
    lines = [
        i for i, x in enumerate((m / "config.json").read_text().splitlines(), 1) if '"num_hidden_layers"' in x
    ]
    assert len(lines) == 2
    with pytest.raises(ConfigError) as e:
        model_num_layers(str(m))
    assert str(e.value) == (
        f"teacher.model: {m / 'config.json'}: field 'num_hidden_layers' appears twice in one JSON object "
        f"(the name is at lines {lines[0]}, {lines[1]})"
    )


def test_good_chat_and_token_rows_pass(model, tmp_path):
    ds = tmp_path / "g.jsonl"
    rows = [
        {"id": "c", "messages": [{"role": "system", "content": ""}, {"role": "user", "content": "hi"}]},
        {"id": "t", "input_ids": [0, 5, 4095]},
        {"id": "x", "text": "안녕 🙂"},
    ]
    ds.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert check_dataset(_cfg(model, ds)) == (["c", "t", "x"], [])


def test_too_long_fail_is_checked_before_the_engine(model, tmp_path):
    ds = tmp_path / "l.jsonl"
    ds.write_text('{"id": "s", "input_ids": [1, 2]}\n{"id": "L", "input_ids": [1, 2, 3, 4, 5, 6]}\n')
    cfg = _cfg(model, ds, max_model_len=5, on_too_long="fail")
    with pytest.raises(ConfigError) as e:
        check_dataset(cfg, length=len_of(cfg))
    assert str(e.value) == (
        f"teacher.dataset: {ds}:2 ('L'): 6 prompt tokens > max_model_len - max_tokens = 4 "
        "(teacher.on_too_long=fail; or set it to skip or truncate)"
    )


def len_of(cfg):
    p = Prompter(cfg)
    return lambda row: len(p.token_ids(row))


def test_pre_tokenized_rows_need_no_tokenizer(tmp_path):
    ds = tmp_path / "t.jsonl"
    ds.write_text('{"id": "a", "input_ids": [5, 6, 7]}\n')
    cfg = TeacherConfig(model=str(tmp_path / "no-tokenizer-here"), dataset=str(ds), layer_ids=[1])
    p = Prompter(cfg)
    assert [p.token_ids(r) for _, r in iter_rows(cfg)] == [[5, 6, 7]]


def test_hf_folder_bad_rows_name_the_folder_and_row(model, tmp_path):
    """A datasets folder (load_from_disk) goes through the same row checks: `<path> row <n>`."""
    import datasets

    rows = [{"id": "a", "text": "fine"}, {"id": "b", "text": ""}, {"id": "c", "text": "also fine"}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf"))
    lines = []
    with pytest.raises(ConfigError) as e:
        check_dataset(_cfg(model, tmp_path / "hf"), report=lambda b: lines.append(b.line()))
    assert lines == [f"{tmp_path / 'hf'} row 1 ('b'): field 'text' is empty"]
    assert str(e.value) == f"teacher.dataset: {lines[0]}; fix the rows or set teacher.on_bad_row=skip"
    assert check_dataset(_cfg(model, tmp_path / "hf", on_bad_row="skip"))[0] == ["a", "c"]

"""Dataset formats the teacher reads: JSONL text / chat messages, Parquet, a datasets folder."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from distill.config import ConfigError
from distill.tiny import build_tiny_model, write_tiny_chat_dataset, write_tiny_dataset
from teacher.config import TeacherConfig
from teacher.data import Prompter, check_dataset, iter_rows


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
    assert len(check_dataset(cfg)) == 4
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

    # A `datasets.save_to_disk` folder (DatasetDict with a train split). The `datasets` package is
    # not installed here, so the folder is written by hand in its layout: Arrow stream files listed
    # in state.json.
    split = tmp_path / "hf" / "train"
    split.mkdir(parents=True)
    with pa.ipc.new_stream(str(split / "data-00000-of-00001.arrow"), table.schema) as w:
        w.write_table(table)
    (split / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]})
    )
    (tmp_path / "hf" / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    assert [r for _, r in iter_rows(_cfg(model, tmp_path / "hf"))] == rows
    with pytest.raises(ConfigError, match="teacher.split: 'test' is not a split"):
        list(iter_rows(_cfg(model, tmp_path / "hf", split="test")))


def test_bad_rows_fail_with_the_row(model, tmp_path):
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"id": "a", "text": "x"}\n{"id": "a", "text": "y"}\n')
    with pytest.raises(ConfigError, match="key 'a' appears twice"):
        check_dataset(_cfg(model, dup))
    nofield = tmp_path / "nf.jsonl"
    nofield.write_text('{"id": "a", "body": "x"}\n')
    with pytest.raises(ConfigError, match="has neither 'text' nor 'messages' nor 'input_ids'"):
        check_dataset(_cfg(model, nofield))
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match="has no rows"):
        check_dataset(_cfg(model, empty))
    with pytest.raises(ConfigError, match="not a readable Parquet file"):
        (tmp_path / "x.parquet").write_text("nope")
        check_dataset(_cfg(model, tmp_path / "x.parquet"))


@pytest.mark.parametrize("key", ["a\tb", "a\nb", "!lost", ""])
def test_keys_the_journal_cannot_hold_are_rejected(model, tmp_path, key):
    ds = tmp_path / "k.jsonl"
    ds.write_text(json.dumps({"id": "ok", "text": "x"}) + "\n" + json.dumps({"id": key, "text": "y"}) + "\n")
    with pytest.raises(
        ConfigError, match=r"teacher.dataset: row 1 has key .*may not be empty, contain a newline"
    ):
        check_dataset(_cfg(model, ds))


def test_pre_tokenized_rows_need_no_tokenizer(tmp_path):
    ds = tmp_path / "t.jsonl"
    ds.write_text('{"id": "a", "input_ids": [5, 6, 7]}\n')
    cfg = TeacherConfig(model=str(tmp_path / "no-tokenizer-here"), dataset=str(ds), layer_ids=[1])
    p = Prompter(cfg)
    assert [p.token_ids(r) for _, r in iter_rows(cfg)] == [[5, 6, 7]]

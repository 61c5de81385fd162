"""`moetron preprocess` from Parquet, Arrow (`datasets.save_to_disk`) and `hf://datasets/NAME`: the same texts give
the same `.bin/.idx` bytes as from JSONL, for one worker and several; bad inputs fail with one line before any work."""

from __future__ import annotations

import json
import sys

import pytest
from data_helpers import CORPUS, make_tiny_tokenizer, write_jsonl

from moetron.data.preprocess import PreprocessOptions, preprocess
from moetron.data.text_sources import HubDataset, parse_hub_url, resolve_sources
from moetron.errors import UserError

pa = pytest.importorskip("pyarrow", reason="pyarrow is the [parquet] extra (in [dev])")
pq = pytest.importorskip("pyarrow.parquet")

# enough documents for several chunks and record batches, with a null and an empty text the JSONL path skips too
TEXTS = [f"{CORPUS[i % len(CORPUS)]} number {i}" for i in range(600)]
TEXTS[7], TEXTS[11] = "", None


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def convert(tok_dir, inputs, prefix, workers=1, keys=("text",), **extra) -> bytes:
    options = PreprocessOptions(
        inputs=[str(i) for i in inputs],
        output_prefix=str(prefix),
        tokenizer_type="GPT2BPETokenizer",
        vocab_file=str(tok_dir / "vocab.json"),
        merge_file=str(tok_dir / "merges.txt"),
        json_keys=list(keys),
        append_eod=True,
        workers=workers,
        log_interval=0,
        chunk_bytes=4096,  # many chunks: the order across chunks and workers is exercised
        **extra,
    )
    summary = preprocess(options)
    assert summary.skipped_records == 1 and summary.empty_documents == 1  # the null and the empty text
    out = f"{prefix}_{keys[0]}_document"
    return open(f"{out}.bin", "rb").read() + b"|" + open(f"{out}.idx", "rb").read()


def table(texts, **columns):
    return pa.table({"text": pa.array(texts, pa.string()), "id": list(range(len(texts))), **columns})


@pytest.fixture(scope="module")
def reference(tok_dir, tmp_path_factory):
    """The JSONL path's bytes of TEXTS (a JSON null and an empty string are skipped there too)."""
    tmp = tmp_path_factory.mktemp("ref")
    return convert(tok_dir, [write_jsonl(tmp / "in.jsonl", TEXTS)], tmp / "ref")


def test_parquet_file_and_directory_give_the_jsonl_bytes(tok_dir, tmp_path, reference):
    pq.write_table(table(TEXTS), tmp_path / "one.parquet", row_group_size=100)
    assert convert(tok_dir, [tmp_path / "one.parquet"], tmp_path / "a") == reference
    shards = tmp_path / "shards"
    shards.mkdir()
    for i, start in enumerate(range(0, len(TEXTS), 250)):  # a directory (name order) and a glob of the same shards
        pq.write_table(table(TEXTS[start : start + 250]), shards / f"part-{i:02d}.parquet")
    assert convert(tok_dir, [shards / "part-*.parquet"], tmp_path / "b") == reference
    # two worker processes (a pool is slow to start: once in this file) tokenize the columnar chunks in order
    assert convert(tok_dir, [shards], tmp_path / "c", workers=2) == reference


def test_arrow_ipc_stream_as_save_to_disk_writes_it(tok_dir, tmp_path, reference):
    """What `save_to_disk` writes without needing `datasets`: Arrow IPC stream files listed in state.json."""
    directory = tmp_path / "saved"
    directory.mkdir()
    names = []
    for i, start in enumerate(range(0, len(TEXTS), 400)):
        names.append(f"data-{i:05d}-of-00002.arrow")
        part = table(TEXTS[start : start + 400])
        with pa.ipc.new_stream(str(directory / names[-1]), part.schema) as writer:
            writer.write_table(part, max_chunksize=150)
    (directory / "state.json").write_text(json.dumps({"_data_files": [{"filename": name} for name in names]}))
    assert convert(tok_dir, [directory], tmp_path / "a") == reference
    with pa.ipc.new_file(str(tmp_path / "random_access.arrow"), table(TEXTS).schema) as writer:
        writer.write_table(table(TEXTS), max_chunksize=250)
    assert convert(tok_dir, [tmp_path / "random_access.arrow"], tmp_path / "b") == reference


def test_datasets_save_to_disk_and_hub_streaming_give_the_jsonl_bytes(tok_dir, tmp_path, reference, monkeypatch):
    datasets = pytest.importorskip("datasets", reason="the [datasets] extra is not installed")
    dataset = datasets.Dataset.from_dict({"text": TEXTS, "id": list(range(len(TEXTS)))})
    dataset.save_to_disk(str(tmp_path / "saved"), max_shard_size="10KB")
    assert convert(tok_dir, [tmp_path / "saved"], tmp_path / "a") == reference
    datasets.DatasetDict({"train": dataset.select([0]), "valid": dataset}).save_to_disk(str(tmp_path / "dict"))
    assert convert(tok_dir, [tmp_path / "dict"], tmp_path / "b", split="valid") == reference
    with pytest.raises(UserError, match=r"--split 'test' is not in the dataset at .*\(splits: train, valid\)"):
        resolve_sources([str(tmp_path / "dict")], ["text"], "test")
    # hf://datasets/NAME: the name and split reach datasets' streaming loader, here served from local Parquet files
    pq.write_table(table(TEXTS), tmp_path / "hub.parquet", row_group_size=200)
    calls, real_load_dataset = [], datasets.load_dataset

    def load_dataset(name, split, streaming):
        calls.append((name, split, streaming))
        return real_load_dataset("parquet", data_files=str(tmp_path / "hub.parquet"), split="train", streaming=True)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert convert(tok_dir, ["hf://datasets/owner/corpus"], tmp_path / "c", split="valid") == reference
    assert calls == [("owner/corpus", "valid", True)]


def test_hub_url_parsing_and_offline_error(monkeypatch):
    assert parse_hub_url("hf://datasets/HuggingFaceFW/fineweb-edu") == "HuggingFaceFW/fineweb-edu"
    assert parse_hub_url("hf://datasets/wikitext/") == "wikitext"
    with pytest.raises(UserError, match="names no dataset"):
        parse_hub_url("hf://datasets/")
    pytest.importorskip("datasets")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr("moetron.data.text_sources._hub_reachable", lambda timeout_s=3.0: False)
    with pytest.raises(UserError, match=r"hf://datasets/owner/x': the Hugging Face Hub cannot be reached"):
        HubDataset.open("hf://datasets/owner/x", "train")


def test_bad_columnar_inputs_fail_with_one_line_before_any_output(tok_dir, tmp_path):
    pq.write_table(pa.table({"content": ["a b"], "n": [1]}), tmp_path / "other.parquet")
    (tmp_path / "garbage.parquet").write_bytes(b"not a parquet file at all")
    (tmp_path / "empty").mkdir()
    cases = [
        (["other.parquet"], ["text"], r"'.*other.parquet' has no column 'text' \(columns: content, n\)"),
        (["other.parquet"], ["n"], r"column 'n' holds int64, not strings"),
        (["garbage.parquet"], ["text"], r"'.*garbage.parquet' is not a readable Parquet file"),
        (["empty"], ["text"], r"'.*empty' is a directory with no .parquet file"),
        (["missing.parquet"], ["text"], r"'.*missing.parquet' does not exist"),
    ]
    for inputs, keys, message in cases:
        with pytest.raises(UserError, match=message):
            convert(tok_dir, [tmp_path / i for i in inputs], tmp_path / "out", keys=keys)
    assert not list(tmp_path.glob("out*"))


def test_a_missing_extra_is_named(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    monkeypatch.setitem(sys.modules, "datasets", None)
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    with pytest.raises(UserError, match=r"needs pyarrow \(not installed\): pip install 'moetron\[parquet\]'"):
        resolve_sources([str(tmp_path / "x.parquet")], ["text"])
    with pytest.raises(UserError, match=r"needs datasets \(not installed\): pip install 'moetron\[datasets\]'"):
        resolve_sources(["hf://datasets/owner/name"], ["text"])

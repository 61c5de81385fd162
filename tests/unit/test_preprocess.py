import gzip
import json

import numpy as np
import pytest
from data_helpers import (
    CORPUS,
    make_tiny_tokenizer,
    megatron_reference,
    tiny_tokenizer,
    tiny_tokenizer_flags,
    write_jsonl,
)

from moetron.cli import main
from moetron.data.indexed import IndexedDataset
from moetron.data.preprocess import PreprocessOptions, preprocess
from moetron.data.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def run_preprocess(tok_dir, inputs, prefix, *extra):
    argv = ["preprocess", "--input", *map(str, inputs), "--output-prefix", str(prefix), *tiny_tokenizer_flags(tok_dir)]
    return main([*argv, "--log-interval", "0", *extra])


def documents(prefix):
    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


def test_round_trip_decodes_back_to_the_text(tmp_path, tok_dir, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", CORPUS)
    assert run_preprocess(tok_dir, [source], tmp_path / "out", "--log-interval", "2") == 0
    out, err = capsys.readouterr()
    assert "4 documents" in out and "MB/s" in out
    assert "processed 4 documents" in err  # progress lines, as stderr is not a terminal here
    tok = tiny_tokenizer(tok_dir)
    assert [tok.decode(doc) for doc in documents(tmp_path / "out_text_document")] == CORPUS


@pytest.mark.parametrize("append_eod", [False, True])
def test_bytes_equal_megatron_format(tmp_path, tok_dir, append_eod):
    source = write_jsonl(tmp_path / "in.jsonl", CORPUS)
    assert run_preprocess(tok_dir, [source], tmp_path / "out", *(["--append-eod"] if append_eod else [])) == 0
    tok = tiny_tokenizer(tok_dir)
    expected = [tok.encode(text) + ([tok.eod] if append_eod else []) for text in CORPUS]
    # With --append-eod the EOD counts in each size: Megatron-LM's fixed writer (#431), not the drifting one.
    megatron_reference(tmp_path / "ref", expected, "uint16")
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"out_text_document{ext}").read_bytes() == (tmp_path / f"ref{ext}").read_bytes()


def test_gpt2_shakespeare_bytes_equal_megatron_format(tmp_path, gpt2_files, shakespeare):
    blocks = [b for b in shakespeare.read_text(encoding="utf-8").split("\n\n") if b.strip()][:300]
    source = write_jsonl(tmp_path / "shk.jsonl", blocks)
    vocab, merges = map(str, gpt2_files)
    argv = ["preprocess", "--input", str(source), "--output-prefix", str(tmp_path / "o"), "--log-interval", "0"]
    assert main([*argv, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges]) == 0
    gpt2 = build_tokenizer("GPT2BPETokenizer", vocab, merges)
    megatron_reference(tmp_path / "ref", [gpt2.encode(b) for b in blocks], "uint16")
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"o_text_document{ext}").read_bytes() == (tmp_path / f"ref{ext}").read_bytes()


def test_text_gzip_and_glob_inputs_match_jsonl(tmp_path, tok_dir):
    (tmp_path / "a.txt").write_text("\n\n".join(CORPUS[:2]) + "\n", encoding="utf-8")
    with gzip.open(tmp_path / "b.txt.gz", "wt", encoding="utf-8") as handle:
        handle.write("\n\n\n".join(CORPUS[2:]))
    write_jsonl(tmp_path / "ref.jsonl", CORPUS)
    assert run_preprocess(tok_dir, [tmp_path / "*.txt*"], tmp_path / "txt") == 0
    assert run_preprocess(tok_dir, [tmp_path / "ref.jsonl"], tmp_path / "json") == 0
    assert documents(tmp_path / "txt_text_document") == documents(tmp_path / "json_text_document")
    assert len(documents(tmp_path / "txt_text_document")) == 4


def test_worker_count_does_not_change_the_bytes(tmp_path, tok_dir):
    source = write_jsonl(tmp_path / "in.jsonl", [f"{i} {CORPUS[i % 4]}" for i in range(60)])
    flags = tiny_tokenizer_flags(tok_dir)
    common = dict(vocab_file=flags[3], merge_file=flags[5], append_eod=True, log_interval=0, chunk_bytes=200)
    for workers in (1, 2):
        preprocess(PreprocessOptions([str(source)], str(tmp_path / f"w{workers}"), flags[1], workers=workers, **common))
    for ext in (".bin", ".idx"):
        one = (tmp_path / f"w1_text_document{ext}").read_bytes()
        assert one == (tmp_path / f"w2_text_document{ext}").read_bytes()
    assert len(documents(tmp_path / "w2_text_document")) == 60


def write_bad_input(path):
    lines = [
        json.dumps({"text": CORPUS[0]}).encode(),
        b'{"text": "unterminated',
        json.dumps({"body": "no text key"}).encode(),
        json.dumps({"text": ["a", "list"]}).encode(),
        b'{"text": "bad \xff byte"}',
        json.dumps({"text": ""}).encode(),
        json.dumps({"text": CORPUS[1]}).encode(),
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_bad_records_are_counted_reported_and_skipped(tmp_path, tok_dir, capsys):
    source = write_bad_input(tmp_path / "bad.jsonl")
    assert run_preprocess(tok_dir, [source], tmp_path / "out") == 0
    captured = capsys.readouterr()
    assert "skipped 4 bad record(s) and 1 empty document(s)" in captured.err
    for line, what in [(2, "malformed JSON"), (3, "missing key 'text'"), (4, "value of 'text' is list"),
                       (5, "invalid UTF-8"), (6, "empty document")]:  # fmt: skip
        assert f"bad.jsonl:{line}: {what}" in captured.err
    assert "2 documents" in captured.out
    tok = tiny_tokenizer(tok_dir)
    assert [tok.decode(d) for d in documents(tmp_path / "out_text_document")] == CORPUS[:2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "out_text_document.bin", "out_text_document.idx"]


def test_strict_stops_at_the_first_bad_record_and_leaves_nothing(tmp_path, tok_dir, capsys):
    source = write_bad_input(tmp_path / "bad.jsonl")
    assert run_preprocess(tok_dir, [source], tmp_path / "out", "--strict") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "bad.jsonl:2: malformed JSON" in err and len(err.strip().splitlines()) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["bad.jsonl"]


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(input="missing.jsonl"), "--input '{tmp}/missing.jsonl' does not exist"),
        # a missing directory is made once every check passed: not here, so none is left
        (lambda a: a.update(prefix="nodir/out", type="WordPiece"), "--tokenizer-type 'WordPiece' is not supported"),
        (lambda a: a.update(type="WordPiece"), "--tokenizer-type 'WordPiece' is not supported"),
        (lambda a: a.update(vocab="nope.json"), "--vocab-file '{tmp}/nope.json' is not a readable"),
    ],
)
def test_bad_arguments_fail_before_any_work(tmp_path, tok_dir, capsys, change, message):
    write_jsonl(tmp_path / "in.jsonl", CORPUS)
    args = dict(input="in.jsonl", prefix="out", type="GPT2BPETokenizer", vocab=str(tok_dir / "vocab.json"))
    change(args)
    argv = ["preprocess", "--input", str(tmp_path / args["input"]), "--output-prefix", str(tmp_path / args["prefix"])]
    argv += ["--tokenizer-type", args["type"], "--vocab-file", str(tmp_path / args["vocab"])]
    assert main([*argv, "--merge-file", str(tok_dir / "merges.txt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message.format(tmp=tmp_path) in err and len(err.strip().splitlines()) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["in.jsonl"]


def test_one_output_pair_per_json_key(tmp_path, tok_dir):
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"title": t[:10], "text": t}) + "\n" for t in CORPUS), encoding="utf-8")
    assert run_preprocess(tok_dir, [source], tmp_path / "out", "--json-keys", "text", "title") == 0
    tok = tiny_tokenizer(tok_dir)
    assert [tok.decode(d) for d in documents(tmp_path / "out_title_document")] == [t[:10] for t in CORPUS]
    assert [tok.decode(d) for d in documents(tmp_path / "out_text_document")] == CORPUS
    assert IndexedDataset(tmp_path / "out_text_document").dtype == np.uint16


def test_corrupt_gzip_is_a_one_line_error_and_leaves_nothing(tmp_path, tok_dir, capsys):
    payload = gzip.compress(("\n".join(json.dumps({"text": t}) for t in CORPUS * 50)).encode())
    (tmp_path / "in.jsonl.gz").write_bytes(payload[: len(payload) // 2])
    assert run_preprocess(tok_dir, [tmp_path / "in.jsonl.gz"], tmp_path / "out") == 2
    assert "in.jsonl.gz' cannot be read to the end" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["in.jsonl.gz"]

import numpy as np
import pytest
from data_helpers import CORPUS, make_tiny_tokenizer, megatron_reference, tiny_tokenizer, tiny_tokenizer_flags

from moetron.cli import main
from moetron.data.indexed import IndexedDatasetBuilder
from moetron.data.inspect import size_histogram


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture
def dataset(tmp_path, tok_dir):
    tok = tiny_tokenizer(tok_dir)
    with IndexedDatasetBuilder(tmp_path / "d", np.uint16) as builder:
        for text in CORPUS:
            builder.add_document(tok.encode(text) + [tok.eod])
        builder.finalize()
    return tmp_path / "d"


def test_describes_the_dataset(dataset, tok_dir, capsys):
    assert main(["inspect", str(dataset), *tiny_tokenizer_flags(tok_dir)[2:]]) == 0
    out, err = capsys.readouterr()
    tok = tiny_tokenizer(tok_dir)
    total = sum(len(tok.encode(t)) + 1 for t in CORPUS)
    assert "dtype      uint16" in out
    assert "documents  4" in out and "sequences  4" in out
    assert f"tokens     {total} in sizes, {total} in the .bin" in out
    assert "histogram of sequence sizes" in out
    assert CORPUS[0] + "<|endoftext|>" in out  # the first document, decoded
    assert err == ""


def test_without_tokenizer_and_with_a_file_name(dataset, capsys):
    assert main(["inspect", f"{dataset}.idx"]) == 0
    out = capsys.readouterr().out
    assert "documents  4" in out and "first document" not in out


def test_histogram_buckets_are_powers_of_two():
    lines = size_histogram(np.array([1, 2, 3, 4, 7, 8, 100], dtype=np.int32))
    counts = {line.split()[0]: int(line.split()[-1]) for line in lines}
    assert counts == {"1": 1, "2": 2, "4": 2, "8": 1, "64": 1}


def test_warns_about_the_eod_drift(tmp_path, capsys):
    megatron_reference(tmp_path / "drift", [[1, 2, 0], [3, 0]], "uint16", sizes=[2, 1])
    assert main(["inspect", str(tmp_path / "drift")]) == 0
    out, err = capsys.readouterr()
    assert "tokens     3 in sizes, 5 in the .bin" in out
    assert "warning: the sizes add up to 3 tokens" in err and "Megatron-LM#431" in err


def test_truncated_and_foreign_files_are_one_line_errors(dataset, tmp_path, capsys):
    idx = dataset.with_suffix(".idx")
    idx.write_bytes(idx.read_bytes()[:-3])
    assert main(["inspect", str(dataset)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: '{idx}' is truncated or corrupt") and len(err.strip().splitlines()) == 1
    idx.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64)
    assert main(["inspect", str(dataset)]) == 2
    assert f"error: '{idx}' is not a Megatron .idx file" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "absent")]) == 2
    assert "absent.idx' does not exist" in capsys.readouterr().err

"""`moetron train` guards around the data and the config: wrong-tokenizer token ids, a split without validation,
`--print-config`'s vocabulary, and config errors printed once under torchrun."""

from __future__ import annotations

import numpy as np
import pytest
import yaml
from data_helpers import make_tiny_tokenizer

from moetron.cli import main
from moetron.data.indexed import IndexedDatasetBuilder

VOCAB = 96
TINY = (
    f"--num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 8 --vocab-size {VOCAB} "
    "--micro-batch-size 2 --global-batch-size 2 --num-experts 2 --expert-interval 1 --topk 1 --train-iters 2 "
    "--log-interval 1 "
    "--eval-iters 1 --eval-interval 1"
).split()


def write_dataset(prefix, high: int = VOCAB - 1, documents: int = 40) -> str:
    """Documents of ids below `high`, with `high` itself in the last one (past the first micro-batch)."""
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix, np.uint16)
    for _ in range(documents - 1):
        builder.add_document(rng.integers(0, min(high, VOCAB), 30))
    builder.add_document(np.array([1, 2, high]))
    builder.finalize()
    return str(prefix)


def test_token_ids_beyond_the_vocabulary_are_one_clear_error(tmp_path, capsys):
    prefix = write_dataset(tmp_path / "wide_text_document", high=600)
    run = tmp_path / "run"
    assert main(["train", *TINY, "--data-path", prefix, "--save", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {prefix}: token id 600 is out of range for the vocabulary of {VOCAB} tokens")
    assert "--tokenizer-model" in err and "--vocab-size" in err and len(err.strip().splitlines()) == 1
    assert not (run / "metrics.jsonl").exists()


def test_separate_valid_set_is_checked_too(tmp_path, capsys):
    train = write_dataset(tmp_path / "train_text_document")
    valid = write_dataset(tmp_path / "valid_text_document", high=VOCAB)
    args = ["train", *TINY, "--train-data-path", train, "--valid-data-path", valid]
    assert main(args) == 2
    assert f"{valid}: token id {VOCAB} is out of range" in capsys.readouterr().err


def test_split_without_validation_warns_once_and_writes_no_eval(tmp_path, capsys):
    prefix = write_dataset(tmp_path / "corpus_text_document")
    run = tmp_path / "run"
    assert main(["train", *TINY, "--data-path", prefix, "--split", "100,0,0", "--save", str(run)]) == 0
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "--split '100,0,0' leaves no validation documents" in warnings[0]
    assert not (run / "eval.jsonl").exists() or not (run / "eval.jsonl").read_text().strip()


def test_print_config_shows_the_tokenizers_vocab_size(tmp_path, capsys):
    tok = make_tiny_tokenizer(tmp_path)
    prefix = write_dataset(tmp_path / "corpus_text_document")
    flags = ["--data-path", prefix, "--train-iters", "1", "--tokenizer-type", "HFTokenizer"]
    assert main(["train", *flags, "--tokenizer-model", str(tok / "tokenizer.json"), "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["vocab_size"] == 300
    assert main(["train", *flags, "--tokenizer-model", str(tok / "tokenizer.json"), "--vocab-size", "512",
                 "--print-config"]) == 0  # fmt: skip
    assert yaml.safe_load(capsys.readouterr().out)["model"]["vocab_size"] == 512


@pytest.mark.parametrize("rank, printed", [(None, True), ("0", True), ("1", False), ("3", False)])
def test_config_errors_print_on_rank_zero_only(monkeypatch, capsys, rank, printed):
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    assert main(["train", "--hidden-size", "30"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") if printed else err == ""

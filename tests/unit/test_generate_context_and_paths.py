"""`generate` on a short-context model, saved configs with absolute paths, tokenizer overrides for eval/generate."""

from __future__ import annotations

import shutil

import pytest
import yaml
from data_helpers import CORPUS, make_tiny_tokenizer, write_jsonl

from moetron.cli import main

SEQ = 16
TINY = (
    f"--num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length {SEQ} --max-position-embeddings {SEQ} "
    "--micro-batch-size 2 --global-batch-size 2 --train-iters 2 --log-interval 1 --eval-iters 1 --eval-interval 2 "
    "--split 70,30,0"
).split()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 16-position model trained from RELATIVE tokenizer and data paths, in its own working directory."""
    base = tmp_path_factory.mktemp("gen")
    make_tiny_tokenizer(base)
    write_jsonl(base / "docs.jsonl", CORPUS * 10)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(base)
        tok = ["--vocab-file", "tok/vocab.json", "--merge-file", "tok/merges.txt"]
        argv = ["preprocess", "--input", "docs.jsonl", "--output-prefix", "corpus", "--tokenizer-type"]
        assert main([*argv, "GPT2BPETokenizer", *tok, "--append-eod", "--log-interval", "0"]) == 0
        assert main(["train", *TINY, "--data-path", "corpus_text_document", *tok, "--save", "run"]) == 0
    return base


def test_saved_config_paths_are_absolute(run):
    data = yaml.safe_load((run / "run" / "config.yaml").read_text())["data"]
    assert data["vocab_file"] == str(run / "tok" / "vocab.json")
    assert data["merge_file"] == str(run / "tok" / "merges.txt")
    assert data["data_path"] == [str(run / "corpus_text_document")]


def test_default_max_new_tokens_is_clamped_to_the_context_with_a_note(run, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # another directory: the saved absolute paths still resolve
    assert main(["generate", "--load", str(run / "run"), "--prompt", "The quick", "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and notes[0].startswith("note: --max-new-tokens 64 lowered to ")
    assert f"the model has {SEQ} positions" in notes[0]
    assert out.startswith("The quick")


def test_a_prompt_that_fills_the_context_is_one_line(run, capsys):
    assert main(["generate", "--load", str(run / "run"), "--prompt", "The quick brown fox " * 10]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the prompt has ") and "shorten the prompt" in err and len(err.splitlines()) == 1


def as_saved_elsewhere(run_dir, old: str, new: str) -> None:
    """The run as a machine whose tokenizer lived at `new` saved it: its config.yaml files (the run's and each
    checkpoint's) name `new`, and each checkpoint's checksums are that save's (`checkpoint/integrity.py`)."""
    from moetron.checkpoint.integrity import CHECKSUM_DIR, checkpoint_files, record_checksums

    for config in run_dir.rglob("config.yaml"):
        config.write_text(config.read_text().replace(old, new))
    for checkpoint in run_dir.glob("iter_*"):
        shutil.rmtree(checkpoint / CHECKSUM_DIR)
        record_checksums(checkpoint, 0, checkpoint_files(checkpoint))


def test_moved_tokenizer_files_and_the_override_flags(run, tmp_path, capsys):
    moved = tmp_path / "moved"
    shutil.copytree(run / "tok", moved)
    shutil.copytree(run / "run", tmp_path / "run")
    as_saved_elsewhere(tmp_path / "run", str(run / "tok"), str(tmp_path / "gone"))
    load = ["--load", str(tmp_path / "run")]
    assert main(["generate", *load, "--prompt", "The"]) == 2
    err = capsys.readouterr().err
    assert f"--vocab-file {tmp_path / 'gone' / 'vocab.json'} (the tokenizer file the checkpoint's config.yaml" in err
    flags = ["--vocab-file", str(moved / "vocab.json"), "--merge-file", str(moved / "merges.txt")]
    assert main(["generate", *load, "--prompt", "The", "--max-new-tokens", "3", *flags]) == 0
    assert capsys.readouterr().out.startswith("The")
    assert main(["eval", *load, *flags]) == 0


def test_a_tokenizer_larger_than_the_model_is_refused(run, gpt2_files, capsys):
    vocab, merges = gpt2_files
    argv = ["generate", "--load", str(run / "run"), "--prompt", "The", "--vocab-file", str(vocab)]
    assert main([*argv, "--merge-file", str(merges)]) == 2
    err = capsys.readouterr().err
    assert "has 50257 tokens but the checkpoint's model only 300" in err


def test_export_takes_the_same_tokenizer_flags(run, tmp_path, capsys):
    """`export` reads the tokenizer flags as eval/generate do: a tokenizer.json alone (`--tokenizer-model`) replaces
    a GPT-2 BPE pair that moved, and the exported tokenizer encodes as the run's did."""
    import json

    assert main(["export", "--load", str(run / "run"), "--output", str(tmp_path / "hf")]) == 0
    tokenizer_json = tmp_path / "tokenizer.json"
    shutil.copy(tmp_path / "hf" / "tokenizer.json", tokenizer_json)
    shutil.copytree(run / "run", tmp_path / "run")
    as_saved_elsewhere(tmp_path / "run", str(run / "tok"), str(tmp_path / "gone"))
    argv = ["export", "--load", str(tmp_path / "run"), "--output", str(tmp_path / "hf2")]
    assert main(argv) == 2 and "--vocab-file" in capsys.readouterr().err
    assert main([*argv, "--tokenizer-model", str(tokenizer_json)]) == 0
    vocab = json.loads((tmp_path / "hf2" / "tokenizer.json").read_text())["model"]["vocab"]
    assert vocab == json.loads(tokenizer_json.read_text())["model"]["vocab"]

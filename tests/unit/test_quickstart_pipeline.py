"""The quickstart's own wording and notes, without running the whole pipeline (that is tests/integration)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from data_helpers import CORPUS, make_tiny_tokenizer, write_jsonl

from moetron.quickstart import pipeline
from moetron.quickstart.pipeline import QuickstartOptions, baseline_comparison, write_run_config


@pytest.mark.parametrize(
    "valid_ppl, unigram_ppl, expected",
    [
        (230.0, 860.0, "3.7x lower"),
        (860.0, 430.0, "2.0x higher: worse than the baseline"),  # used to print "0.5x lower"
        (500.0, 510.0, "about the same as the baseline"),
    ],
)
def test_baseline_comparison_says_higher_when_worse(valid_ppl, unigram_ppl, expected):
    text = baseline_comparison(valid_ppl, unigram_ppl)
    assert text.startswith(expected)
    assert not ("lower" in text and unigram_ppl < valid_ppl)


def test_missing_tensorboard_is_one_note_naming_the_extra(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setattr(pipeline, "tensorboard_installed", lambda: False)
    tokenizer = make_tiny_tokenizer(tmp_path)
    prefix = pipeline.build_dataset([write_jsonl(tmp_path / "docs.jsonl", CORPUS)], tokenizer, tmp_path)
    capsys.readouterr()
    config = write_run_config(QuickstartOptions(output_dir=tmp_path, nproc=1), tmp_path, prefix, tokenizer)
    out = capsys.readouterr().out
    assert out.count("note:") == 1 and "no tensorboard/" in out and 'pip install "moetron[tensorboard]"' in out
    written = yaml.safe_load(config.read_text())
    assert written["train"]["tensorboard_dir"] is None
    assert written["model"]["vocab_size"] == 300  # the trained tokenizer's real size, not the recipe's 8192


def test_missing_matplotlib_is_one_note_naming_the_extra(tmp_path: Path, monkeypatch, capsys):
    import moetron.eval.plots

    monkeypatch.setattr(moetron.eval.plots, "matplotlib_missing", lambda: "matplotlib is not installed")
    pipeline.write_run_plots({}, tmp_path)
    out = capsys.readouterr().out
    assert out.count("note:") == 1 and "no plots/" in out and 'pip install "moetron[plot]"' in out
    assert not (tmp_path / "plots").exists()

"""`moetron quickstart` end to end (reduced corpus and steps), then the commands it prints; its input errors."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
from collections import Counter

import pytest

from moetron.cli import main
from moetron.data.indexed import IndexedDataset
from moetron.eval.plots import matplotlib_missing

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def moetron(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moetron", *args], capture_output=True, text=True, env=ENV, timeout=timeout
    )


def printed_commands(stdout: str) -> dict[str, list[str]]:
    """The continuation commands after 'Continue with:', by subcommand."""
    tail = stdout.split("Continue with:", 1)[1]
    commands = [shlex.split(line) for line in tail.strip().splitlines()]
    return {c[c.index("moetron") + 1]: c for c in commands}


def reference_unigram_ppl(prefix: str, split_bounds: tuple[int, int, int]) -> float:
    data = IndexedDataset(prefix)
    start, cut, end = split_bounds
    train = Counter(t for i in range(start, cut) for t in data.get(i).tolist())
    vocab = max(max(train), max(t for i in range(cut, end) for t in data.get(i).tolist())) + 1
    total = sum(train.values()) + vocab
    valid = [t for i in range(cut, end) for t in data.get(i).tolist()]
    return math.exp(-sum(math.log((train[t] + 1) / total) for t in valid) / len(valid))


@pytest.mark.distributed
def test_quickstart_end_to_end_with_expert_parallel_then_its_commands(tmp_path):
    run = tmp_path / "qs"
    proc = moetron("quickstart", "--output-dir", str(run), "--max-corpus-mb", "0.2", "--train-iters", "6",
                   "--vocab-size", "600")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    # everything in one run directory
    expected = [
        "corpus/corpus.jsonl",
        "tokenizer/vocab.json",
        "tokenizer/merges.txt",
        "data/corpus_text_document.bin",
        "data/corpus_text_document.idx",
        "config.yaml",
        "latest",
        "iter_0000006/.metadata",
        "iter_0000006/__1_0.distcp",  # trained with expert parallelism 2: both ranks wrote shards
        "metrics.jsonl",
        "eval.jsonl",
        "eval_report.json",
    ]
    for name in expected:
        assert (run / name).is_file(), name
    if not matplotlib_missing():
        assert (run / "plots" / "expert_load.png").is_file() and (run / "plots" / "loss_curves.png").is_file()
    assert "expert parallel 2" in out and "routing report" in out and "--- 'Return the' ->" in out

    # the final evaluation equals the trainer's (2 ranks, emulated in one process), next to the unigram baseline
    report = json.loads((run / "eval_report.json").read_text())
    final = json.loads((run / "eval.jsonl").read_text().splitlines()[-1])
    assert report["valid_loss"] == pytest.approx(final["valid_loss"], rel=1e-6)
    match = re.search(r"validation perplexity ([\d.]+) vs unigram baseline ([\d.]+)", out)
    assert match and float(match.group(2)) == pytest.approx(report["unigram_ppl"], rel=1e-3)
    from moetron.data.sample_index import get_train_valid_test_split

    prefix = str(run / "data" / "corpus_text_document")
    bounds = get_train_valid_test_split("95,5,0", len(IndexedDataset(prefix)))
    assert report["unigram_ppl"] == pytest.approx(reference_unigram_ppl(prefix, tuple(bounds[:3])), rel=1e-9)

    # the printed commands work as printed
    commands = printed_commands(out)
    assert set(commands) == {"train", "eval", "generate"}
    assert commands["train"][:3] == ["torchrun", "--nproc-per-node", "2"] and "--load" in commands["train"]
    assert "--override-opt-param-scheduler" in commands["train"]  # a longer run stretches the finished schedule
    evaluated = moetron(*commands["eval"][1:])
    assert evaluated.returncode == 0, evaluated.stderr
    assert f"validation lm loss {report['valid_loss']:.4f}" in evaluated.stdout
    generated = moetron(*commands["generate"][1:])
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.startswith("Return the")

    # a prompt file is a batch: each prompt's greedy text equals the same prompt given alone
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The list\n\nimport os\n")
    greedy = ["--load", str(run), "--temperature", "0", "--max-new-tokens", "8"]
    batch = moetron("generate", *greedy, "--prompt-file", str(prompts))
    alone = moetron("generate", *greedy, "--prompt", "import os")
    assert batch.returncode == 0 and alone.returncode == 0, batch.stderr + alone.stderr
    assert batch.stdout.count("--- prompt ") == 2
    assert batch.stdout.split("--- prompt 2\n", 1)[1] == alone.stdout


def test_user_input_on_one_process(tmp_path, shakespeare):
    text = tmp_path / "plays.txt"
    text.write_text(shakespeare.read_text()[:60_000])  # documents separated by blank lines
    run = tmp_path / "mine"
    proc = moetron("quickstart", "--input", str(text), "--nproc", "1", "--output-dir", str(run),
                   "--train-iters", "4", "--vocab-size", "500")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not (run / "corpus").exists()  # the user's text is used where it is
    assert (run / "iter_0000004" / ".metadata").is_file()
    assert not list((run / "iter_0000004").glob("model-ep*"))
    assert "vs unigram baseline" in proc.stdout
    assert "\n  moetron train --config " in proc.stdout  # one process: no torchrun in the continue command


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--nproc", "3"], "--nproc 3"),
        (["--input", "{tmp}/missing.jsonl"], "--input"),
        (["--train-iters", "0"], "--train-iters"),
        (["--config", "{tmp}/nope.yaml"], "--config"),
    ],
)
def test_bad_inputs_are_one_line_errors(tmp_path, capsys, args, expected):
    run = tmp_path / "never"
    rc = main(["quickstart", "--output-dir", str(run), *[a.format(tmp=tmp_path) for a in args]])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and expected in err and "Traceback" not in err
    assert not run.exists() or not any(run.iterdir())


def test_too_few_documents_for_a_validation_split(tmp_path, capsys):
    text = tmp_path / "one.txt"
    text.write_text("a single paragraph of text without any blank line, so one document\n" * 20)
    rc = main(["quickstart", "--input", str(text), "--nproc", "1", "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2 and "holds 1 document(s)" in err and "--split" in err
    assert not (tmp_path / "run" / "config.yaml").exists()  # not a run: the same --output-dir can be used again


def test_an_existing_run_is_not_overwritten(tmp_path, capsys):
    (tmp_path / "config.yaml").write_text("num_layers: 2\n")
    assert main(["quickstart", "--output-dir", str(tmp_path)]) == 2
    assert "already holds a quickstart run" in capsys.readouterr().err

"""A run directory continues with its own config.yaml in every documented way — after a plain run, after
`--overwrite`, after `--finetune`, after `--exit-interval` — and the continued run equals the uninterrupted one:
`moetron train --config RUN/config.yaml --load RUN --save RUN` gives metrics.jsonl and eval.jsonl losses
bit-identical to one run of the same total length."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_train_guards import TINY, write_dataset

from moetron.cli import main

TOTAL, FIRST = 6, 2
# the LR decays over a fixed horizon, so the first leg's shorter --train-iters leaves the schedule as it is
SCHEDULE = ["--lr", "1e-3", "--min-lr", "1e-5", "--lr-decay-iters", str(TOTAL)]
# measured, not computed: wall-clock rates and the process's peak memory (a resumed process starts with a smaller
# RSS than one that trained from step 1) are the only fields allowed to differ
TIMING = {"tokens_per_sec", "tflops", "mfu", "peak_memory_gib", "reserved_memory_gib", "baseline_memory_gib"}


def records(run: Path, name: str) -> list[dict]:
    lines = (run / name).read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in lines]


def train(*argv: str) -> None:
    assert main(["train", *argv]) == 0


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The data, a base run to fine-tune from, and the two uninterrupted runs the continuations must equal."""
    root = tmp_path_factory.mktemp("continuation")
    flags = [*TINY, "--data-path", write_dataset(root / "corpus_text_document"), *SCHEDULE]
    train(*flags, "--seed", "7", "--train-iters", str(FIRST), "--save", str(root / "base"))
    train(*flags, "--train-iters", str(TOTAL), "--save", str(root / "whole"))
    finetune = ["--finetune", "--load", str(root / "base")]
    train(*flags, "--train-iters", str(TOTAL), *finetune, "--save", str(root / "whole_finetune"))
    return root, flags


# way -> (flags of the first leg, flags the continuation adds to its config.yaml, the uninterrupted run)
WAYS = {
    "plain": ([], ["--train-iters", str(TOTAL)], "whole"),
    "after-overwrite": (["--overwrite"], ["--train-iters", str(TOTAL)], "whole"),
    "after-finetune": (["--finetune", "--load", "{base}"], ["--train-iters", str(TOTAL)], "whole_finetune"),
    "after-exit-interval": (["--train-iters", str(TOTAL), "--exit-interval", str(FIRST)], [], "whole"),
}


@pytest.mark.parametrize("way", list(WAYS))
def test_a_run_continued_with_its_own_config_equals_the_uninterrupted_run(world, tmp_path, capsys, way):
    root, flags = world
    first, more, uninterrupted = WAYS[way]
    first = [arg.format(base=root / "base") for arg in first]
    run = tmp_path / "run"
    if way == "after-overwrite":  # another run's output, which --overwrite deletes
        train(*flags, "--seed", "3", "--train-iters", "3", "--save", str(run))
    train(*flags, "--train-iters", str(FIRST), *first, "--save", str(run))
    assert sorted(p.name for p in run.glob("iter_*")) == ["iter_0000002"]

    train("--config", str(run / "config.yaml"), "--load", str(run), "--save", str(run), *more)
    capsys.readouterr()
    whole = root / uninterrupted
    assert [r["iteration"] for r in records(run, "metrics.jsonl")] == list(range(1, TOTAL + 1))
    assert records(run, "metrics.jsonl") == records(whole, "metrics.jsonl")  # losses, lr, grad norm: exact
    assert records(run, "eval.jsonl") == records(whole, "eval.jsonl")
    assert (run / "config.yaml").read_text() == (whole / "config.yaml").read_text().replace(str(whole), str(run))

"""A run directory is never destroyed by a run that did not write it; resuming keeps the checkpoint's LR schedule
(unless --override-opt-param-scheduler) and each iteration appears once in the logs; a garbage `latest` pointer
is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_train_guards import TINY, write_dataset

from moetron.cli import main

STEPS = ["--train-iters", "4", "--save-interval", "2", "--lr", "1e-3", "--min-lr", "1e-5"]


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def trained(tmp_path, capsys):
    prefix = write_dataset(tmp_path / "corpus_text_document")
    run = tmp_path / "run"
    assert main(["train", *TINY, "--data-path", prefix, *STEPS, "--save", str(run)]) == 0
    capsys.readouterr()
    return prefix, run


@pytest.mark.parametrize("load", [None, "typo"], ids=["no-load", "mistyped-load"])
def test_a_new_run_refuses_a_save_directory_holding_another_run(trained, tmp_path, capsys, load):
    prefix, run = trained
    before = snapshot(run)
    extra = ["--load", str(tmp_path / load)] if load else []
    assert main(["train", *TINY, "--data-path", prefix, *STEPS, "--save", str(run), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert f"--save {run} already holds another run's output (checkpoints up to iter_0000004)" in err
    assert f"--load {run}" in err and "--overwrite" in err
    assert snapshot(run) == before  # nothing renamed, pruned, rewound, overwritten or appended


def test_overwrite_deletes_the_previous_run_and_starts_fresh(trained, capsys):
    prefix, run = trained
    assert main(["train", *TINY, "--data-path", prefix, "--train-iters", "2", "--save", str(run), "--overwrite"]) == 0
    out = capsys.readouterr().out
    assert "--overwrite: deleting the previous run's checkpoints up to iter_0000004" in out
    assert sorted(p.name for p in run.glob("iter_*")) == ["iter_0000002"]
    assert [json.loads(line)["iteration"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def lrs(run: Path) -> dict[int, float]:
    return {r["iteration"]: r["lr"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def test_resuming_keeps_the_checkpoints_schedule_unless_overridden(trained, tmp_path, capsys):
    prefix, run = trained
    decayed = lrs(run)[4]
    longer = ["train", *TINY, "--data-path", prefix, *STEPS[2:], "--train-iters", "8", "--save", str(run)]
    assert main([*longer, "--load", str(run), "--save-interval", "100"]) == 0
    out = capsys.readouterr().out
    assert "LR schedule: the checkpoint's" in out and "--override-opt-param-scheduler" in out
    assert lrs(run)[5] == pytest.approx(1e-5) and decayed == pytest.approx(1e-5)  # stays at the decayed end

    other = tmp_path / "other"
    assert main(["train", *TINY, "--data-path", prefix, *STEPS, "--save", str(other)]) == 0
    assert main([*longer[:-1], str(other), "--load", str(other), "--override-opt_param-scheduler"]) == 0
    assert "LR schedule: this run's flags" in capsys.readouterr().out
    assert lrs(other)[5] > 1e-4  # the longer run's schedule: halfway through its decay


def test_a_resumed_run_logs_each_iteration_once(trained, capsys):
    prefix, run = trained
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    ghost = [json.dumps({**json.loads(lines[-1]), "iteration": 5}), '{"iteration": 6, "lm_lo']  # a crash mid-write
    metrics.write_text("\n".join(lines + ghost) + "\n")
    (run / "latest").write_text("iter_0000004\n")
    assert main(["train", *TINY, "--data-path", prefix, *STEPS[2:], "--train-iters", "6", "--save", str(run),
                 "--load", str(run), "--save-interval", "100"]) == 0  # fmt: skip
    assert [json.loads(line)["iteration"] for line in metrics.read_text().splitlines()] == [1, 2, 3, 4, 5, 6]


def test_garbage_in_latest_is_one_line(trained, capsys):
    prefix, run = trained
    (run / "latest").write_bytes(b"\x00\xff garbage\n")
    assert main(["train", *TINY, "--data-path", prefix, *STEPS, "--save", str(run), "--load", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "latest does not name a checkpoint" in err

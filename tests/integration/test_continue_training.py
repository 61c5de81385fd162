"""Training on from a finished run: the LR schedule stretched to the new stop (Megatron's
`--override-opt_param-scheduler`), a warning when a longer run would keep the finished one, and no silent
"success" when the stop is before the checkpoint (a finished run resumed as it was exits 0 with one line)."""

from __future__ import annotations

import json
import shlex

import numpy as np
import pytest

from moetron.cli import main
from moetron.data.indexed import IndexedDatasetBuilder
from moetron.train.schedule import ScheduleSpec, lr_at

GBS = 2
TINY = (
    "--num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 8 --micro-batch-size 2 "
    f"--global-batch-size {GBS} --vocab-size 64 --log-interval 1 --eval-iters 0 --lr 1e-3 --min-lr 1e-4 "
    "--lr-decay-style cosine --lr-warmup-iters 1"
).split()


def lrs(run) -> dict[int, float]:
    return {r["iteration"]: r["lr"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("continue")
    with IndexedDatasetBuilder(base / "corpus_text_document", np.uint16) as builder:
        rng = np.random.default_rng(0)
        for _ in range(40):
            builder.add_document(rng.integers(0, 64, 40))
        builder.finalize()
    flags = [*TINY, "--data-path", str(base / "corpus_text_document")]
    assert main(["train", *flags, "--train-iters", "4", "--save", str(base / "run")]) == 0
    return base, flags


def test_train_iters_beyond_the_checkpoint_stretches_the_schedule_with_override(finished_run, capsys, tmp_path):
    base, flags = finished_run
    capsys.readouterr()
    kept, stretched = tmp_path / "kept", tmp_path / "stretched"
    resume = ["train", *flags, "--train-iters", "8", "--load", str(base / "run")]
    assert main([*resume, "--save", str(kept)]) == 0
    warning = [line for line in capsys.readouterr().out.splitlines() if "warning: the LR schedule" in line]
    assert len(warning) == 1 and "iterations 5-8 train at the minimum LR 0.0001" in warning[0], warning
    assert "add --override-opt-param-scheduler" in warning[0]
    assert set(lrs(kept).values()) == {1e-4}  # the finished schedule: every new iteration at min LR
    assert main([*resume, "--save", str(stretched), "--override-opt-param-scheduler"]) == 0
    assert "warning: the LR schedule" not in capsys.readouterr().out
    # the schedule of an 8-iteration run (the log's lr: after each iteration's step, as Megatron's)
    spec = ScheduleSpec(max_lr=1e-3, min_lr=1e-4, decay_style="cosine", warmup_steps=GBS, decay_steps=8 * GBS)
    expected = {it: lr_at(spec, it * GBS, 0) for it in range(5, 9)}
    assert lrs(stretched) == pytest.approx(expected, rel=1e-12)
    assert lrs(stretched)[5] > 4e-4 and lrs(stretched)[8] == pytest.approx(1e-4)


def test_a_stop_before_the_checkpoint_is_refused_with_the_continuation_flags(finished_run, capsys):
    base, flags = finished_run
    code = main(["train", *flags, "--train-iters", "3", "--load", str(base / "run"), "--save", str(base / "run")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("error:") == 1, err
    assert "is at iteration 4 and this run stops at iteration 3, before it: nothing to train" in err
    assert "--train-iters 8 --override-opt-param-scheduler" in err
    assert sorted(p.name for p in (base / "run").glob("iter_*")) == ["iter_0000004"]  # nothing written


def test_a_finished_run_resumed_as_it_was_exits_0_with_the_command_that_trains_longer(finished_run, capsys, tmp_path):
    """A requeue of a finished job (the same --train-iters, --load = --save): zero iterations and exit 0, as
    Megatron; one line on stderr whose command really trains on, with the schedule stretched."""
    base, flags = finished_run
    run = base / "run"
    before = sorted(p.name for p in run.iterdir()), (run / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(["train", *flags, "--train-iters", "4", "--load", str(run), "--save", str(run)]) == 0
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and "error" not in err and "warning" not in err, err
    assert err.startswith(f"run already finished at iteration 4 (--load {run}); nothing to train; to train longer: ")
    assert (sorted(p.name for p in run.iterdir()), (run / "metrics.jsonl").read_text()) == before  # untouched
    command = shlex.split(err.split("to train longer: ", 1)[1])
    assert command[:2] == ["moetron", "train"] and command[-2:] == ["8", "--override-opt-param-scheduler"]
    assert main([*command[1:], "--save", str(tmp_path / "longer")]) == 0  # (its own --save would extend `run`)
    assert sorted(lrs(tmp_path / "longer")) == [5, 6, 7, 8] and lrs(tmp_path / "longer")[5] > 4e-4  # stretched

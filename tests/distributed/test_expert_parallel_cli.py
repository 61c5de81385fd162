"""`torchrun --nproc-per-node 2 -m moetron train ... --moe-expert-parallel-size 2` end to end on a tiny corpus.

The 2-process EP run trains, logs and writes one model/optim file per expert shard; a single process then
resumes that checkpoint with EP = 1 (the experts reshard on load) and finishes; an impossible EP size is one
clear error before anything is written.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from cli_support import ENV, moetron_train, shakespeare_corpus_flags

TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--global-batch-size 8 --num-experts 4 --topk 2 --lr 3e-3 --lr-warmup-iters 2 --log-interval 5 "
    "--eval-iters 1 --eval-interval 10 --hidden-dropout 0 --attention-dropout 0"
).split()


@pytest.fixture
def corpus_flags(tmp_path, shakespeare, gpt2_files):
    return shakespeare_corpus_flags(tmp_path, shakespeare, gpt2_files, chars=40_000)


@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_expert_parallel_train_then_resume_on_one_process(tmp_path, corpus_flags):
    run = tmp_path / "run"
    common = [*TINY, *corpus_flags, "--save", str(run)]
    proc = moetron_train(*common, "--train-iters", "10", "--moe-expert-parallel-size", "2", nproc=2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f" iteration {10:>7d}/10 |" in proc.stdout
    checkpoint = run / "iter_0000010"
    assert sorted(p.name for p in checkpoint.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]  # both ranks wrote
    assert (checkpoint / ".metadata").is_file() and (checkpoint / "state.json").is_file()
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert evals and all(np.isfinite(e["valid_loss"]) for e in evals)

    resumed = moetron_train(*common, "--train-iters", "12", "--load", str(run))  # EP = 1, one process
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "loaded checkpoint" in resumed.stdout and "iteration 10" in resumed.stdout
    assert (run / "latest").read_text().strip() == "iter_0000012"


def test_impossible_expert_parallel_size_is_one_clear_error(tmp_path, corpus_flags):
    run = tmp_path / "never"
    env = {**ENV, "WORLD_SIZE": "2"}  # what torchrun announces; the check runs before any process group
    args = [*TINY, *corpus_flags, "--train-iters", "2", "--save", str(run), "--moe-expert-parallel-size", "3"]
    proc = moetron_train(*args, env=env)
    assert proc.returncode == 2
    assert "--moe-expert-parallel-size 3" in proc.stderr and "Traceback" not in proc.stderr
    assert not run.exists()

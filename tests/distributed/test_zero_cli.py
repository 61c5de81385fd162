"""`torchrun --nproc-per-node 2 -m moetron train ... --zero-stage 3` end to end, a resume on one process with
Megatron's `--use-distributed-optimizer`, and an impossible stage as one clear error before anything starts."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_expert_parallel_cli import ENV, TINY, corpus_flags, moetron_train  # noqa: F401 (a fixture)


@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_zero_3_with_experts_then_resume_with_the_distributed_optimizer(tmp_path, corpus_flags):  # noqa: F811
    run = tmp_path / "run"
    common = [*TINY, *corpus_flags, "--save", str(run), "--bf16"]
    zero3 = ["--zero-stage", "3", "--moe-expert-parallel-size", "2", "--checkpoint-activations"]
    proc = moetron_train(*common, "--train-iters", "10", *zero3, nproc=2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f" iteration {10:>7d}/10 |" in proc.stdout
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records and all(np.isfinite(r["lm_loss"]) and np.isfinite(r["grad_norm"]) for r in records)
    assert sorted(p.name for p in (run / "iter_0000010").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]

    resumed = moetron_train(*common, "--train-iters", "12", "--load", str(run), "--use-distributed-optimizer")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "loaded checkpoint" in resumed.stdout and "iteration 10" in resumed.stdout
    assert (run / "latest").read_text().strip() == "iter_0000012"


def test_an_unknown_zero_stage_is_one_clear_error(tmp_path, corpus_flags):  # noqa: F811
    run = tmp_path / "never"
    env = {**ENV, "WORLD_SIZE": "2"}  # what torchrun announces; the check runs before any process group
    proc = moetron_train(*TINY, *corpus_flags, "--train-iters", "2", "--save", str(run), "--zero-stage", "4", env=env)
    assert proc.returncode == 2
    assert "--zero-stage 4 is not one of 0, 1, 2, 3" in proc.stderr and "Traceback" not in proc.stderr
    assert not run.exists()

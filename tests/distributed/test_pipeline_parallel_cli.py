"""`torchrun --nproc-per-node 2 -m moetron train ... --pipeline-model-parallel-size 2` end to end, and failures.

The 2-stage run trains on a tiny corpus, logs, evaluates and saves; one process resumes the checkpoint at PP = 1.
A bad pipeline flag is one clear error before anything starts. A failure on the last stage only (a label no
vocabulary has, so the loss fails on rank 1 while rank 0 waits in a receive from it) ends both stages quickly
with exactly one `error:` line naming the stage.

This file is also the worker torchrun runs for the failure: `python test_pipeline_parallel_cli.py RUN_DIR`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import test_expert_parallel_cli as ep_cli

HERE = Path(__file__).resolve().parent

ENV, moetron_train = ep_cli.ENV, ep_cli.moetron_train  # `moetron train`, under torchrun when nproc > 1
corpus_flags = ep_cli.corpus_flags  # the same tiny-corpus fixture (a 40 kB tinyshakespeare dataset)

TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--global-batch-size 8 --num-experts 4 --expert-interval 1 --topk 2 --lr 3e-3 --lr-warmup-iters 2 "
    "--log-interval 5 --eval-iters 1 --eval-interval 5 --pipeline-model-parallel-size 2"
).split()


def torchrun(*args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    return subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=300)


@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_pipeline_train_resume_on_one_process_and_bad_flags(tmp_path, corpus_flags):
    run = tmp_path / "run"
    common = [*TINY, *corpus_flags, "--save", str(run)]
    proc = moetron_train(*common, "--train-iters", "10", nproc=2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f" iteration {10:>7d}/10 |" in proc.stdout and "load max/mean" in proc.stdout
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(records[-1]["expert_load_max_over_mean"]) == 2  # both MoE layers, one on each stage, logged on rank 0
    assert all(np.isfinite(r["lm_loss"]) and r["moe_loss"] > 0 for r in records)
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert len(evals) == 2 and all(np.isfinite(e["valid_loss"]) for e in evals)

    one_process = ["--load", str(run), "--pipeline-model-parallel-size", "1"]
    resumed = moetron_train(*common, "--train-iters", "12", *one_process)
    assert resumed.returncode == 0 and "loaded checkpoint" in resumed.stdout, resumed.stderr[-3000:]
    assert "iteration 10" in resumed.stdout and (run / "latest").read_text().strip() == "iter_0000012"

    # a bad pipeline flag: one clear error before any process group (WORLD_SIZE is what torchrun announces)
    never = tmp_path / "never"
    args = [*TINY, *corpus_flags, "--train-iters", "2", "--save", str(never), "--num-layers", "3"]
    bad = moetron_train(*args, env={**ENV, "WORLD_SIZE": "2"})
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and not never.exists(), bad.stderr
    assert "--num-layers 3 is not divisible by --pipeline-model-parallel-size 2" in bad.stderr


# ---------------------------------------------------------------- one stage fails
def worker(run_dir: str) -> int:
    """PP = 2 on an in-memory corpus whose iteration-3 batch holds a label no vocabulary has (last position only:
    it is never an input token), so only the last stage's loss fails; the rest is what `moetron train` does."""
    sys.path[:0] = [str(HERE), str(HERE.parent / "unit")]
    import torch
    from trainer_support import VOCAB, MemoryLoader, parallel_model, random_samples, tiny_config

    from moetron.cli import report_user_error
    from moetron.errors import UserError
    from moetron.parallel.env import init_distributed
    from moetron.train.trainer import Trainer

    torch.set_num_threads(1)
    env = init_distributed(backend="gloo", timeout_minutes=2)
    cfg = tiny_config(micro_batch_size=2, global_batch_size=8, train_iters=6, log_interval=1, save=run_dir)
    cfg.parallel.pipeline_model_parallel_size = 2
    parallel = parallel_model(cfg, env)
    mesh = parallel.mesh
    samples = random_samples(512)
    samples[2 * 8 + 3, -1] = VOCAB + 200  # iteration 3 reads samples 16 … 23
    loader = MemoryLoader(samples, cfg.train.micro_batch_size, mesh.coords.dp, mesh.size("dp"))
    trainer = Trainer(cfg, env, parallel, loader, None, config_yaml="# test\n")
    try:
        returncode = trainer.train()
    except UserError as err:
        returncode = report_user_error(err)
    env.close()
    return returncode


@pytest.mark.distributed
@pytest.mark.slow
def test_a_failure_on_one_stage_stops_every_stage_with_one_error_line(tmp_path):
    proc = torchrun(__file__, str(tmp_path / "run"))
    assert proc.returncode != 0
    log = proc.stdout + proc.stderr
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    # the fused head + cross-entropy reads the label's logit: out of range is a RuntimeError, moetron's CPU kernel's
    # (it names the label, the row and the vocabulary) or, where the kernels do not load, torch's gather's
    failure = "pipeline stage 1 of 2 (rank 1) failed: RuntimeError: "
    out_of_range = ("label 296 of row 31 is outside the vocabulary of 96", "index 296 is out of bounds")
    assert errors == [errors[0]] and failure in errors[0], log[-3000:]
    assert any(reason in errors[0] for reason in out_of_range), errors[0]
    assert "[rank0]" not in log and "[rank1]" not in log  # no rank printed a traceback (torchrun's summary follows)
    assert sum(log.count(reason) for reason in out_of_range) == 1
    assert " iteration       2/6 |" in proc.stdout and " iteration       3/6 |" not in proc.stdout


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1]))

"""A failure on one pipeline stage under torchrun (training and resuming in each layout:
test_torchrun_then_one_process.py). A failure on the last stage only (a label no vocabulary has, so the loss fails
on rank 1 while rank 0 waits in a receive from it) ends both stages quickly with exactly one `error:` line naming
the stage.

This file is also the worker torchrun runs for the failure: `python test_pipeline_stage_failure.py RUN_DIR`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from cli_support import ENV

HERE = Path(__file__).resolve().parent


def torchrun(*args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    return subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=300)


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

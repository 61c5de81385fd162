"""A rank that dies mid-run under `torchrun --max-restarts 1` (EP = 2 on 2 processes): the restarted job
resumes from the last checkpoint and finishes with the loss curve of an uninterrupted run.

The fault is injected by this file's worker (the trainer has no test hooks): with MOETRON_FAULT_AT_ITER=7 rank 1
`os._exit(1)`s as iteration 7 starts, on the first attempt only (TORCHELASTIC_RESTART_COUNT=0); rank 0 is then
inside step 7's collectives.
Checkpoints every 2 iterations, so the restart resumes from iteration 6 and redoes 7 … 10.

This file is also the worker torchrun runs: `python test_expert_parallel_fault.py RUN_DIR`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ITERS, FAULT_AT, SAVE_INTERVAL = 10, 7, 2


def worker(run_dir: str) -> int:
    sys.path[:0] = [str(HERE), str(HERE.parent / "unit")]
    import torch
    from test_expert_parallel_train import ep_config, ep_trainer

    from moetron.checkpoint import resolve_checkpoint
    from moetron.parallel.env import init_distributed

    torch.set_num_threads(1)
    env = init_distributed(backend="gloo", timeout_minutes=1)
    cfg = ep_config(2, global_batch=4, train_iters=ITERS, save=run_dir, save_interval=SAVE_INTERVAL, log_interval=1)
    trainer = ep_trainer(cfg, env)
    inject_fault(trainer, env.rank)
    checkpoint = resolve_checkpoint(run_dir)
    if checkpoint is not None:
        trainer.load(checkpoint)
        if env.is_main:
            print(f"resumed from {checkpoint.name} at iteration {trainer.progress.iteration}", flush=True)
    try:
        returncode = trainer.train()
    except BaseException:
        env.close()
        raise
    return env.finish(returncode)  # as `moetron train` ends a torchrun job


def inject_fault(trainer, rank: int) -> None:
    """Rank 1 dies (no cleanup) as iteration MOETRON_FAULT_AT_ITER starts, on torchrun's first attempt only."""
    fault_at = os.environ.get("MOETRON_FAULT_AT_ITER")
    if not fault_at or rank != 1 or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    step = trainer.train_step

    def step_or_die():
        if trainer.progress.iteration + 1 == int(fault_at):
            os._exit(1)
        return step()

    trainer.train_step = step_or_die


def launch(run_dir: Path, fault_at: int | None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MOETRON_FAULT_AT_ITER", None)
    if fault_at is not None:
        env["MOETRON_FAULT_AT_ITER"] = str(fault_at)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["--max-restarts", "1", "--monitor-interval", "0.5", __file__, str(run_dir)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)


def logged_losses(run_dir: Path) -> dict[int, float]:
    """iteration → lm loss from metrics.jsonl (a resumed run appends the redone iterations; the last wins)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r["lm_loss"] for r in records}


@pytest.mark.distributed
@pytest.mark.slow
def test_rank_failure_restarts_and_resumes_from_last_checkpoint(tmp_path):
    faulty = launch(tmp_path / "faulty", FAULT_AT)
    assert faulty.returncode == 0, faulty.stdout[-3000:] + faulty.stderr[-3000:]
    log = faulty.stdout + faulty.stderr
    assert f"resumed from iter_{FAULT_AT - 1:07d} at iteration {FAULT_AT - 1}" in log, log[-3000:]
    straight = launch(tmp_path / "straight", None)
    assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-3000:]
    resumed, reference = logged_losses(tmp_path / "faulty"), logged_losses(tmp_path / "straight")
    assert sorted(resumed) == list(range(1, ITERS + 1))
    assert resumed == reference  # bit-identical: weights, optimizer, data position and RNG all resumed
    assert (tmp_path / "faulty" / "latest").read_text().strip() == f"iter_{ITERS:07d}"


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1]))

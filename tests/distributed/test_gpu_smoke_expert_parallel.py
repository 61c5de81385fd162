"""benchmarks/gpu_smoke.py's two-GPU form, `torchrun --nproc-per-node 2 benchmarks/gpu_smoke.py`, on 2 CPU
processes with the tiny seed model: the experts split over the ranks (EP 2), rank 0 prints one report."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from cli_support import ENV

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.distributed
@pytest.mark.slow
def test_two_processes_split_the_experts_and_rank_zero_reports():
    flags = ["--device", "cpu", "--tiny", "--recipe", "seed-2x4090-moe128", "--no-compile", "--warmup", "1"]
    flags += ["--steps", "1", "--check-steps", "1"]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    done = subprocess.run([*launcher, str(REPO / "benchmarks" / "gpu_smoke.py"), *flags], capture_output=True,
                          text=True, env={**ENV, "PYTHONPATH": str(REPO / "src")}, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stdout.count("expert parallel 2 over 2 GPUs") == 1 and "tokens/s" in done.stdout
    assert "loss check against CPU fp32: one GPU only" in done.stdout

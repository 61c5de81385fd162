"""benchmarks/gpu_smoke.py: without CUDA it skips with one line; its whole flow (bf16 run, timing, the loss check
against CPU fp32) runs on CPU with a tiny model of the same family."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_skips_cleanly_without_cuda():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO / "src"))
    out = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_smoke.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("gpu_smoke: skipped — no CUDA device")
    assert len(out.stdout.strip().splitlines()) == 1


@pytest.mark.slow
def test_the_flow_runs_on_cpu_with_a_tiny_model(capsys, monkeypatch):
    monkeypatch.syspath_prepend(REPO / "benchmarks")  # the benchmark under test, not a helper
    import gpu_smoke

    argv = ["--device", "cpu", "--tiny", "--no-compile", "--warmup", "1", "--steps", "1", "--check-steps", "2"]
    assert gpu_smoke.main(argv) == 0
    out = capsys.readouterr().out
    assert "bf16=True" in out and "tokens/s" in out
    worst = float(re.search(r"max relative difference (\S+)", out).group(1))
    assert worst < 1e-2  # bf16 against fp32, same weights and batches

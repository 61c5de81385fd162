"""`moetron plan --search --measure --top 3` end to end on 4 gloo processes: the search's top 3 layouts of a tiny MoE
are trained for a few steps under torchrun, and the measurements are compared with the predictions.

The search is narrowed with flags (each fixes a dimension: TP 1, PP 1, ZeRO 0, EP 1), so its top 3 are data
parallelism over the 4 ranks at micro batch 4, micro batch 2, and micro batch 4 with activation checkpointing.
The test checks the search's ranking (the pair with the largest predicted ratio is checkpointing on vs off at
micro batch 4, ~1.33×: a third more compute, the forward recomputed) and that every row was measured, and prints
the measured step times (each rank's CPU time, the slowest rank's median, `moetron.plan.measure_worker`, beside
the wall clock) without comparing them: on a 2-core machine shared by the 4 ranks and other jobs, even CPU time
moved enough for the 1.33× pair to measure 0.85× once, and timing thresholds stay out of tests.
Predicted vs measured peak memory: within 25 % for every row (VmHWM above a baseline run, plan/measure.py).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from cli_support import ENV

TOLERANCE = 0.25
TINY_MOE = {
    "num_layers": 4,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "seq_length": 128,
    "vocab_size": 8192,
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
    "num_experts": 4,
    "expert_interval": 2,
    "topk": 2,
    "moe_token_dropping": True,
    "micro_batch_size": 4,
    "global_batch_size": 16,
    "train_iters": 10,
    "lr": 1.0e-3,
}
FIXED = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--zero-stage", "0"]
FIXED += ["--moe-expert-parallel-size", "1"]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="VmHWM and MALLOC_MMAP_THRESHOLD_ are Linux/glibc's")
def test_search_measure_top3_on_four_gloo_processes(tmp_path):
    from moetron.config_cli import load_config
    from moetron.plan.measure import random_corpus
    from moetron.validate import validate

    config = tmp_path / "tiny-moe.yaml"
    config.write_text(yaml.safe_dump({**TINY_MOE, "data_path": [random_corpus(tmp_path, 8192, 1 << 16)]}))
    command = [sys.executable, "-m", "moetron", "plan", "--config", str(config), "--gpus", "4", "--gpu-type", "cpu"]
    command += ["--gpu-memory", "8GB", "--search", "--measure", "--top", "3", "--measure-steps", "4"]
    proc = subprocess.run([*command, *FIXED, "--json"], capture_output=True, text=True, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads(proc.stdout)["rows"]
    assert len(rows) == 3
    lines = []
    for row in rows:
        measured = row["measured"]
        assert not measured["error"], row
        ratio = row["peak_bytes"] / measured["peak_bytes"]
        lines.append(
            f"#{row['predicted_rank']} {row['words']}: peak planned {row['peak_bytes'] / 2**20:.1f} MiB, measured "
            f"{measured['peak_bytes'] / 2**20:.1f} MiB (ratio {ratio:.2f}); step predicted "
            f"{row['step_time_s'] * 1e3:.0f} ms, measured {measured['step_time_s'] * 1e3:.0f} ms wall clock, "
            f"{measured['cpu_step_s'] * 1e3:.0f} ms CPU time"
        )
        assert row["command"].startswith("torchrun --nproc-per-node 4 -m moetron train --config ")
        cfg, _ = load_config(str(config), flag_overrides(row["flags"]))
        assert validate(cfg, 4) == [], row["flags"]  # `moetron train` accepts the layout as printed
    summary = "\n".join(lines)
    print(summary)  # `pytest -s` shows the numbers
    for row, line in zip(rows, lines, strict=True):
        assert abs(row["peak_bytes"] / row["measured"]["peak_bytes"] - 1) <= TOLERANCE, f"{line}\n{summary}"

    # the clearest pair: the largest predicted ratio of step times among the measured rows
    fast, slow = max(
        ((a, b) for a in rows for b in rows if a["step_time_s"] < b["step_time_s"]),
        key=lambda pair: pair[1]["step_time_s"] / pair[0]["step_time_s"],
    )
    assert (fast["words"], slow["words"]) == ("dp4 mbs4", "dp4 mbs4 ckpt"), summary
    # measured step times are reported, not compared: which of two runs is faster on a shared 2-core machine is a
    # timing threshold (the ~1.33x predicted gap measured 0.85x once under load), which tests must not hold
    for row in rows:
        assert 0 < row["measured"]["cpu_step_s"] < float("inf"), row
        assert 0 < row["measured"]["step_time_s"] < float("inf"), row


def flag_overrides(flags: list[str]) -> dict:
    """The search's flags as `load_config` overrides, parsed the way `moetron train` parses them."""
    import argparse

    from moetron.config_cli import add_config_arguments, cli_overrides

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return cli_overrides(parser.parse_args(flags))

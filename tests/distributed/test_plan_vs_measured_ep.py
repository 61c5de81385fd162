"""`moetron plan`'s memory model against real training steps with expert parallelism: the quickstart's own layout.

tests/integration/test_plan_vs_measured.py compares the plan with one process at EP 1; the quickstart trains
with 2 processes and EP 2 (configs/quickstart.yaml), where each rank holds half of every MoE layer's experts
and routes tokens through all-to-all. This test measures that layout the same way: the quickstart config with
a ~8k vocabulary, 2 gloo processes (fresh, spawned), each building its EP shard (the meta-device recipe),
materialising the AdamW state, running one steady-state `Trainer.train_step`, and reporting VmHWM. A
baseline group of 2 processes does the same with a tiny EP-2 model (torch, moetron, gloo and thread pools
loaded, nothing big allocated); the planned per-rank peak (world size 2, EP 2, CPU) is compared with the
largest `peak(rank) - peak(baseline rank)`. Both groups run with `MALLOC_MMAP_THRESHOLD_=65536` (see the
integration test's docstring for why).
"""

from __future__ import annotations

import sys

import pytest
from launch import run_distributed
from test_plan_vs_measured import (
    BASELINE,
    QUICKSTART,
    TOLERANCE,
    load,
    peak_after_steady_step,
)

WORLD_SIZE, EP = 2, 2
CASE = ("configs/quickstart.yaml", {"vocab_size": 8192, "moe_expert_parallel_size": EP})
EP_BASELINE = (BASELINE[0], {**BASELINE[1], "moe_expert_parallel_size": EP, "global_batch_size": WORLD_SIZE})


def measure_rank(rank: int, world_size: int, config: str, overrides: dict) -> int:
    """Peak RSS (bytes) of this rank after one steady-state training step of its EP shard."""
    from random_tokens import RandomTokenLoader
    from trainer_support import parallel_model

    from moetron.parallel.env import init_distributed
    from moetron.train.trainer import Trainer

    env = init_distributed()
    cfg = load(config, overrides)
    parallel = parallel_model(cfg, env)
    loader = RandomTokenLoader(cfg.train.micro_batch_size, cfg.model.seq_length, cfg.model.vocab_size)
    trainer = Trainer(cfg, env, parallel, loader, None, config_yaml="# test\n")
    return peak_after_steady_step(trainer, parallel.model)


def measure_group(config: str, overrides: dict) -> list[int]:
    return run_distributed(measure_rank, world_size=WORLD_SIZE, args=(config, overrides), timeout=120)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="VmHWM and MALLOC_MMAP_THRESHOLD_ are Linux/glibc's")
@pytest.mark.skipif(not QUICKSTART.is_file(), reason="needs configs/quickstart.yaml")
def test_planned_peak_memory_matches_an_expert_parallel_step(monkeypatch):
    import torch

    from moetron.plan.estimate import make_plan
    from moetron.plan.hardware import accelerator

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # read by glibc at start-up: the spawned ranks inherit it
    baseline = measure_group(*EP_BASELINE)
    peaks = measure_group(*CASE)
    measured = max(peak - base for peak, base in zip(peaks, baseline, strict=True))

    cfg = load(*CASE)
    # the plan counts a CPU process's fused-head chunks at its thread count: the ranks' (tests/support/launch.py runs
    # each on one thread), not this process's
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plan = make_plan(cfg, WORLD_SIZE, accelerator("cpu", "64GB"))
    finally:
        torch.set_num_threads(previous)
    assert (plan.dims.ep, plan.dims.world_size) == (EP, WORLD_SIZE)
    ratio = plan.memory.peak / measured
    summary = (
        f"quickstart EP {EP} on {WORLD_SIZE} ranks: planned {plan.memory.peak / 2**20:.1f} MiB per rank, "
        f"measured {measured / 2**20:.1f} MiB (ratio {ratio:.2f}; ranks "
        f"{[round((p - b) / 2**20, 1) for p, b in zip(peaks, baseline, strict=True)]} MiB above baselines "
        f"{[round(b / 2**20) for b in baseline]} MiB)"
    )
    print(summary)  # `pytest -s` shows the numbers
    assert abs(ratio - 1) <= TOLERANCE, f"{summary}; planned parts: {plan.memory.to_dict()}"

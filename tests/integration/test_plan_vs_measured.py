"""`moetron plan`'s memory model against the peak memory of real training steps on this CPU.

Method: each measurement runs in a fresh Python process (this file, run as a script) that builds the model,
materialises the AdamW state (one step on zero gradients, so the measured step is a steady-state one), then
runs one real optimizer step through `Trainer.train_step` (accumulation, loss, backward, clipping, AdamW),
and reports `VmHWM` from /proc/self/status: the peak resident set size of its own address space. (Not
`ru_maxrss`: Linux carries the parent's peak RSS over vfork + exec into the child's, so after other tests
have grown the pytest process it would read the parent's peak.) A baseline process does the same with a
tiny model (torch, moetron, kernels and thread pools loaded, nothing big allocated); the planned peak is
compared with `peak(run) - peak(baseline)`. Both run with `MALLOC_MMAP_THRESHOLD_=65536`, so glibc serves
every allocation of 64 KiB or more with mmap and gives it back on free: the RSS then follows the live
tensors instead of whatever the heap kept from earlier allocations (without it the peak drifts up by tens
of MB). tracemalloc does not see torch's allocations, hence RSS.

Configs (both fp32, one process, EP 1, as moetron trains on a CPU):
  quickstart   configs/quickstart.yaml with a ~8k vocabulary, EP 1 instead of its 2 processes' EP 2 (where
               that file is absent: 4 layers, hidden 128, 8 experts, seq 128, micro batch 4, vocab 8192).
  seed-2x4090  configs/seed-2x4090-moe128.yaml shrunk for a CPU: seq 256 instead of 2048, EP 1 (all 128
               experts in one process), fp32 instead of fp16, global batch 8 = the per-GPU share of 16
               (2 micro-batches of 4, as each of the two GPUs runs them). About 35 s of CPU: marked slow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SUPPORT = REPO / "tests" / "support"  # random_tokens, for the measured subprocess
TOLERANCE = 0.25
QUICKSTART = REPO / "configs" / "quickstart.yaml"
# the brief's stand-in when the quickstart's own config is absent: a small MoE with a ~8k vocabulary
QUICKSTART_LIKE = {
    "num_layers": 4,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "seq_length": 128,
    "num_experts": [8],
    "micro_batch_size": 4,
    "global_batch_size": 8,
    "train_iters": 10,
    "vocab_size": 8192,
    "moe_expert_parallel_size": 1,
    "checkpoint_activations": False,
    "fp16": False,
}
CASES = {
    "quickstart": ("configs/quickstart.yaml", {"vocab_size": 8192, "moe_expert_parallel_size": 1}),
    "seed-2x4090": (
        "configs/seed-2x4090-moe128.yaml",
        {"seq_length": 256, "moe_expert_parallel_size": 1, "fp16": False, "global_batch_size": 8},
    ),
}
if not QUICKSTART.is_file():
    CASES["quickstart"] = ("configs/seed-2x4090-moe128.yaml", QUICKSTART_LIKE)
BASELINE = (  # torch, moetron, kernels and thread pools loaded; nothing big allocated
    "configs/seed-2x4090-moe128.yaml",
    {
        "num_experts": [2],
        "fp16": False,
        "num_layers": 2,
        "hidden_size": 16,
        "seq_length": 8,
        "vocab_size": 64,
        "micro_batch_size": 1,
        "global_batch_size": 1,
        "moe_expert_parallel_size": 1,
    },
)


# ---------------------------------------------------------------------------- the measuring process
def load(config: str, overrides: dict):
    from moetron.config_cli import load_config

    cfg, _ = load_config(str(REPO / config), overrides)
    return cfg


def measure_in_this_process(config: str, overrides: dict) -> int:
    """Peak RSS (bytes) after one steady-state training step of the config."""
    import torch
    from random_tokens import RandomTokenLoader

    from moetron.parallel.env import DistEnv
    from moetron.parallel.mesh import ParallelMesh
    from moetron.parallel.parallelize import build
    from moetron.train.trainer import Trainer

    torch.set_num_threads(2)
    cfg = load(config, overrides)
    env = DistEnv()
    parallel = build(cfg, ParallelMesh.build(cfg.dims(1), env), env.device)
    loader = RandomTokenLoader(cfg.train.micro_batch_size, cfg.model.seq_length, cfg.model.vocab_size)
    trainer = Trainer(cfg, env, parallel, loader)
    return peak_after_steady_step(trainer, parallel.model)


def peak_after_steady_step(trainer, model) -> int:
    """Peak RSS after one training step whose Adam moments already exist (a steady step, as in a long run)."""
    import torch  # in the measured subprocess only (the parent's baseline stays free of it)

    model.train()
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.train_step()
    return peak_rss()


def peak_rss() -> int:
    """VmHWM: the high-water mark of this process's resident memory, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError("no VmHWM in /proc/self/status")


def measure(config: str, overrides: dict) -> int:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "2"}
    env["PYTHONPATH"] = os.pathsep.join([str(SUPPORT), env.get("PYTHONPATH", "")])  # a script: no pytest pythonpath
    out = subprocess.run(
        [sys.executable, __file__, json.dumps([config, overrides])],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------- the test
@pytest.fixture(scope="module")
def baseline_rss() -> int:
    return measure(*BASELINE)


@pytest.mark.skipif(sys.platform != "linux", reason="VmHWM and MALLOC_MMAP_THRESHOLD_ are Linux/glibc's")
@pytest.mark.parametrize(
    "case", [pytest.param(name, marks=[pytest.mark.slow] if name == "seed-2x4090" else []) for name in CASES]
)
def test_planned_peak_memory_matches_a_real_step(case, baseline_rss):
    from moetron.plan.estimate import make_plan
    from moetron.plan.hardware import accelerator

    config, overrides = CASES[case]
    cfg = load(config, overrides)
    plan = make_plan(cfg, 1, accelerator("cpu", "64GB"))
    measured = measure(config, overrides) - baseline_rss
    ratio = plan.memory.peak / measured
    summary = (
        f"{case}: planned {plan.memory.peak / 2**20:.0f} MiB, measured {measured / 2**20:.0f} MiB "
        f"(ratio {ratio:.2f}; baseline {baseline_rss / 2**20:.0f} MiB)"
    )
    print(summary)  # `pytest -s` shows the numbers
    assert abs(ratio - 1) <= TOLERANCE, f"{summary}; planned parts: {plan.memory.to_dict()}"


if __name__ == "__main__":
    config_path, config_overrides = json.loads(sys.argv[1])
    print(measure_in_this_process(config_path, config_overrides))

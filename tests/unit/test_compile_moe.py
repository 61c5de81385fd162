"""`--compile` inside MoE blocks: the local dispatch is compiled everywhere; the experts join the compiled graph only
where they are one grouped GEMM per projection (CUDA, bf16, sm90/sm100). The traced-experts path is exercised on CPU
in bf16 (torch._grouped_mm has a bf16 fake-tensor rule there too) and must train like eager."""

from __future__ import annotations

import pytest
import torch
from trainer_support import MemoryLoader, random_samples, run_losses, tiny_config

from moetron.model.moe.experts.grouped import GroupedExperts
from moetron.parallel import compile as compile_module
from moetron.parallel.env import DistEnv
from moetron.parallel.mesh import ParallelMesh
from moetron.parallel.parallelize import build
from moetron.train.trainer import Trainer


def experts(backend: str = "auto") -> GroupedExperts:
    with torch.device("meta"):
        return GroupedExperts(8, 256, 512, swiglu=True, bias=False, backend=backend)


@pytest.mark.parametrize(
    "capability, dtype, backend, traceable",
    [
        ((9, 0), torch.bfloat16, "auto", True),
        ((10, 0), torch.bfloat16, "grouped_mm", True),
        ((9, 0), torch.float32, "auto", False),  # no fp32 grouped kernel (nor fake-tensor rule)
        ((9, 0), torch.float16, "auto", False),
        ((8, 0), torch.bfloat16, "auto", False),  # A100: torch's grouped_mm loops with host syncs
        ((9, 0), torch.bfloat16, "batched", False),  # dropless batched reads the largest count
    ],
)
def test_which_experts_are_compiled_on_cuda(monkeypatch, capability, dtype, backend, traceable):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(compile_module, "grouped_mm_supported", lambda *args: True)
    assert compile_module.experts_are_traceable(experts(backend), torch.device("cuda"), dtype) is traceable


def test_cpu_experts_stay_eager():
    assert not compile_module.experts_are_traceable(experts(), torch.device("cpu"), torch.bfloat16)


def bf16_losses(compiled: bool, steps: int = 4) -> list[float]:
    cfg = tiny_config(train_iters=steps, bf16=True, hidden_dropout=0.0, attention_dropout=0.0)
    cfg.train.compile = compiled
    env = DistEnv()
    parallel = build(cfg, ParallelMesh.build(cfg.dims(1), env), env.device)  # bf16: the experts' compute dtype
    if compiled:
        assert all(moe.experts.backend == "grouped_mm" for moe in parallel.model.moe_layers())
    loader = MemoryLoader(random_samples(512), cfg.train.micro_batch_size)
    return run_losses(Trainer(cfg, env, parallel, loader), steps)


@pytest.mark.slow
def test_blocks_with_traced_grouped_experts_train_like_eager(monkeypatch):
    monkeypatch.setattr(compile_module, "experts_are_traceable", lambda *args: True)  # the CUDA bf16 decision
    eager = bf16_losses(False)
    compiled = bf16_losses(True)
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-4, atol=0)

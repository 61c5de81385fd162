"""A GPU run never imports the CPU package (`moetron.cpu`): the modules a training, evaluation or planning run
imports, and the seams' backends chosen for a CUDA or meta device, leave it unloaded. In a fresh interpreter, since
this test process's own conftest loads it."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys

import torch

import moetron.checkpoint.open, moetron.eval.evaluate, moetron.parallel.parallelize  # noqa: E401
import moetron.plan.lm_head, moetron.plan.measure_worker, moetron.train.trainer  # noqa: E401
from moetron.model.backends import ATEN_EXPERTS, ATEN_HEAD_LOSS, experts_backend, head_loss_backend
from moetron.model.config import ModelConfig
from moetron.model.gpt import GPTModel
from moetron.parallel.device_backends import use_device_backends

for device in ("cuda", "meta"):
    use_device_backends(device)
    assert experts_backend(torch.device(device)) is ATEN_EXPERTS, device
    assert head_loss_backend(torch.device(device)) is ATEN_HEAD_LOSS, device
cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=64)
cfg.num_experts, cfg.topk = [4], 2
with torch.device("meta"):
    GPTModel(cfg)
loaded = sorted(name for name in sys.modules if name == "moetron.cpu" or name.startswith("moetron.cpu."))
print(loaded)
"""


def test_a_cuda_or_meta_build_never_imports_the_cpu_package():
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "[]", run.stdout

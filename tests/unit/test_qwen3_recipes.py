"""The Qwen3-MoE recipes: the real size has the published parameter counts and fits 8 × 80 GB in `plan`; the tiny one
trains on a CPU."""

from __future__ import annotations

import pytest
import torch
from trainer_support import build_trainer, run_losses

from moetron.config_cli import load_config
from moetron.model.flops import count_parameters
from moetron.model.gpt import GPTModel
from moetron.plan.estimate import make_plan
from moetron.plan.hardware import accelerator
from moetron.plan.memory import estimate_memory
from moetron.recipes import resolve_config_path
from moetron.validate import validate

GiB = 2**30


def recipe(name: str):
    return load_config(str(resolve_config_path(name)), {})[0]


def test_qwen3_30b_a3b_has_the_published_parameter_counts_and_fits_8_gpus():
    cfg = recipe("qwen3-30B-A3B")
    counts = count_parameters(cfg.model)
    assert counts.total == pytest.approx(30.5e9, rel=0.01)
    assert counts.total - counts.embedding == pytest.approx(29.9e9, rel=0.01)  # published "non-embedding: 29.9B"
    # published "3.3B activated" is rounded to two digits: the exact count 3.353B is within that rounding
    assert round(counts.active / 1e9, 1) in (3.3, 3.4) and counts.active == pytest.approx(3.3e9, rel=0.02)
    with torch.device("meta"):
        model = GPTModel(cfg.model)
    assert sum(p.numel() for p in model.parameters()) == counts.total  # the plan counts the real modules
    # on 8 GPUs only the example data and tokenizer paths are missing (the layout, ZeRO 2 × EP 8, is valid)
    assert all(p.startswith(("--data-path", "--tokenizer-model")) for p in validate(cfg, 8))
    context = 1 * GiB  # plan's typical CUDA context and workspaces, on top of the estimate's peak
    assert estimate_memory(cfg, cfg.dims(8)).peak + context < 80 * GiB
    plan = make_plan(cfg, 8, accelerator("H100"))  # what `moetron plan --gpus 8 --gpu-type H100-80GB` prints
    assert plan.params.total == counts.total and plan.fits


def test_tiny_qwen3_recipe_trains_on_cpu():
    cfg = recipe("qwen3-moe-tiny")
    cfg.train.train_iters, cfg.train.eval_interval = 4, 0
    losses = run_losses(build_trainer(cfg), 4)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]

"""The recipes in configs/: every file parses and validates, and the seed recipes are the scripts' models.

Each seed recipe is loaded with its data path pointed at a tiny dataset written here, validated for the
number of GPUs its script uses, and its model is built on the meta device (no memory) to count parameters:
active parameters match the dense size in the name within 10 %, totals match the DeepSpeed-MoE paper's
(Rajbhandari et al. 2022: 350M+MoE-128 13B, 1.3B+MoE-128 52B, 350M+PR-MoE-32/64 4B, 1.3B+PR-MoE-64/128 31B).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from moetron.config_cli import load_config
from moetron.data.indexed import IndexedDatasetBuilder
from moetron.model.gpt import GPTModel
from moetron.model.moe.layer import MoELayer
from moetron.validate import validate

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

# recipe → (GPUs of the script, dense size in the name, total parameters in the paper or None)
SEEDS = {
    "gpt-125M-moe64": (64, 125e6, None),
    "gpt-350M-moe128": (64, 350e6, 13e9),
    "gpt-1.3B-moe128": (64, 1.3e9, 52e9),
    "gpt-350M-pr-moe-32x10-64x2": (64, 350e6, 4e9),
    "gpt-1.3B-pr-moe-64x10-128x2": (64, 1.3e9, 31e9),
    "gpt-350M": (64, 350e6, None),
    "gpt-1.3B": (64, 1.3e9, None),
    "gpt-6.7B": (64, 6.7e9, None),
    "seed-2x4090-moe128": (2, None, None),
}

# reference §1.2: layers, hidden, heads, global batch, micro batch, lr, min lr, experts (per MoE layer), init std
SCRIPT_VALUES = {
    "gpt-125M-moe64": (12, 768, 12, 256, 4, 4.5e-4, 4.5e-6, [64], 0.014),
    "gpt-350M-moe128": (24, 1024, 16, 256, 4, 2.0e-4, 2e-6, [128], 0.014),
    "gpt-1.3B-moe128": (24, 2048, 16, 512, 8, 1.2e-4, 1.0e-6, [128], 0.014),
    "gpt-350M-pr-moe-32x10-64x2": (24, 1024, 16, 256, 4, 3.0e-4, 1.0e-6, [32] * 10 + [64] * 2, 0.014),
    "gpt-1.3B-pr-moe-64x10-128x2": (24, 2048, 16, 512, 8, 1.2e-4, 1.0e-6, [64] * 10 + [128] * 2, 0.014),
    "gpt-350M": (24, 1024, 16, 256, 4, 3.0e-4, 3.0e-5, [1], 0.014),
    "gpt-1.3B": (24, 2048, 16, 512, 2, 2.0e-4, 2.0e-5, [1], 0.014),
    "gpt-6.7B": (32, 4096, 32, 1024, 4, 1.2e-4, 1.2e-5, [1], 0.01),
    "seed-2x4090-moe128": (4, 256, 4, 16, 4, 1.2e-4, 1.0e-6, [128], 0.014),
}


@pytest.fixture(scope="module")
def tiny_dataset(tmp_path_factory) -> str:
    prefix = tmp_path_factory.mktemp("data") / "tiny_text_document"
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        for doc in range(8):
            builder.add_document(np.arange(doc, doc + 64) % 50257)
        builder.finalize()
    return str(prefix)


def load_recipe(name: str, data_path: str):
    # validation checks that the named tokenizer files exist: point them at placeholders beside the data
    vocab, merges = f"{data_path}.vocab.json", f"{data_path}.merges.txt"
    for path in (vocab, merges):
        open(path, "a").close()
    overrides = {"data_path": [data_path], "vocab_file": vocab, "merge_file": merges}
    cfg, _ = load_config(str(CONFIGS / f"{name}.yaml"), overrides)
    return cfg


def meta_counts(cfg) -> tuple[int, int, int]:
    """(total, active, residual-MLP) parameters of the real model built on the meta device."""
    with torch.device("meta"):
        model = GPTModel(cfg.model)
    total = sum(p.numel() for p in model.parameters())
    inactive = residual = 0
    for moe in (m for m in model.modules() if isinstance(m, MoELayer)):
        experts = sum(p.numel() for p in moe.experts.parameters())
        inactive += experts - experts * cfg.model.topk // moe.num_experts
        residual += sum(p.numel() for p in moe.mlp.parameters()) if moe.mlp is not None else 0
    return total, total - inactive, residual


def test_every_seed_recipe_exists_and_every_config_is_known():
    present = {path.stem for path in CONFIGS.glob("*.yaml")}
    assert set(SEEDS) <= present


@pytest.mark.parametrize("name", sorted(SEEDS))
def test_recipe_validates_for_its_gpu_count(name, tiny_dataset):
    cfg = load_recipe(name, tiny_dataset)
    gpus = SEEDS[name][0]
    assert validate(cfg, gpus) == []
    assert cfg.total_iters(cfg.dims(gpus).dp) > 0


@pytest.mark.parametrize("name", sorted(SEEDS))
def test_recipe_has_the_scripts_values(name, tiny_dataset):
    cfg = load_recipe(name, tiny_dataset)
    m, t = cfg.model, cfg.train
    layers, hidden, heads, gbs, mbs, lr, min_lr, experts, std = SCRIPT_VALUES[name]
    assert (m.num_layers, m.hidden_size, m.num_attention_heads) == (layers, hidden, heads)
    assert (t.global_batch_size, t.micro_batch_size) == (gbs, mbs)
    assert (t.lr, t.min_lr, m.init_method_std) == pytest.approx((lr, min_lr, std))
    assert m.num_experts == experts
    # shared by every script (reference §1.2–1.3)
    assert (m.seq_length, m.max_position_embeddings, m.expert_interval, m.topk) == (2048, 2048, 2, 1)
    assert cfg.data.split.replace(" ", "") == "98,2,0"
    assert (t.lr_decay_style, t.lr_warmup_tokens, t.train_tokens) == ("cosine", 375_000_000, 300_000_000_000)
    assert (t.weight_decay, t.clip_grad, t.adam_beta1, t.adam_beta2) == (0.1, 1.0, 0.9, 0.95)
    assert (t.log_interval, t.eval_interval, t.eval_iters, t.fp16, m.checkpoint_activations) == (
        10,
        100,
        10,
        True,
        True,
    )
    if experts != [1]:
        assert (m.moe_loss_coeff, m.moe_train_capacity_factor, m.moe_eval_capacity_factor) == (0.01, 1.0, 1.0)
        assert (m.moe_min_capacity, m.moe_token_dropping, t.lr_decay_tokens) == (4, True, 300_000_000_000)
        assert all(e % cfg.parallel.moe_expert_parallel_size == 0 for e in experts)  # EP <= smallest count
    else:
        assert t.lr_decay_tokens == 260_000_000_000


@pytest.mark.parametrize("name", sorted(n for n, (_, dense, _) in SEEDS.items() if dense))
def test_recipe_model_sizes(name, tiny_dataset):
    cfg = load_recipe(name, tiny_dataset)
    _, dense_size, paper_total = SEEDS[name]
    total, active, residual = meta_counts(cfg)
    # PR-MoE's residual MLPs run for every token on top of the base model the name refers to
    assert abs((active - residual) / dense_size - 1) <= 0.10, f"{name}: {active - residual:,} active"
    assert (residual > 0) == (cfg.model.mlp_type == "residual")
    if paper_total:
        assert abs(total / paper_total - 1) <= 0.10, f"{name}: {total:,} parameters"


def test_2x4090_recipe_splits_128_experts_over_two_gpus(tiny_dataset):
    cfg = load_recipe("seed-2x4090-moe128", tiny_dataset)
    dims = cfg.dims(2)
    assert (dims.dp, dims.ep, cfg.num_micro_batches(dims.dp)) == (2, 2, 2)
    assert cfg.model.moe_layer_indices() == [1, 3]


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_config_parses_and_builds(path):
    cfg, _ = load_config(str(path), {})
    assert cfg.model.problems() == []
    with torch.device("meta"):
        GPTModel(cfg.model)

"""`plan --search`'s shortcuts change no answer: the memoised per-layer expert counts equal the loop they replace, and
a search with every cache off (each candidate's output directories asked of the filesystem, every per-layer count
recomputed) gives the same rows, in the same order, and the same header counts."""

from __future__ import annotations

import contextlib

import pytest

from moetron.config_cli import load_config
from moetron.model.config import ModelConfig
from moetron.plan import search as search_module
from moetron.plan.cost_model import network
from moetron.plan.hardware import accelerator


def loop_experts_per_layer(m: ModelConfig) -> list[int]:
    """Megatron's `get_num_experts_per_layer`, as ModelConfig computed it before it was memoised."""
    per_slot = m.num_experts * max(1, m.num_layers // m.expert_interval) if len(m.num_experts) == 1 else m.num_experts
    return [
        per_slot[layer // m.expert_interval]
        if (layer + 1) % m.expert_interval == 0 and layer >= m.moe_first_dense_layers
        else 1
        for layer in range(m.num_layers)
    ]


@pytest.mark.parametrize(
    "fields",
    [
        {"num_layers": 4, "num_experts": [8], "expert_interval": 1, "moe_first_dense_layers": 0},
        {"num_layers": 6, "num_experts": [8], "expert_interval": 2, "moe_first_dense_layers": 0},
        {"num_layers": 5, "num_experts": [4], "expert_interval": 1, "moe_first_dense_layers": 2},
        {"num_layers": 4, "num_experts": [2, 4, 8, 16], "expert_interval": 1, "moe_first_dense_layers": 1},
        {"num_layers": 3, "num_experts": [1], "expert_interval": 1, "moe_first_dense_layers": 0},
    ],
)
def test_memoised_experts_per_layer_is_the_loop(fields):
    m = ModelConfig(**fields)
    assert m.experts_per_layer() == loop_experts_per_layer(m)
    m.experts_per_layer().append(99)  # a caller's list is its own: the memo is not mutated through it
    assert m.experts_per_layer() == loop_experts_per_layer(m)


def summary(result) -> tuple:
    rows = [(r.words, r.layout, round(r.cost.total, 12), r.plan.needed_bytes, r.flags) for r in result.rows]
    return rows, result.candidates, result.valid, result.too_big, dict(result.refusals), result.pruned


def test_search_rows_and_counts_are_those_of_the_uncached_search(monkeypatch, tmp_path):
    cfg, _ = load_config("gpt-125M-moe64", {"save": str(tmp_path / "run")})
    device, net = accelerator("A100-80GB"), network(2, 1, "A100-80GB")
    cached = summary(search_module.search(cfg, 2, device, net))
    assert cached[0] and cached[2] < cached[1]  # rows offered, and some layouts refused
    monkeypatch.setattr(search_module, "model_cache", contextlib.nullcontext)
    monkeypatch.setattr(search_module, "directories_checked_once", contextlib.nullcontext)
    monkeypatch.setattr("moetron.model.config._experts_per_layer", search_module_uncached_experts())
    assert summary(search_module.search(cfg, 2, device, net)) == cached


def search_module_uncached_experts():
    """`_experts_per_layer` without its memo (the loop, each call)."""
    from moetron.model import config

    return config._experts_per_layer.__wrapped__

"""RouterConfig: the routing fields and their rules, inherited by ModelConfig (flags, help and YAML unchanged)."""

from __future__ import annotations

import argparse
import ast
import dataclasses
from pathlib import Path

import pytest
import torch

import moetron.model.config as model_config
from moetron.config_cli import add_config_arguments, field_specs
from moetron.errors import ConfigError
from moetron.model.config import ModelConfig, RouterConfig
from moetron.model.moe.routing.router import Router

ROUTING_FIELDS = {f.name for f in dataclasses.fields(RouterConfig)}


def _imported_modules(module) -> set[str]:
    """Every module a source file imports, at the top or inside functions."""
    tree = ast.parse(Path(module.__file__).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_no_config_router_import_cycle():
    """The router's settings live in the config leaf: reading a config never imports torch or the router."""
    assert not any(name.startswith(("moetron", "torch")) for name in _imported_modules(model_config))


def test_model_config_is_a_router_config_with_the_same_flags():
    assert issubclass(ModelConfig, RouterConfig)
    assert ROUTING_FIELDS <= {f.name for f in dataclasses.fields(ModelConfig)}
    assert {"topk", "moe_token_dropping", "moe_router_score_function", "hidden_size"} <= ROUTING_FIELDS
    specs = field_specs()
    assert all(specs[name].section == "model" for name in ROUTING_FIELDS)


def test_inherited_fields_keep_their_help_comment():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    helps = {a.option_strings[0]: a.help for a in parser._actions if a.option_strings}
    assert helps["--moe-token-dropping"].startswith("--disable-moe-token-dropping sets False")
    assert helps["--moe-aux-loss-type"] == "global (DeepSpeed) | seq (per-sequence) | none (default: global)"
    assert helps["--num-experts"].startswith("one value, or one per MoE layer")  # ModelConfig's own still work


def test_router_takes_a_plain_router_config_and_cfg_swaps_keep_working():
    cfg = RouterConfig(hidden_size=8, topk=2, moe_token_dropping=False)
    router = Router(cfg, 4)
    assert router.weight.shape == (4, 8) and router(torch.randn(6, 8)).topk == 2
    router.cfg = dataclasses.replace(router.cfg, moe_token_dropping=True)  # what inference_routing does
    assert type(router.cfg) is RouterConfig and router.cfg.topk == 2 and router.cfg.moe_token_dropping
    model_cfg = ModelConfig(hidden_size=8, num_experts=[4])
    swapped = dataclasses.replace(Router(model_cfg, 4).cfg, moe_token_dropping=False)
    assert type(swapped) is ModelConfig and swapped.num_experts == [4]


def test_routing_problems_per_expert_count_and_through_model_config():
    cfg = RouterConfig(topk=5, moe_aux_loss_type="avg", moe_min_capacity=-1, num_expert_groups=3)
    problems = cfg.routing_problems([4, 8])
    assert [p for p in problems if "--topk 5" in p] == ["--topk 5 must be between 1 and the layer's 4 experts"]
    assert sum("--num-expert-groups 3 does not divide" in p for p in problems) == 2  # neither 4 nor 8
    assert sum("--moe-aux-loss-type 'avg'" in p for p in problems) == 1  # value checks: once, not per count
    assert sum("--moe-min-capacity" in p for p in problems) == 1
    assert RouterConfig(moe_aux_loss_type="avg").routing_problems() == [
        "--moe-aux-loss-type 'avg' is not one of global, seq, none"
    ]
    dense = ModelConfig(moe_aux_loss_type="avg")  # value checks apply even without MoE layers
    assert "--moe-aux-loss-type 'avg' is not one of global, seq, none" in dense.problems()
    with pytest.raises(ConfigError, match="--topk 5") as info:
        Router(cfg, 4)
    assert len(info.value.problems) == 4  # aux type, min capacity, topk, groups: all at once

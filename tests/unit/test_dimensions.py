"""The registry of parallel dimensions: `validate()` and the plan read every dimension from `DIMENSIONS`, so a
dimension added there (its folder's `DIMENSION`, one line) is checked and priced without a change elsewhere."""

from __future__ import annotations

import dataclasses

import pytest

from moetron.config_cli import load_config
from moetron.parallel.dimension import Dimension
from moetron.parallel.dimensions import DIMENSIONS
from moetron.parallel.dims import ParallelDims
from moetron.plan import cost_model, memory_terms
from moetron.plan.estimate import make_plan
from moetron.plan.hardware import accelerator
from moetron.plan.memory import estimate_memory
from moetron.validate import validate


def test_every_dimension_is_a_degree_of_the_layout_once():
    names = [d.name for d in DIMENSIONS]
    assert sorted(names) == sorted(set(names)) == ["cp", "dp", "ep", "pp", "tp"]
    assert all(name in {f.name for f in dataclasses.fields(ParallelDims)} for name in names)
    assert sorted(cost_model.communication_parts()) == sorted(names)


def _with(monkeypatch, extra: Dimension) -> None:
    """`extra` registered after the others, as one line in parallel/dimensions.py would."""
    for module in (cost_model, memory_terms):
        monkeypatch.setattr(module, "DIMENSIONS", (*DIMENSIONS, extra))
    monkeypatch.setattr("moetron.validate.DIMENSIONS", (*DIMENSIONS, extra))
    monkeypatch.setattr("moetron.plan.search.DIMENSIONS", (*DIMENSIONS, extra))


def test_a_registered_dimension_is_validated_and_priced(monkeypatch):
    cfg, _ = load_config("quickstart", {"train_iters": 10, "moe_expert_parallel_size": 1})
    before = validate(cfg, 1)
    plan = make_plan(cfg, 1, accelerator("A100-80GB"))
    cost = cost_model.step_cost(plan, cost_model.network(1, None, "A100-80GB"))

    extra = Dimension(
        name="xp",
        split_problems=lambda cfg, dims: ["xp: the split"],
        flag_problems=lambda cfg, dims: ["xp: its flags"],
        saved_bytes=lambda cfg, dims, c, layers, micro_batches: 1000 * layers,
        step_seconds=lambda step: 0.25,
    )
    _with(monkeypatch, extra)
    problems = validate(cfg, 1)
    assert [p for p in problems if p not in before] == ["xp: the split", "xp: its flags"]
    assert problems.index("xp: the split") < problems.index("xp: its flags")

    monkeypatch.setattr("moetron.plan.estimate.layout_problems", lambda cfg, gpus: [])
    extended = make_plan(cfg, 1, accelerator("A100-80GB"))
    layers = cfg.model.num_layers
    assert extended.memory.activations == plan.memory.activations + 1000 * layers
    assert estimate_memory(cfg, cfg.dims(1)).activations == plan.memory.activations + 1000 * layers
    priced = cost_model.step_cost(extended, cost_model.network(1, None, "A100-80GB"))
    assert priced.part("xp") == 0.25 and cost_model.communication_parts()[-1] == "xp"
    assert priced.total == pytest.approx(cost.total + 0.25)

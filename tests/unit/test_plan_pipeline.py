"""`moetron plan` with pipeline parallelism: bubble, per-stage parameters and memory, step time, the advice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moetron.cli import main
from moetron.config_cli import load_config
from moetron.model.flops import count_parameters
from moetron.parallel.pp.cost import bubble_fraction
from moetron.parallel.pp.memory import in_flight
from moetron.parallel.pp.stage_layout import PipelineLayout
from moetron.plan.advice import suggestions
from moetron.plan.estimate import make_plan
from moetron.plan.hardware import accelerator
from moetron.plan.stages import plan_stages, stage_parameters

RECIPES = Path(__file__).resolve().parents[2] / "src" / "moetron" / "recipes"
MOE = str(RECIPES / "gpt-1.3B-moe128.yaml")
FLAGS = {"moe_expert_parallel_size": 4, "global_batch_size": 64, "micro_batch_size": 2}


def test_bubble_fractions():
    assert bubble_fraction("1f1b", 1, 8) == 0.0
    assert bubble_fraction("1f1b", 4, 8) == pytest.approx(3 / 11)  # (p − 1) / (m + p − 1)
    assert bubble_fraction("gpipe", 2, 4) == pytest.approx(1 / 5)
    assert bubble_fraction("interleaved-1f1b", 4, 8, virtual=2) == pytest.approx(3 / 19)  # v·m
    assert bubble_fraction("zero-bubble", 4, 8) == pytest.approx(3 / 27)  # a third of 1F1B's idle work


def test_micro_batches_in_flight_per_schedule():
    one = PipelineLayout.build(8, pp=4)
    assert [in_flight(one, r, 8) for r in range(4)] == [4, 3, 2, 1]  # the first stage holds p micro-batches
    assert in_flight(one, 0, 2) == 2
    assert in_flight(PipelineLayout.build(8, pp=4, schedule="gpipe"), 3, 8) == 8
    inter = PipelineLayout.build(8, pp=2, virtual_layers=2)
    assert in_flight(inter, 0, 4) == pytest.approx((2 + 2 + 1) / 2)  # torch's warm-up forwards of half-stages


def test_stage_parameters_add_up_to_the_model_and_the_ends_are_heavier():
    cfg, _ = load_config(MOE, {"pipeline_model_parallel_size": 4, **FLAGS})
    layout = PipelineLayout.from_config(cfg.model.num_layers, cfg.parallel)
    per_stage = [
        stage_parameters(cfg.model, layout.layers_of(r), layout.holds_first(r), layout.holds_last(r), 1)
        for r in range(4)
    ]
    vocab = cfg.model.padded_vocab_size() * cfg.model.hidden_size
    assert sum(p.total for p in per_stage) == count_parameters(cfg.model).total + vocab  # tied: both ends hold it
    assert per_stage[0].total > per_stage[1].total and per_stage[3].total > per_stage[2].total
    stages = plan_stages(cfg, make_plan(cfg, 16, accelerator("A100-80GB")).dims)
    assert [s.in_flight for s in stages] == [4, 3, 2, 1]
    assert stages[3].memory.logits > 0 and stages[0].memory.logits == 0
    assert stages[0].memory.activations > stages[1].memory.activations  # more micro-batches in flight


def test_plan_shards_by_pipeline_and_reports_each_stage(capsys):
    flat, _ = load_config(MOE, FLAGS)
    cfg, _ = load_config(MOE, {"pipeline_model_parallel_size": 4, **FLAGS})
    device = accelerator("A100-80GB")
    whole, piped = make_plan(flat, 4, device), make_plan(cfg, 16, device)
    assert piped.memory.peak < whole.memory.peak / 2 and piped.memory.peak == max(s.memory.peak for s in piped.stages)
    assert piped.bubble == pytest.approx(3 / 11)
    args = ["plan", "--config", MOE, "--gpus", "16", "--gpu-type", "A100-80GB", "--pipeline-model-parallel-size", "4"]
    args += ["--moe-expert-parallel-size", "4", "--global-batch-size", "64", "--micro-batch-size", "2"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "pipeline 4 (1f1b, bubble 27%)" in text
    assert "stage 0: layers 0–5 + embedding (4 in flight)" in text and "stage 3: layers 18–23 + head" in text
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["pipeline"]
    assert data["schedule"] == "1f1b" and data["micro_batches"] == 8 and len(data["stages"]) == 4


def test_advice_proposes_pipeline_parallelism():
    cfg, _ = load_config(str(RECIPES / "gpt-6.7B.yaml"), {})
    plan = make_plan(cfg, 64, accelerator("A100-80GB"))  # a dense 6.7B with Adam does not fit one 80 GB GPU
    fixes = [f for f in suggestions(plan) if "--pipeline-model-parallel-size" in f.flags]  # (ZeRO 2/3 fit too)
    assert not plan.fits and fixes and all(f.plan.fits for f in fixes)
    assert fixes[0].plan.dims.pp == 2  # the fastest pipeline that fits (the least bubble; the head is fused)


def test_stages_under_tensor_parallelism_hold_their_share():
    """PP × TP: each stage's parameters, saved activations and step time are split over its tensor-parallel ranks."""
    flags = {"pipeline_model_parallel_size": 2}
    cfg, _ = load_config(str(RECIPES / "gpt-6.7B.yaml"), flags)
    tp_cfg, _ = load_config(str(RECIPES / "gpt-6.7B.yaml"), {**flags, "tensor_model_parallel_size": 2})
    pp, pp_tp = make_plan(cfg, 8, accelerator("A100-80GB")), make_plan(tp_cfg, 8, accelerator("A100-80GB"))
    assert pp_tp.dims.tp == 2 and pp_tp.dims.dp == pp.dims.dp // 2
    for whole, split in zip(pp.stages, pp_tp.stages, strict=True):
        assert whole.memory.weights / 2 <= split.memory.weights < whole.memory.weights / 2 * 1.01  # norms stay whole
        assert split.memory.activations < whole.memory.activations
    # half the data-parallel ranks, each step's compute split two ways: the same time per step
    assert pp_tp.step_time_s == pytest.approx(pp.step_time_s, rel=0.05)

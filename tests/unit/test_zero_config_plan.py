"""ZeRO without processes: the flags, the layouts refused up front, the memory plan of each stage and its advice,
the stage-1 slicing rules, and the block-by-block sharded build's initial weights."""

from __future__ import annotations

import pytest
import torch
from test_plan import small

from moetron.config import RunConfig
from moetron.config_cli import load_config
from moetron.model.gpt import GPTModel, create_model
from moetron.parallel.dp.fsdp import materialize_in_units
from moetron.parallel.dp.sharded_optimizer import row_slice, shard_dim
from moetron.parallel.dp.zero_spec import ZeroSpec, effective_stage
from moetron.plan.advice import suggestions
from moetron.plan.estimate import make_plan
from moetron.plan.hardware import accelerator
from moetron.plan.memory import estimate_memory, local_parameters
from moetron.validate import validate


def test_flags_and_deepspeeds_stage_numbers(tmp_path):
    cfg, _ = load_config(None, {"zero_stage": 3, "bf16": True})
    assert ZeroSpec.from_config(cfg) == ZeroSpec(3, torch.bfloat16)
    cfg, _ = load_config(None, {"use_distributed_optimizer": True})  # Megatron's flag is stage 1
    assert ZeroSpec.from_config(cfg).stage == 1 and ZeroSpec.from_config(cfg).shards_optimizer
    assert effective_stage(2, True) == 2 and effective_stage(0, False) == 0
    config = tmp_path / "zero.yaml"
    config.write_text("parallel:\n  zero_stage: 2\n")
    assert load_config(str(config), {})[0].parallel.zero_stage == 2


def problems_of(world_size: int = 4, **parallel) -> list[str]:
    cfg = RunConfig()
    cfg.train.train_iters = 1
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return [p for p in validate(cfg, world_size) if "zero" in p or "distributed-optimizer" in p]


def test_zero_flag_problems_are_one_line_each_and_every_layout_composes():
    (bad,) = problems_of(zero_stage=4)
    assert "--zero-stage 4" in bad and "0, 1, 2, 3" in bad and "\n" not in bad
    (both,) = problems_of(world_size=4, use_distributed_optimizer=True, zero_stage=3)
    assert both.startswith("--use-distributed-optimizer is Megatron's sharded optimizer state") and "\n" not in both
    layouts = [  # ZeRO with tensor (+ sequence) and pipeline parallelism, every schedule: nothing refused
        {"zero_stage": 3, "pipeline_model_parallel_size": 2},
        {"zero_stage": 1, "pipeline_model_parallel_size": 2, "pipeline_schedule": "gpipe"},
        {"use_distributed_optimizer": True, "tensor_model_parallel_size": 2},
        {"zero_stage": 2, "tensor_model_parallel_size": 2, "sequence_parallel": True},
    ]
    for layout in layouts:
        assert problems_of(world_size=4, **layout) == [], layout
    assert problems_of(world_size=1, zero_stage=3) == []  # one process: nothing to shard, nothing refused


def plan_memory(stage: int, world_size: int = 4, ep: int = 2, **model):
    cfg = small(num_layers=4, num_experts=[8], **model)
    cfg.parallel.moe_expert_parallel_size, cfg.parallel.zero_stage = ep, stage
    return estimate_memory(cfg, cfg.dims(world_size), "cuda"), cfg


def test_each_stage_shards_what_deepspeed_does():
    base, cfg = plan_memory(0)
    dims = cfg.dims(4)
    params = local_parameters(cfg.model, dims)
    sharded = 4 * (-(-(params.total - params.experts) // dims.dp) + -(-params.experts // dims.edp))
    one, two, three = (plan_memory(s)[0] for s in (1, 2, 3))
    assert (one.weights, one.gradients, one.optimizer) == (base.weights, base.gradients, 2 * sharded)
    assert one.gathered > 0 and one.ddp_buckets == base.ddp_buckets  # the after-step all-gather
    assert (two.weights, two.gradients, two.optimizer, two.ddp_buckets) == (sharded, sharded, 2 * sharded, 0)
    assert (three.weights, three.gradients, three.optimizer) == (sharded, sharded, 2 * sharded)
    assert two.gathered > three.gathered > 0  # stage 2 gathers every block, stage 3 two at a time
    assert base.optimizer / one.optimizer > 2  # dense state 1/4, expert state 1/2
    assert plan_memory(3, world_size=1, ep=1)[0] == plan_memory(0, world_size=1, ep=1)[0]  # nothing to shard


def test_plan_reports_the_stage_and_suggests_one_when_a_run_does_not_fit():
    cfg = small(num_layers=8, hidden_size=512, num_experts=[32])
    cfg.parallel.moe_expert_parallel_size = 2
    fits = make_plan(cfg, 8, accelerator("4090"))
    assert fits.fits
    needed = fits.needed_bytes
    tight = accelerator(None, f"{(needed - 2**20) / 2**30:.3f}GB")  # 1 MiB short
    plan = make_plan(cfg, 8, tight)
    found = {s.flags: s for s in suggestions(plan)}
    assert "--zero-stage 3" in found and found["--zero-stage 3"].plan.memory.zero_stage == 3
    cfg.parallel.zero_stage = 3
    sharded = make_plan(cfg, 8, tight)
    assert sharded.fits and sharded.memory.peak < plan.memory.peak
    cfg.parallel.moe_expert_parallel_size, cfg.parallel.zero_stage = 1, 0
    alone = make_plan(cfg, 1, accelerator(None, "1GB"))  # one GPU: ZeRO only together with more GPUs
    assert not alone.fits and all("--gpus" in s.flags for s in suggestions(alone) if "--zero-stage" in s.flags)


def test_stage_1_slices_are_contiguous_views_split_like_dtensor():
    assert shard_dim(torch.Size([8, 32, 64])) == 0
    assert shard_dim(torch.Size([1, 32, 64])) == 1  # one local expert: shared over edp along D
    assert shard_dim(torch.Size([1, 1])) == 0
    assert [row_slice(5, 4, i) for i in range(4)] == [slice(0, 2), slice(2, 4), slice(4, 5), slice(5, 5)]
    assert [row_slice(1, 2, i) for i in range(2)] == [slice(0, 1), slice(1, 1)]
    with pytest.raises(ValueError, match="0-dimensional"):
        shard_dim(torch.Size([]))


def test_block_by_block_build_draws_the_weights_of_the_whole_model():
    cfg = small(num_experts=[4], num_layers=3, expert_interval=1).model
    whole = create_model(cfg, seed=5)
    with torch.device("meta"):
        built = GPTModel(cfg)
    units = []
    materialize_in_units(built, "cpu", 5, lambda unit: units.append(unit))
    assert units[:3] == [built.layers[str(i)] for i in range(3)] and units[-1] is built
    for (name, got), (_, want) in zip(built.state_dict().items(), whole.state_dict().items(), strict=True):
        assert torch.equal(got, want), name

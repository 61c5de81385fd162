"""The replica plan of `--moe-expert-replicas` (pure device arithmetic, no process group) and its launch checks."""

from __future__ import annotations

import pytest
import torch

from moetron.parallel.dims import ParallelDims
from moetron.parallel.ep.replica_plan import max_over_mean, owner_load, plan_replicas
from moetron.parallel.ep.replica_spec import expert_replica_problems


def random_counts(ranks: int, experts: int, seed: int, hot: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 20, (ranks, experts), generator=g)
    counts[:, hot] += torch.randint(50, 200, (ranks,), generator=g)  # one hot expert
    return counts


@pytest.mark.parametrize("ranks,experts,slots,seed", [(2, 8, 1, 0), (4, 8, 1, 1), (4, 16, 3, 2), (8, 16, 1, 3)])
def test_every_row_is_computed_exactly_once(ranks, experts, slots, seed):
    counts = random_counts(ranks, experts, seed, hot=seed % experts)
    plan = plan_replicas(counts, slots)
    owner_RE, replica_RJ = plan.rows_by_destination(counts)
    # each source's rows of each expert are split between the owner and that expert's replica slots, none lost
    per_expert = owner_RE.clone()
    per_expert.index_add_(1, plan.slot_expert_J, replica_RJ)
    assert torch.equal(per_expert, counts)
    # what each rank computes: its own experts' kept rows plus its replica slots' rows
    local = experts // ranks
    computed = owner_RE.sum(0).view(ranks, local).sum(1) + replica_RJ.sum(0).view(ranks, slots).sum(1)
    assert torch.equal(computed, plan.load_computed_R)
    assert torch.equal(plan.load_routed_R, owner_load(counts))
    assert max_over_mean(plan.load_computed_R) < max_over_mean(plan.load_routed_R)
    # a slot never holds an expert of its own rank unless it is unused (no rows)
    used = plan.slot_end_J > plan.slot_start_J
    assert torch.all(plan.slot_expert_J[used] // local != torch.arange(ranks * slots)[used] // slots)
    # deterministic: the same counts give the same plan
    again = plan_replicas(counts.clone(), slots)
    assert torch.equal(again.slot_expert_J, plan.slot_expert_J) and torch.equal(again.slot_end_J, plan.slot_end_J)


def test_one_hot_expert_is_spread_over_every_rank():
    counts = torch.zeros(4, 8, dtype=torch.int64)
    counts[:, 0] = 100  # every token of every rank to expert 0 (rank 0's)
    plan = plan_replicas(counts, 1)
    assert float(max_over_mean(plan.load_routed_R)) == 4.0
    assert plan.load_computed_R.tolist() == [100, 100, 100, 100]  # water-filling: every rank at the mean
    assert plan.slot_expert_J.tolist()[1:] == [0, 0, 0]


def test_balanced_routing_replicates_nothing():
    counts = torch.full((2, 4), 10, dtype=torch.int64)
    plan = plan_replicas(counts, 1)
    assert torch.equal(plan.slot_end_J, plan.slot_start_J)  # no rows in any slot
    assert torch.equal(plan.load_computed_R, plan.load_routed_R)


def test_replica_problems_name_the_flag_and_the_fix():
    ep4 = ParallelDims(world_size=4, dp=4, ep=4)
    assert expert_replica_problems(0, [8, 8], ParallelDims(world_size=1, dp=1)) == []
    assert expert_replica_problems(1, [8, 8], ep4) == []
    (no_ep,) = expert_replica_problems(1, [8], ParallelDims(world_size=2, dp=2))
    assert no_ep.startswith("--moe-expert-replicas 1 needs --moe-expert-parallel-size > 1")
    # as many slots as a rank's own experts, or more (one expert per rank: where a hot expert hurts most)
    assert expert_replica_problems(2, [1, 8], ep4) == expert_replica_problems(3, [4], ep4) == []
    (negative,) = expert_replica_problems(-1, [8], ep4)
    assert negative.startswith("--moe-expert-replicas -1 must be >= 0")
    # every other layout composes (tests/distributed/test_expert_replicas.py)
    every = ParallelDims(world_size=8, dp=2, tp=2, pp=2, ep=4, etp=2)
    assert expert_replica_problems(1, [16], every) == []


def test_validate_reports_replica_problems_before_launch():
    from moetron.config import RunConfig
    from moetron.validate import validate

    cfg = RunConfig()
    cfg.model.num_layers, cfg.model.num_experts = 2, [4]
    cfg.train.train_iters = 1
    cfg.parallel.moe_expert_parallel_size, cfg.parallel.moe_expert_replicas = 1, 1
    problems = [p for p in validate(cfg, world_size=2) if "--moe-expert-replicas" in p]
    assert problems == [
        "--moe-expert-replicas 1 needs --moe-expert-parallel-size > 1 (replicas copy experts between EP ranks); drop it"
    ]
    cfg.parallel.moe_expert_parallel_size, cfg.parallel.moe_expert_replicas = 2, 2  # K = the 2 local experts
    assert not [p for p in validate(cfg, world_size=2) if "--moe-expert-replicas" in p]


def test_the_plan_counts_the_replica_slots_weights():
    """K slots per MoE layer hold K experts' weights (compute dtype) until the backward: on top of the rank's share,
    at any K (also beyond its own experts)."""
    from moetron.config import RunConfig
    from moetron.model.flops import expert_mlp_params
    from moetron.plan.memory import estimate_memory

    cfg = RunConfig()
    cfg.model.num_layers, cfg.model.num_experts, cfg.model.hidden_size = 4, [4], 64
    cfg.model.num_attention_heads, cfg.model.seq_length, cfg.model.max_position_embeddings = 4, 32, 32
    cfg.train.micro_batch_size, cfg.train.global_batch_size, cfg.train.bf16 = 2, 8, True
    cfg.parallel.moe_expert_parallel_size = 4
    dims = cfg.dims(4)
    base = estimate_memory(cfg, dims).all_to_all
    moe_layers = sum(e > 1 for e in cfg.model.experts_per_layer())
    per_expert = expert_mlp_params(cfg.model, cfg.model.expert_ffn_size)
    for slots in (1, 2):
        cfg.parallel.moe_expert_replicas = slots
        assert estimate_memory(cfg, dims).all_to_all - base == slots * per_expert * 2 * (moe_layers + 1)

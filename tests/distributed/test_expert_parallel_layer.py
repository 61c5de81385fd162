"""One MoE layer with the all-to-all dispatcher (gloo, 4 processes) against the same layer in one process.

Every rank routes its own tokens (a different count per rank, so splits are uneven) through a layer whose
experts are spread over an EP group of 2 (ranks [0, 1], [2, 3]) or 4; the reference is the full layer with
the same global weights applied locally. Checked for top-1 and top-2, capacity (with drops) and dropless:
  - the output on each rank's tokens and the gradient w.r.t. those tokens and the gate,
  - each local expert's gradient = the sum over the EP peers' tokens of the full layer's gradient there.
One spawned group runs all 8 cases (spawning is the expensive part), and checks that the DeviceMeshes built for
several layouts of 4 ranks give exactly the groups `ParallelDims` computes.
"""

from __future__ import annotations

import copy

import pytest
import torch
from launch import run_distributed

from moetron.model.config import ModelConfig
from moetron.model.moe.layer import MoELayer
from moetron.parallel.dims import ParallelDims
from moetron.parallel.env import DistEnv
from moetron.parallel.ep.all_to_all import (
    AllToAllDispatcher,
    regroup_by_local_expert,
    shard_layer_experts,
)
from moetron.parallel.mesh import ParallelMesh

HIDDEN, EXPERTS = 16, 8
EXPERT_PARAMS = ("w1_EDF", "w2_EFD", "b1_EF", "b2_ED")


def layer_config(topk: int, dropless: bool) -> ModelConfig:
    cfg = ModelConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, ffn_hidden_size=32, vocab_size=64)
    cfg.num_experts, cfg.topk = [EXPERTS], topk
    cfg.moe_token_dropping = not dropless
    cfg.moe_min_capacity = 1  # small capacities, so the capacity cases really drop routes
    cfg.moe_use_rts = False  # no random draws: the reference must route exactly like the EP run
    cfg.moe_top2_2nd_expert_sampling = False
    return cfg


def rank_inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_TD, upstream gradient g_TD) of `rank`: any process can rebuild any rank's tokens."""
    g = torch.Generator().manual_seed(100 + rank)
    tokens = 10 + 3 * rank  # uneven token counts per rank
    return torch.randn(tokens, HIDDEN, generator=g), torch.randn(tokens, HIDDEN, generator=g)


def forward_backward(layer: MoELayer, rank: int) -> dict:
    x_TD, g_TD = rank_inputs(rank)
    x_TD.requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    y_TD, aux = layer(x_TD)
    ((y_TD * g_TD).sum() + aux.aux_loss).backward()
    out = {"y": y_TD.detach(), "x_grad": x_TD.grad, "gate_grad": layer.router.weight.grad.clone()}
    out["dropped"] = int(aux.dropped_routes)
    for name in EXPERT_PARAMS:
        out[name] = getattr(layer.experts, name).grad.clone()
    return out


def reference(full: MoELayer, rank: int, peers: list[int], offset: int, count: int) -> dict:
    """Full layer in this process: outputs on `rank`'s tokens; expert grads summed over the peers' tokens."""
    mine = forward_backward(full, rank)
    for name in EXPERT_PARAMS:
        mine[name] = sum(forward_backward(full, peer)[name] for peer in peers)[offset : offset + count]
    return mine


def check_case(rank: int, ep: int, group, topk: int, dropless: bool) -> int:
    torch.manual_seed(0)
    full = MoELayer(layer_config(topk, dropless), EXPERTS, layer_index=1)
    layer = copy.deepcopy(full)
    ep_rank = rank % ep
    shard_layer_experts(layer, ep_rank, ep)
    layer.dispatcher = AllToAllDispatcher(EXPERTS, group, ep, ep_rank)
    got = forward_backward(layer, rank)
    peers = [rank - ep_rank + i for i in range(ep)]
    want = reference(full, rank, peers, layer.experts.expert_offset, layer.experts.num_experts)
    for key, value in want.items():
        if key == "dropped":
            assert got[key] == value
            continue
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=f"ep={ep} k={topk} {key}")
    return got["dropped"]


MESH_LAYOUTS = [dict(dp=4), dict(dp=4, ep=2), dict(dp=2, tp=2, ep=2), dict(dp=2, tp=2, ep=2, etp=2),
                dict(dp=2, pp=2, ep=2), dict(dp=1, pp=2, tp=2, ep=2)]  # fmt: skip


def check_meshes(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    for layout in MESH_LAYOUTS:
        dims = ParallelDims(world_size=world_size, **layout)
        mesh = ParallelMesh.build(dims, DistEnv(rank=rank, world_size=world_size))
        for name in ("pp", "dp", "tp", "edp", "ep", "etp"):
            mine = [g for g in dims.groups(name) if rank in g][0]
            assert dist.get_process_group_ranks(mesh.group(name)) == mine, (layout, name)
            assert mesh.submesh(name).get_local_rank() == getattr(mesh.coords, name)


def all_cases(rank: int, world_size: int) -> dict:
    check_meshes(rank, world_size)
    dropped = {}
    for ep in (2, 4):
        dims = ParallelDims(world_size=world_size, dp=world_size, ep=ep)
        group = ParallelMesh.build(dims, DistEnv(rank=rank, world_size=world_size)).group("ep")
        for topk in (1, 2):
            for dropless in (False, True):
                dropped[(ep, topk, dropless)] = check_case(rank, ep, group, topk, dropless)
    return dropped


@pytest.mark.distributed
@pytest.mark.slow
def test_all_to_all_layer_matches_single_process():
    results = run_distributed(all_cases, world_size=4)
    for (ep, topk, dropless), _ in results[0].items():
        total = sum(r[(ep, topk, dropless)] for r in results)
        assert (total == 0) == dropless, f"ep={ep} k={topk}: capacity mode should drop some routes"


def test_regroup_by_local_expert_orders_rows_by_expert_then_source():
    recv_RL = torch.tensor([[2, 0, 1], [1, 2, 0]])  # from rank 0: 2 rows for expert 0, 1 for expert 2; …
    # received rows: r0e0 r0e0 r0e2 | r1e0 r1e1 r1e1  → grouped: e0: 0 1 3, e1: 4 5, e2: 2
    assert regroup_by_local_expert(recv_RL, num_received=6).tolist() == [0, 1, 3, 4, 5, 2]


def test_dims_report_every_expert_parallel_problem_at_once():
    problems = ParallelDims(world_size=6, dp=3, ep=4, tp=2).problems(experts_per_layer=[1, 6, 1, 8])
    text = "\n".join(problems)
    assert "data- × tensor-parallel size 6 is not divisible by --moe-expert-parallel-size 4" in text
    assert "expert count(s) [6]" in text
    assert len(problems) == 2
    assert ParallelDims(world_size=8, dp=8, ep=4).problems([8, 16]) == []
    assert ParallelDims(world_size=8, dp=8, ep=4).edp == 2

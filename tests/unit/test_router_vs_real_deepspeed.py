"""The router against DeepSpeed's own `TopKGate` (runs only where `deepspeed` is installed; CI lacks it).

`test_router_deepspeed.py` compares against an independent re-implementation in every CI run; this file is the
cross-check that the re-implementation and moetron both equal the real thing: capacity, dense combine weights,
aux loss, expert counts, and the sparse routes (ids with -1 for drops, weights), under the same torch seeds.
"""

from __future__ import annotations

import pytest
import torch
from test_router_deepspeed import HIDDEN, MODES, dense_from_routing

from moetron.model.config import ModelConfig
from moetron.model.moe.routing.router import Router

sharded_moe = pytest.importorskip("deepspeed.moe.sharded_moe", reason="deepspeed is not installed")


@pytest.fixture(autouse=True)
def single_expert_parallel_rank(monkeypatch):
    import deepspeed.utils.groups as groups

    monkeypatch.setattr(groups, "_get_expert_model_parallel_world_size", lambda: 1)


def deepspeed_gate(cfg: ModelConfig, num_experts: int, weight: torch.Tensor, training: bool):
    gate = sharded_moe.TopKGate(
        HIDDEN,
        num_experts,
        k=cfg.topk,
        capacity_factor=cfg.moe_train_capacity_factor,
        eval_capacity_factor=cfg.moe_eval_capacity_factor,
        min_capacity=cfg.moe_min_capacity,
        noisy_gate_policy=cfg.moe_noisy_gate_policy,
        drop_tokens=cfg.moe_token_dropping,
        use_rts=cfg.moe_use_rts,
        top2_2nd_expert_sampling=cfg.moe_top2_2nd_expert_sampling,
    ).train(training)
    with torch.no_grad():
        gate.wg.weight.copy_(weight)
    return gate


def stacked(value) -> torch.Tensor:
    return torch.stack(list(value)) if isinstance(value, (list, tuple)) else value


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("mode", list(MODES))
def test_router_equals_deepspeed_topkgate(mode, training):
    num_experts = 6
    cfg = ModelConfig(hidden_size=HIDDEN, num_experts=[num_experts], moe_eval_capacity_factor=0.8, **MODES[mode])
    torch.manual_seed(0)
    router = Router(cfg, num_experts).train(training)
    gate = deepspeed_gate(cfg, num_experts, router.weight, training)
    for tokens in (40, 64, 200):
        x = torch.randn(tokens, HIDDEN) * 3
        for seed in range(5):
            torch.manual_seed(seed)
            routing = router(x)
            torch.manual_seed(seed)
            l_aux, combine, _, counts = gate(x)
            torch.manual_seed(seed)
            sparse = gate(x, sparse_routes=True)
            assert routing.capacity == combine.shape[2]
            assert torch.equal(dense_from_routing(routing), combine)
            assert torch.equal(routing.aux_loss, l_aux)
            assert torch.equal(routing.tokens_per_expert_E, counts)
            ids = torch.where(routing.kept_TK, routing.expert_ids_TK, -1).T
            assert torch.equal(ids.to(stacked(sparse[3]).dtype), stacked(sparse[3]))
            assert torch.equal(routing.weights_TK.detach().T, stacked(sparse[5]).detach())

"""The default router against an independent re-statement of DeepSpeed 0.19.x's gating functions.

The reference below builds the dense [S, E, C] combine tensor the old (<= 0.19.3) way, draws its noise
through `torch.distributions` exactly as DeepSpeed does, and is compared with the router's [T, K] routes
scattered back into [S, E, C]: capacity, per-token dispatch and weights, exp_counts and aux loss, for
random inputs in every mode, including the random ones (RSample, Jitter, RTS, 2nd-expert sampling) from
the same torch seed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributions import Gumbel, Uniform

from moetron.model.config import ModelConfig
from moetron.model.moe.routing.deepspeed_gating import gumbel_rsample, uniform_rsample
from moetron.model.moe.routing.router import Router, Routing

HIDDEN = 12
# DeepSpeed's choices (topk ties, RNG streams) are device-specific: compare on every device present.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


# ---------------------------------------------------------------- reference (dense, DeepSpeed's order of ops)
def ref_capacity(num_tokens, num_experts, factor, min_capacity):
    capacity = torch.ceil((num_tokens / num_experts) * torch.tensor(factor)).to(torch.int64)
    return max(int(capacity), min_capacity)


def ref_dense(gates_SE, locations_SE, mask_SE, capacity):
    """combine[s, e, c] = gate[s, e] at c = location[s, e] for routed (s, e)."""
    slot_onehot_SEC = F.one_hot(locations_SE * mask_SE, capacity).float()
    return gates_SE.unsqueeze(2) * slot_onehot_SEC * mask_SE.unsqueeze(2)


def on(device, value):
    return torch.tensor(value, device=device)


def ref_top1(logits, cf, min_cap, noisy, drop, rts):
    S, E = logits.shape
    dev = logits.device
    if noisy == "RSample":
        noisy_logits = logits + Gumbel(on(dev, 0.0), on(dev, 1.0)).rsample(logits.shape)
    gates = F.softmax(logits, dim=1)
    capacity = ref_capacity(S, E, cf, min_cap)
    mask1 = F.one_hot(torch.argmax(noisy_logits if noisy == "RSample" else gates, dim=1), E)
    counts = mask1.sum(0)
    if not drop:
        capacity = min(int(counts.max()), S)
    l_aux = torch.sum(gates.mean(0) * mask1.float().mean(0)) * E
    keys = mask1 * Uniform(on(dev, 0.0), on(dev, 1.0)).rsample(mask1.shape) if rts else mask1
    top = torch.topk(keys, k=min(capacity, S), dim=0)[1]
    mask1 = mask1 * torch.zeros_like(mask1).scatter_(0, top, 1)
    locations = torch.cumsum(mask1, dim=0) - 1
    combine = ref_dense(gates * mask1, locations, mask1, capacity)
    return l_aux, capacity, combine, counts


def ref_top2(logits, cf, min_cap, drop, sampling):
    S, E = logits.shape
    gates = F.softmax(logits, dim=1)
    mask1 = F.one_hot(torch.argmax(gates, dim=1), E)
    if sampling:
        logits = logits + Gumbel(on(logits.device, 0.0), on(logits.device, 1.0)).rsample(logits.shape)
    mask2 = F.one_hot(torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1), E)
    loc1 = torch.cumsum(mask1, 0) - 1
    loc2 = torch.cumsum(mask2, 0) - 1 + mask1.sum(0, keepdim=True)
    l_aux = torch.mean(gates.mean(0) * mask1.float().mean(0)) * E * E
    counts = (mask1 + mask2).sum(0)
    if drop:
        capacity = ref_capacity(S, E, cf * 2, min_cap)
        mask1 = mask1 * (loc1 < capacity)
        mask2 = mask2 * (loc2 < capacity)
    else:
        capacity = int(counts.max())
    g1 = (gates * mask1).sum(1)
    g2 = (gates * mask2).sum(1)
    denom = torch.clamp(g1 + g2, min=torch.finfo(torch.float32).eps)
    combine = ref_dense((g1 / denom)[:, None] * mask1, loc1, mask1, capacity)
    combine = combine + ref_dense((g2 / denom)[:, None] * mask2, loc2, mask2, capacity)
    return l_aux, capacity, combine, counts


def ref_topk(logits, k, cf, min_cap, drop):
    S, E = logits.shape
    gates = F.softmax(logits, dim=1)
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, True)
    counts = mask.sum(0)
    l_aux = torch.mean(gates.mean(0) * mask.float().mean(0)) * E * E / k
    if drop:
        capacity = ref_capacity(S, E, cf * k, min_cap)
        ranked = torch.zeros_like(gates).scatter(1, top_idx, top_gate)
        rows = torch.topk(ranked, k=min(capacity, S), dim=0, sorted=False)[1]
        mask &= torch.zeros_like(mask).scatter_(0, rows, True)
    else:
        capacity = int(counts.max())
    locations = torch.cumsum(mask, dim=0) - 1
    gates_masked = gates * mask
    weights = gates_masked / torch.clamp(gates_masked.sum(-1, keepdim=True), min=torch.finfo(torch.float32).eps)
    return l_aux, capacity, ref_dense(weights, locations, mask.long(), capacity), counts


def ref_gate(x, weight, cfg: ModelConfig, training: bool):
    """DeepSpeed's TopKGate.forward: fp32 input, Jitter in training, fp32 logits, then the k-specific gating."""
    x = x.float()
    if cfg.moe_noisy_gate_policy == "Jitter" and training:
        x = x * Uniform(on(x.device, 1.0 - 0.01), on(x.device, 1.0 + 0.01)).rsample(x.shape)
    logits = F.linear(x, weight.float())
    cf = cfg.moe_train_capacity_factor if training else cfg.moe_eval_capacity_factor
    drop = cfg.moe_token_dropping
    if cfg.topk == 1:
        noisy = cfg.moe_noisy_gate_policy if training else None
        return ref_top1(logits, cf, cfg.moe_min_capacity, noisy, drop, cfg.moe_use_rts)
    if cfg.topk == 2:
        return ref_top2(logits, cf, cfg.moe_min_capacity, drop, cfg.moe_top2_2nd_expert_sampling)
    return ref_topk(logits, cfg.topk, cf, cfg.moe_min_capacity, drop)


def dense_from_routing(routing: Routing) -> torch.Tensor:
    """Scatter the router's kept routes into DeepSpeed's [S, E, C] combine tensor."""
    T, K = routing.expert_ids_TK.shape
    combine = torch.zeros(T, routing.num_experts, routing.capacity, device=routing.weights_TK.device)
    tokens, ks = routing.kept_TK.nonzero(as_tuple=True)
    experts, slots = routing.expert_ids_TK[tokens, ks], routing.slots_TK[tokens, ks]
    combine[tokens, experts, slots] = routing.weights_TK.detach()[tokens, ks]
    return combine


# ---------------------------------------------------------------- the comparisons
MODES = {
    "top1-rts": dict(topk=1),
    "top1-no-rts": dict(topk=1, moe_use_rts=False),
    "top1-rsample": dict(topk=1, moe_noisy_gate_policy="RSample"),
    "top1-jitter-cf2": dict(topk=1, moe_noisy_gate_policy="Jitter", moe_train_capacity_factor=2.0),
    "top1-dropless": dict(topk=1, moe_token_dropping=False),
    "top1-dropless-no-rts": dict(topk=1, moe_token_dropping=False, moe_use_rts=False),
    "top2-sampling": dict(topk=2),
    "top2-no-sampling-cf0.5": dict(topk=2, moe_top2_2nd_expert_sampling=False, moe_train_capacity_factor=0.5),
    "top2-jitter": dict(topk=2, moe_noisy_gate_policy="Jitter"),
    "top2-dropless": dict(topk=2, moe_token_dropping=False),
    "top3": dict(topk=3),
    "top3-cf0.7-min1": dict(topk=3, moe_train_capacity_factor=0.7, moe_min_capacity=1),
    "top4-dropless": dict(topk=4, moe_token_dropping=False),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("mode", list(MODES))
def test_router_matches_deepspeed_reference(mode, training, device):
    num_experts = 6
    cfg = ModelConfig(hidden_size=HIDDEN, num_experts=[num_experts], moe_eval_capacity_factor=0.8, **MODES[mode])
    torch.manual_seed(0)
    router = Router(cfg, num_experts).train(training).to(device)
    # Peaked logits make some experts overflow, so dropping is exercised.
    x = torch.randn(40, HIDDEN, device=device) * 3
    for seed in range(3):
        torch.manual_seed(seed)
        routing = router(x)
        torch.manual_seed(seed)
        l_aux, capacity, combine, counts = ref_gate(x, router.weight.detach(), cfg, training)
        assert routing.capacity == capacity
        assert torch.equal(routing.tokens_per_expert_E, counts)
        assert torch.equal(dense_from_routing(routing), combine), "dispatch slots or weights differ"
        torch.testing.assert_close(routing.aux_loss, l_aux, rtol=0, atol=0)
        assert torch.equal(routing.kept_TK.float().sum(), (combine > 0).float().sum())


def test_random_streams_match_torch_distributions():
    torch.manual_seed(3)
    expected = Gumbel(torch.tensor(0.0), torch.tensor(1.0)).rsample((50, 7))
    torch.manual_seed(3)
    assert torch.equal(gumbel_rsample(torch.Size((50, 7)), torch.device("cpu")), expected)
    torch.manual_seed(4)
    expected = Uniform(torch.tensor(0.99), torch.tensor(1.01)).rsample((9, 5))
    torch.manual_seed(4)
    assert torch.equal(uniform_rsample(torch.Size((9, 5)), 0.99, 1.01, torch.device("cpu")), expected)


def test_top1_without_rts_keeps_topk_tie_break_not_first_tokens():
    """All tokens to one expert, RTS off: the survivors are whatever torch.topk picks among equal keys."""
    cfg = ModelConfig(hidden_size=HIDDEN, num_experts=[4], topk=1, moe_use_rts=False, moe_min_capacity=1)
    router = Router(cfg, 4)
    with torch.no_grad():
        router.weight.zero_()
        router.weight[2, 0] = 1.0
    x = torch.zeros(64, HIDDEN)
    x[:, 0] = 1.0
    routing = router(x)
    assert routing.capacity == 16
    mask_SE = F.one_hot(torch.full((64,), 2), 4)
    expected_rows = torch.topk(mask_SE, k=16, dim=0)[1][:, 2].sort().values
    assert torch.equal(routing.kept_TK[:, 0].nonzero()[:, 0], expected_rows)
    assert torch.equal(routing.slots_TK[expected_rows, 0], torch.arange(16))

"""The fast paths of the MoE router against the straightforward computations they replace (bitwise)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moetron.model.moe import dispatch
from moetron.model.moe.routing import generic_gating
from moetron.model.moe.routing.deepspeed_gating import (
    Routing,
    buffer_slots,
    first_argmax,
    keep_top_keys,
    keep_top_keys_top1,
    keep_top_random_keys_top1,
    route_counts,
    route_fraction,
)
from moetron.model.moe.routing.generic_gating import slots_in_token_order, top_experts
from moetron.model.moe.routing.router import z_loss, z_loss_from_route


def _reference_top1_keep(ids_T: torch.Tensor, keys_TE: torch.Tensor, capacity: int) -> torch.Tensor:
    """The [T, E] form: DeepSpeed's topk over the masked keys, then read at each token's expert."""
    mask_TE = F.one_hot(ids_T, keys_TE.shape[1])
    kept_TE = keep_top_keys(mask_TE, mask_TE * keys_TE, capacity, sort=True)
    return kept_TE.gather(1, ids_T.unsqueeze(1)).squeeze(1).bool()


@pytest.mark.parametrize("num_experts", [9, 16, 64, 130])  # the amax form; `max(dim=1)` from 16 experts on
@pytest.mark.parametrize("seed", range(5))
def test_first_argmax_is_argmax_with_ties(seed, num_experts):
    g = torch.Generator().manual_seed(seed)
    x_TE = torch.randint(0, 4, (300, num_experts), generator=g).float()  # many ties
    x_TE[::7, 3] = float("-inf")
    x_TE[5] = float("-inf")
    x_TE[6, :] = 2.0
    assert torch.equal(first_argmax(x_TE), torch.argmax(x_TE, dim=1))


@pytest.mark.parametrize("capacity", [0, 1, 7, 25, 40, 1000])
@pytest.mark.parametrize("seed", range(4))
def test_random_key_keep_matches_topk(capacity, seed):
    g = torch.Generator().manual_seed(seed)
    ids_T = torch.randint(0, 8, (200,), generator=g)
    rand_TE = torch.rand(200, 8, generator=g)
    expected = _reference_top1_keep(ids_T, rand_TE, capacity)
    assert torch.equal(keep_top_random_keys_top1(ids_T, rand_TE, capacity), expected)
    assert torch.equal(keep_top_keys_top1(ids_T, F.one_hot(ids_T, 8) * rand_TE, capacity), expected)


@pytest.mark.parametrize("capacity", [3, 10, 30])
def test_random_key_keep_falls_back_on_ties_and_zero_keys(capacity):
    g = torch.Generator().manual_seed(0)
    ids_T = torch.randint(0, 4, (100,), generator=g)
    for rand_TE in (torch.full((100, 4), 0.5), torch.randint(0, 3, (100, 4), generator=g) / 4):
        assert torch.equal(
            keep_top_random_keys_top1(ids_T, rand_TE, capacity), _reference_top1_keep(ids_T, rand_TE, capacity)
        )


def test_route_counts_and_fraction_are_the_mask_forms():
    g = torch.Generator().manual_seed(2)
    ids_TK = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(333)])  # distinct experts per token
    mask_TE = torch.zeros(333, 6).scatter_(1, ids_TK, 1.0)
    assert torch.equal(route_counts(ids_TK, 6), mask_TE.sum(0).long())
    assert torch.equal(route_fraction(route_counts(ids_TK[:, 0], 6), 333), F.one_hot(ids_TK[:, 0], 6).float().mean(0))


def test_buffer_slots_token_and_choice_order():
    g = torch.Generator().manual_seed(1)
    ids_TK = torch.stack([torch.randperm(5, generator=g)[:2] for _ in range(40)])
    kept_TK = torch.rand(40, 2, generator=g) > 0.3
    kept_TE = torch.zeros(40, 5, dtype=torch.bool).scatter_(1, ids_TK, kept_TK)
    token = slots_in_token_order(kept_TE).gather(1, ids_TK)
    assert torch.equal(buffer_slots(ids_TK, kept_TK, 5, "token"), torch.where(kept_TK, token, -1))
    all_TK = torch.ones_like(kept_TK)
    first_TE, second_TE = (F.one_hot(ids_TK[:, k], 5) for k in (0, 1))
    choice = torch.stack(
        [slots_in_token_order(first_TE), slots_in_token_order(second_TE) + first_TE.sum(0, keepdim=True)], 1
    ).gather(2, ids_TK.unsqueeze(2))[..., 0]
    assert torch.equal(buffer_slots(ids_TK, all_TK, 5, "choice"), choice)
    with pytest.raises(ValueError, match="slot order"):
        buffer_slots(ids_TK, all_TK, 5, "expert")


def test_z_loss_from_the_first_route_and_lazy_routing_fields():
    logits_TE = torch.randn(64, 8) * 4
    probs_TE = logits_TE.softmax(-1)
    first_T1 = probs_TE.argmax(-1, keepdim=True)
    torch.testing.assert_close(
        z_loss_from_route(logits_TE.gather(1, first_T1), probs_TE.gather(1, first_T1)), z_loss(logits_TE)
    )
    ids_TK = first_T1
    routing = Routing(
        ids_TK,
        probs_TE.gather(1, ids_TK),
        torch.ones_like(ids_TK, dtype=torch.bool),
        64,
        torch.zeros(()),
        route_counts(ids_TK, 8),
        probs_TE,
    )
    assert routing.z_loss.item() == 0.0  # no source set: zero
    routing.z_loss_source = lambda: torch.tensor(3.0)
    assert routing.z_loss.item() == 3.0 and routing.z_loss_source.item() == 3.0  # computed once, then kept
    assert routing.slots_TK is routing.slots_TK  # cached
    assert int(routing.slots_TK.max()) == int(route_counts(ids_TK, 8).max()) - 1


@pytest.mark.parametrize("num_experts", [3, 8, 63, 64, 65, 128, 200])
@pytest.mark.parametrize("k", [1, 2])
def test_top_experts_equals_topk_with_ties(num_experts, k):
    """The k = 1 `max` shortcut (64+ experts) picks topk's index, ties and NaN included; otherwise it is topk."""
    g = torch.Generator().manual_seed(num_experts + k)
    x_TE = torch.randint(0, 4, (257, num_experts), generator=g).float() / 3  # many ties
    x_TE[3, 1] = float("nan")
    x_TE[5, :3] = float("nan")
    x_TE[6, :] = 0.5
    assert torch.equal(top_experts(x_TE, k), torch.topk(x_TE, k=k, dim=1).indices)


def _weighted_index_add_reference(y_RD, weights_R, token_R, rows):
    """One pass, plain autograd ops: the form `WeightedIndexAdd` computes chunk by chunk."""
    return y_RD.new_zeros(rows, y_RD.shape[1]).index_add(0, token_R, y_RD * weights_R[:, None])


@pytest.mark.parametrize("topk", [1, 2])
def test_chunked_weighted_index_add_is_bitwise_one_pass(monkeypatch, topk):
    monkeypatch.setattr(dispatch, "CHUNK_BYTES", 7 * 16 * 4)  # 7-row chunks: several, the last one partial
    g = torch.Generator().manual_seed(topk)
    num_tokens, hidden = 25, 16
    order_R = torch.randperm(num_tokens * topk, generator=g)
    token_R = order_R // topk
    y_RD = torch.randn(num_tokens * topk, hidden, generator=g)
    weights_R = torch.rand(num_tokens * topk, generator=g)
    grad_TD = torch.randn(num_tokens, hidden, generator=g)
    outs = []
    for fn in (dispatch.WeightedIndexAdd.apply, _weighted_index_add_reference):
        y, w = y_RD.clone().requires_grad_(), weights_R.clone().requires_grad_()
        out = fn(y, w, token_R, num_tokens)
        out.backward(grad_TD)
        outs.append((out.detach(), y.grad, w.grad))
    for new, ref in zip(*outs, strict=True):
        assert torch.equal(new, ref)


def test_dropless_layer_with_the_fast_paths_is_bitwise_the_layer_without(monkeypatch):
    """MoE layer, Mixtral routing at E=64 k=1 (the `max` selection applies), several combine chunks: output and
    every gradient equal the layer run with topk, autograd's mean and gather, and a one-pass combine (what
    `moe_layer.py --fast-paths` times)."""
    from moetron.model.config import ModelConfig
    from moetron.model.moe.layer import MoELayer

    cfg = ModelConfig(hidden_size=16, num_attention_heads=1, ffn_hidden_size=32, swiglu=True)
    cfg.add_bias_linear, cfg.num_experts, cfg.topk = False, [64], 1
    cfg.moe_token_dropping, cfg.moe_router_topk_renorm = False, True
    layer = MoELayer(cfg, 64, layer_index=0)
    g = torch.Generator().manual_seed(0)
    x_BTD = torch.randn(2, 200, 16, generator=g)
    grad_BTD = torch.randn(2, 200, 16, generator=g)
    fast = (generic_gating.top_experts, 37 * 16 * 4, generic_gating.MeanAndGather)  # 37-row chunks

    def run(top_experts, chunk_bytes, mean_and_gather):
        monkeypatch.setattr(generic_gating, "top_experts", top_experts)
        monkeypatch.setattr(dispatch, "CHUNK_BYTES", chunk_bytes)
        monkeypatch.setattr(generic_gating, "MeanAndGather", mean_and_gather)
        layer.zero_grad(set_to_none=True)
        x = x_BTD.clone().requires_grad_()
        y, _aux = layer(x)
        y.backward(grad_BTD)
        return [y.detach(), x.grad, *(p.grad for p in layer.parameters() if p.grad is not None)]

    with_paths = run(*fast)
    without = run(lambda select_TE, k: torch.topk(select_TE, k=k, dim=1).indices, 1 << 62, _AutogradMeanAndGather)
    assert len(with_paths) == len(without) == 6  # output, input, router weight, the three expert weights
    for new, ref in zip(with_paths, without, strict=True):
        assert torch.equal(new, ref)


@pytest.mark.parametrize("topk", [1, 2])
def test_mean_and_gather_is_bitwise_autograds_mean_and_gather(topk):
    g = torch.Generator().manual_seed(topk)
    logits_TE = torch.randn(300, 16, generator=g)
    ids_TK = torch.topk(logits_TE, topk, dim=1).indices
    grad_E, grad_TK = torch.randn(16, generator=g), torch.randn(300, topk, generator=g)
    grads = []
    for fused in (True, False):
        logits = logits_TE.clone().requires_grad_()
        probs_TE = torch.softmax(logits, -1)
        mean_E, route_TK = (
            generic_gating.MeanAndGather.apply(probs_TE, ids_TK)
            if fused
            else (probs_TE.mean(0), probs_TE.gather(1, ids_TK))
        )
        ((mean_E * grad_E).sum() + (route_TK * grad_TK).sum()).backward()
        grads.append((mean_E.detach(), route_TK.detach(), logits.grad))
    for new, ref in zip(*grads, strict=True):
        assert torch.equal(new, ref)


class _AutogradMeanAndGather:
    """What `MeanAndGather` replaces: autograd's own mean and gather (two [T, E] gradients, summed)."""

    @staticmethod
    def apply(probs_TE, ids_TK):
        return probs_TE.mean(0), probs_TE.gather(1, ids_TK)


@pytest.mark.parametrize("drop", [True, False], ids=["capacity", "dropless"])
def test_deepspeed_top1_layer_with_mean_and_gather_is_bitwise_autograds(monkeypatch, drop):
    """DeepSpeed's top-1 gating (RTS, capacity 1.0 or dropless) shares `MeanAndGather` with the generic path: the
    layer's output and every gradient equal those with autograd's mean and gather."""
    from moetron.model.config import ModelConfig
    from moetron.model.moe.layer import MoELayer
    from moetron.model.moe.routing import deepspeed_gating

    cfg = ModelConfig(hidden_size=16, num_attention_heads=1, ffn_hidden_size=32, swiglu=True)
    cfg.add_bias_linear, cfg.num_experts, cfg.topk = False, [64], 1
    cfg.moe_train_capacity_factor, cfg.moe_min_capacity, cfg.moe_token_dropping = 1.0, 4, drop
    cfg.moe_loss_coeff = 0.1  # a visible aux-loss gradient
    layer = MoELayer(cfg, 64, layer_index=0)
    g = torch.Generator().manual_seed(4)
    x_BTD, grad_BTD = torch.randn(2, 200, 16, generator=g), torch.randn(2, 200, 16, generator=g)
    runs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(deepspeed_gating, "MeanAndGather", _AutogradMeanAndGather)
        layer.zero_grad(set_to_none=True)
        x = x_BTD.clone().requires_grad_()
        torch.manual_seed(0)  # the same RTS draws
        y, _aux = layer(x)
        y.backward(grad_BTD)
        runs.append([y.detach(), x.grad, *(p.grad for p in layer.parameters())])
    assert len(runs[0]) == 6
    for new, ref in zip(*runs, strict=True):
        assert torch.equal(new, ref)

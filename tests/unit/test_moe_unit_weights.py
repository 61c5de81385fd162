"""Top-1 routing whose kept weights are exactly 1 (`Routing.unit_weights`): the combine skips the product and the
weights' gradient. Same output and expert gradients bit for bit; the router's gradient becomes exactly its aux
loss's (the skipped path contributed only the rounding of s / s's backward, whose true value is 0)."""

from __future__ import annotations

import pytest
import torch

from moetron.model.config import ModelConfig
from moetron.model.moe.layer import MoELayer
from moetron.model.moe.routing import generic_gating

E, D, F = 64, 16, 32  # 64 experts: the CPU top-1 `max` selection applies too


def _cfg(**routing) -> ModelConfig:
    cfg = ModelConfig(hidden_size=D, num_attention_heads=1, ffn_hidden_size=F, swiglu=True)
    cfg.add_bias_linear, cfg.num_experts, cfg.topk = False, [E], 1
    cfg.moe_token_dropping, cfg.moe_router_topk_renorm = False, True  # Mixtral routing
    for name, value in routing.items():
        setattr(cfg, name, value)
    return cfg


@pytest.mark.parametrize(
    ("routing", "unit"),
    [
        (dict(), True),
        (dict(moe_router_pre_softmax=True, moe_router_topk_renorm=False), True),
        (dict(moe_token_dropping=True, moe_train_capacity_factor=0.5), True),
        (dict(moe_router_topk_renorm=False), False),  # the raw top score
        (dict(moe_router_topk_scaling_factor=2.0), False),
        (dict(moe_router_score_function="sigmoid"), False),  # a score below eps renormalises to s / eps
        (dict(topk=2), False),
    ],
)
def test_unit_weights_flag_holds_exactly_where_every_kept_weight_is_one(routing, unit):
    cfg = _cfg(**routing)
    layer = MoELayer(cfg, E, layer_index=0)
    x_TD = torch.randn(300, D, generator=torch.Generator().manual_seed(0)) * 3
    routing_out = layer.router(x_TD)
    assert routing_out.unit_weights is unit
    if unit:
        kept = routing_out.weights_TK[routing_out.kept_TK]
        assert torch.equal(kept, torch.ones_like(kept))


def _step(layer: MoELayer, x_BTD: torch.Tensor, grad_BTD: torch.Tensor) -> dict[str, torch.Tensor]:
    layer.zero_grad(set_to_none=True)
    x = x_BTD.clone().requires_grad_()
    y, _aux = layer(x)
    y.backward(grad_BTD)
    return {"y": y.detach(), "x": x.grad, **{name: p.grad for name, p in layer.named_parameters()}}


@pytest.mark.parametrize("dropping", [False, True])
def test_unit_weights_skip_the_product_exactly_and_leave_the_router_its_aux_loss_gradient(monkeypatch, dropping):
    cfg = _cfg(moe_token_dropping=dropping, moe_train_capacity_factor=0.5)
    layer = MoELayer(cfg, E, layer_index=0)
    g = torch.Generator().manual_seed(1)
    x_BTD, grad_BTD = torch.randn(2, 200, D, generator=g), torch.randn(2, 200, D, generator=g)
    unit = _step(layer, x_BTD, grad_BTD)
    monkeypatch.setattr(generic_gating, "has_unit_weights", lambda cfg, k: False)
    weighted = _step(layer, x_BTD, grad_BTD)
    for name in ("y", "experts.w1_EDF", "experts.w3_EDF", "experts.w2_EFD"):
        assert torch.equal(unit[name], weighted[name]), name  # · 1.0 is exact, so the experts see the same
    monkeypatch.undo()
    x = x_BTD.clone().requires_grad_()
    _y, aux = layer(x)
    (aux_only,) = torch.autograd.grad(aux.loss(cfg), layer.router.weight)
    assert torch.equal(unit["router.weight"], aux_only)
    torch.testing.assert_close(unit["router.weight"], weighted["router.weight"], rtol=0, atol=1e-4)
    torch.testing.assert_close(unit["x"], weighted["x"])


def test_unit_weights_stay_off_where_they_are_the_gates_only_gradient():
    """aux-loss type none, no z-loss: skipping the weights would leave the gate without a gradient (skipped by the
    optimizer, an unused parameter to DDP), so the combine multiplies by them as before."""
    layer = MoELayer(_cfg(moe_aux_loss_type="none"), E, layer_index=0)
    x = torch.randn(2, 50, D, generator=torch.Generator().manual_seed(2), requires_grad=True)
    y, aux = layer(x)
    assert not aux.routing.unit_weights
    y.sum().backward()
    assert layer.router.weight.grad is not None
    with torch.no_grad():
        assert layer(x)[1].routing.unit_weights  # no gradient at all: nothing to keep

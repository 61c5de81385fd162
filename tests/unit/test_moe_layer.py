"""MoELayer and the local dispatcher against a plain loop-over-experts reference (values and gradients)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moetron.model.config import ModelConfig
from moetron.model.moe.aux_loss import aux_loss_grad_scale
from moetron.model.moe.dispatch import permute, unpermute
from moetron.model.moe.experts.backends import GROUP_ALIGN, grouped_mm_supported
from moetron.model.moe.layer import MoEAux, MoELayer
from moetron.model.moe.stats import MoEStats, MoEStepRecord

B, T, D, F = 2, 16, 16, 32


def _cfg(**kw) -> ModelConfig:
    base = dict(hidden_size=D, num_attention_heads=2, num_layers=4, ffn_hidden_size=F, num_experts=[8], topk=1)
    base.update(kw)
    return ModelConfig(**base)


def _layer(cfg: ModelConfig, num_experts: int = 8) -> MoELayer:
    layer = MoELayer(cfg, num_experts, layer_index=1)
    layer.init_weights(std=0.3, out_std=0.2, seed=3)
    with torch.no_grad():  # biases are zero at init; make them count in the comparison
        for name, p in layer.named_parameters():
            if name.endswith(("b1_EF", "b2_ED")):
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    return layer


# ---------------------------------------------------------------- the reference
def _expert(layer_experts, e: int, x: torch.Tensor) -> torch.Tensor:
    ex = layer_experts
    h = x @ ex.w1_EDF[e] + (ex.b1_EF[e] if ex.b1_EF is not None else 0)
    h = ex.activation(h)
    if ex.w3_EDF is not None:
        h = h * (x @ ex.w3_EDF[e])
    return h @ ex.w2_EFD[e] + (ex.b2_ED[e] if ex.b2_ED is not None else 0)


def reference_forward(layer: MoELayer, x_BTD: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Loop over experts and route slots with boolean masks; the same routing (same RNG seed) as the layer.
    Returns (y, the weighted aux loss the layer attaches to its output)."""
    x_TD = x_BTD.reshape(-1, D)
    torch.manual_seed(seed)
    routing = layer.router(x_TD, seq_len=x_BTD.shape[1])
    y_TD = torch.zeros_like(x_TD)
    for e in range(layer.num_experts):
        for k in range(routing.topk):
            rows = ((routing.expert_ids_TK[:, k] == e) & routing.kept_TK[:, k]).nonzero().squeeze(1)
            out = _expert(layer.experts, e, x_TD[rows]) * routing.weights_TK[rows, k, None]
            y_TD = y_TD.index_add(0, rows, out)
    if layer.mlp is not None:
        p = torch.softmax(x_TD @ layer.coefficient.weight.T + layer.coefficient.bias, dim=-1)
        y_TD = y_TD * p[:, 0:1] + _expert(layer.mlp, 0, x_TD) * p[:, 1:2]
    if layer.shared_experts is not None:
        shared = _expert(layer.shared_experts, 0, x_TD)
        if layer.shared_expert_gate is not None:
            shared = shared * torch.sigmoid(x_TD @ layer.shared_expert_gate.weight.T)
        y_TD = y_TD + shared
    cfg = layer.cfg
    return y_TD.view_as(x_BTD), cfg.moe_loss_coeff * routing.aux_loss + cfg.moe_z_loss_coeff * routing.z_loss


def _grads(layer: MoELayer, x: torch.Tensor, y: torch.Tensor, extra_loss: torch.Tensor | float = 0.0):
    """Gradients of (y · g).sum() + extra_loss w.r.t. x and every parameter."""
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(9))
    names, params = zip(*[(n, p) for n, p in layer.named_parameters()], strict=True)
    grads = torch.autograd.grad((y * g).sum() + extra_loss, [x, *params], allow_unused=True)
    return dict(zip(["x", *names], grads, strict=True))


def assert_layer_matches_reference(layer: MoELayer, seed: int = 0) -> MoEAux:
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    torch.manual_seed(seed)
    y, aux = layer(x)
    ref, ref_aux_loss = reference_forward(layer, x, seed)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    # the layer's output carries its aux loss's gradient: compare with the reference's explicit sum
    got, want = _grads(layer, x, y), _grads(layer, x, ref, ref_aux_loss)
    assert got["router.weight"] is not None and got["router.weight"].abs().sum() > 0
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    return aux


def _backends() -> list[str]:
    ok = grouped_mm_supported(torch.device("cpu"), torch.float32, D, F)
    return ["grouped_mm", "batched", "loop"] if ok else ["batched", "loop"]


# ---------------------------------------------------------------- routing modes x backends
MODES = {
    "top1-capacity-drops": dict(topk=1, moe_train_capacity_factor=0.5, moe_min_capacity=1),
    "top2-capacity-drops": dict(topk=2, moe_train_capacity_factor=0.5, moe_min_capacity=1),
    "top4-capacity": dict(topk=4, moe_train_capacity_factor=0.75, moe_min_capacity=1),
    "top2-dropless": dict(topk=2, moe_token_dropping=False),
    "top1-dropless-swiglu-nobias": dict(topk=1, moe_token_dropping=False, swiglu=True, add_bias_linear=False),
    "top2-mixtral-style": dict(topk=2, moe_router_pre_softmax=True, moe_token_dropping=False, swiglu=True),
}


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("mode", list(MODES))
def test_layer_matches_loop_reference(mode: str, backend: str) -> None:
    layer = _layer(_cfg(moe_expert_backend=backend, **MODES[mode]))
    aux = assert_layer_matches_reference(layer)
    if "drops" in mode:
        assert aux.dropped_routes.item() > 0  # the mode really drops routes
    if "dropless" in mode:
        assert aux.dropped_routes.item() == 0


@pytest.mark.parametrize("shared_gate", [False, True])
def test_shared_experts_match_reference(shared_gate: bool) -> None:
    layer = _layer(_cfg(topk=2, num_shared_experts=2, shared_expert_gate=shared_gate, moe_min_capacity=1))
    assert layer.shared_experts.ffn == 2 * F
    assert_layer_matches_reference(layer)


def test_residual_moe_matches_reference() -> None:
    layer = _layer(_cfg(topk=1, mlp_type="residual", moe_train_capacity_factor=0.5, moe_min_capacity=1))
    assert layer.coefficient.bias is not None and layer.mlp.ffn == F
    assert_layer_matches_reference(layer)


# ---------------------------------------------------------------- dispatcher functions
def test_permute_groups_rows_by_expert_in_token_order_and_skips_drops() -> None:
    x_TD = torch.arange(4.0).unsqueeze(1).expand(4, 2)
    ids_TK = torch.tensor([[2, 0], [0, 1], [2, 1], [1, 0]])
    kept_TK = torch.tensor([[True, True], [True, False], [True, True], [True, True]])
    x_RD, counts_E, order_R, kept_R = permute(x_TD, ids_TK, kept_TK, num_experts=3)
    assert counts_E.tolist() == [3, 2, 2]
    # expert 0: tokens 0,1,3; expert 1: 2,3; expert 2: 0,2; then the dropped route (token 1's second choice)
    assert x_RD[:, 0].tolist() == [0, 1, 3, 2, 3, 0, 2, 1]
    assert kept_R.tolist() == [True] * 7 + [False]
    weights_TK = torch.tensor([[0.5, 0.25], [1.0, 0.0], [0.5, 0.5], [0.75, 0.25]])
    y_RD = (x_RD * 10).index_fill(0, torch.tensor([7]), float("nan"))  # the tail is never computed: any value
    y_TD = unpermute(y_RD, order_R, weights_TK, num_tokens=4, kept_R=kept_R)
    torch.testing.assert_close(y_TD[:, 0], torch.tensor([0.0, 10.0, 20.0, 30.0]))


def test_unpermute_token_without_kept_route_is_zero_and_grads_flow() -> None:
    x_TD = torch.randn(3, 4, requires_grad=True)
    ids_TK = torch.tensor([[0], [1], [1]])
    weights_TK = torch.tensor([[0.5], [0.0], [2.0]], requires_grad=True)
    kept_TK = torch.tensor([[True], [False], [True]])
    x_RD, counts_E, order_R, kept_R = permute(x_TD, ids_TK, kept_TK, num_experts=2)
    y_TD = unpermute(x_RD * 3, order_R, weights_TK, num_tokens=3, kept_R=kept_R)
    assert torch.equal(y_TD[1], torch.zeros(4))
    y_TD.sum().backward()
    torch.testing.assert_close(x_TD.grad[:, 0], torch.tensor([1.5, 0.0, 6.0]))
    torch.testing.assert_close(
        weights_TK.grad[:, 0], torch.stack([3 * x_TD[0].sum(), torch.tensor(0.0), 3 * x_TD[2].sum()]).detach()
    )


# ---------------------------------------------------------------- capacity, stats, losses
def test_eval_uses_eval_capacity_factor() -> None:
    layer = _layer(_cfg(topk=1, moe_train_capacity_factor=0.25, moe_eval_capacity_factor=8.0, moe_min_capacity=1))
    x = torch.randn(B, T, D)
    _, train_aux = layer(x)
    layer.eval()
    _, eval_aux = layer(x)
    assert train_aux.capacity == math.ceil(B * T / 8 * 0.25) and train_aux.dropped_routes.item() > 0
    assert eval_aux.capacity == math.ceil(B * T / 8 * 8.0) and eval_aux.dropped_routes.item() == 0
    assert eval_aux.tokens_per_expert_E.sum().item() == B * T


def test_attached_aux_loss_gives_the_summed_losses_gradient_times_the_scale() -> None:
    """d(lm)/d(router) with the aux loss attached = d(lm + aux.loss)/d(router), scaled like the LM loss."""
    cfg = _cfg(topk=2, moe_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    layer = _layer(cfg)
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(1))
    g = torch.randn(B, T, D, generator=torch.Generator().manual_seed(2))

    def router_grad(aux_scale: float, lm_scale: float, explicit_aux: bool = False) -> torch.Tensor:
        with aux_loss_grad_scale([layer], aux_scale):
            torch.manual_seed(0)
            y, aux = layer(x)
            loss = lm_scale * (y * g).sum() + (aux.loss(cfg) if explicit_aux else 0.0)
            return torch.autograd.grad(loss, layer.router.weight)[0]

    lm_part = router_grad(0.0, 1.0)  # the attached gradient switched off
    summed = router_grad(0.0, 1.0, explicit_aux=True)  # lm + aux.loss, summed by hand
    assert not torch.allclose(summed, lm_part)  # the aux loss really has a gradient here
    torch.testing.assert_close(router_grad(1.0, 1.0), summed)  # the default: lm_loss.backward() trains both
    torch.testing.assert_close(router_grad(0.25, 0.25), 0.25 * summed)  # an executor's loss scale / micro-batches
    assert layer.aux_loss_grad_scale == 1.0  # restored after the block


def test_aux_loss_is_uncoefficiented_and_loss_applies_coefficients() -> None:
    cfg = _cfg(topk=2, moe_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    _, aux = _layer(cfg)(torch.randn(B, T, D))
    torch.testing.assert_close(aux.aux_loss, aux.routing.aux_loss)
    torch.testing.assert_close(aux.loss(cfg), 0.1 * aux.aux_loss + 0.01 * aux.z_loss)


def test_step_record_gives_the_mean_of_the_named_statistics_over_training_forwards() -> None:
    layer = _layer(_cfg(topk=2, moe_train_capacity_factor=0.5, moe_min_capacity=1))
    layer(torch.randn(B, T, D))  # no record given: nothing is reported
    record = MoEStepRecord.attached_to([layer])
    auxes = [layer(torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed)))[1] for seed in (1, 2)]
    layer.eval()
    layer(torch.randn(B, T, D))  # evaluation forwards are not counted
    assert record.forwards == {layer.layer_index: 2} and record.routing_2E[layer.layer_index].shape == (2, 8)
    mean = record.step_stats([layer]).rows()[0]
    assert isinstance(mean, MoEStats) and mean.values.shape == (MoEStats.WIDTH,)
    loads = [a.tokens_per_expert_E.float() for a in auxes]
    torch.testing.assert_close(mean.load_max_over_mean, sum(x.max() / x.mean() for x in loads) / 2)
    torch.testing.assert_close(mean.dropped_fraction, sum(a.dropped_routes / (B * T * 2) for a in auxes).float() / 2)
    torch.testing.assert_close(mean.aux_loss, sum(a.aux_loss.detach() for a in auxes) / 2)
    torch.testing.assert_close(mean.z_loss, sum(a.z_loss.detach() for a in auxes) / 2)
    assert mean.ep_load_routed.item() == mean.ep_load_computed.item() == 1.0  # one process: one EP rank
    record.reset()
    assert record.forwards == record.stats == record.routing_2E == {}
    torch.testing.assert_close(record.step_stats([layer]).values, torch.zeros(1, MoEStats.WIDTH))  # ran none


def test_stacked_stats_read_by_name_and_price_the_moe_loss() -> None:
    a = MoEStats(torch.tensor([1.5, 0.25, 2.0, 4.0, 1.5, 1.0]))
    b = MoEStats(torch.tensor([1.0, 0.0, 1.0, 8.0, 2.0, 1.25]))
    stack = MoEStats.stack([a, b])
    assert stack.load_max_over_mean.tolist() == [1.5, 1.0] and stack.dropped_fraction.tolist() == [0.25, 0.0]
    assert MoEStats.from_flat(stack.values.flatten()).z_loss.tolist() == [4.0, 8.0]
    assert stack.moe_loss(0.5, 0.25).item() == 0.5 * 3.0 + 0.25 * 12.0
    assert stack.ep_load_routed.tolist() == [1.5, 2.0] and stack.ep_load_computed.tolist() == [1.0, 1.25]
    with pytest.raises(ValueError, match="6 values per layer"):
        MoEStats(torch.zeros(2, 3))


def test_no_dense_expert_capacity_tensor_is_built() -> None:
    """Behavioural: record every tensor the forward+backward creates; none may be [S, E, C]-sized."""
    cfg = _cfg(hidden_size=8, num_attention_heads=1, ffn_hidden_size=16, topk=2, moe_train_capacity_factor=2.0)
    layer, tokens = MoELayer(cfg, 16, layer_index=1), 512
    x = torch.randn(1, tokens, 8, requires_grad=True)

    class LargestTensor(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.largest = max(self.largest, t.numel())
            return out

    with LargestTensor() as mode:
        y, aux = layer(x)
        y.sum().backward()
    s_e_c = tokens * 16 * aux.capacity
    assert aux.capacity >= 128 and s_e_c >= 1_000_000
    padding = 16 * (GROUP_ALIGN - 1) + 1  # the grouped kernel's aligned groups (AlignedGroups)
    assert mode.largest <= (tokens * 2 + padding) * 16  # T·K·F: the largest legitimate activation


# ---------------------------------------------------------------- initialisation
def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


def test_init_weights_ignores_global_rng_and_construction_device() -> None:
    cfg = _cfg(topk=2, mlp_type="residual", num_shared_experts=1, shared_expert_gate=True)
    torch.manual_seed(1)
    a = MoELayer(cfg, 8, layer_index=2)
    torch.manual_seed(2)
    with torch.device("meta"):
        b = MoELayer(cfg, 8, layer_index=2)
    b.to_empty(device="cpu")
    for layer in (a, b):
        layer.init_weights(std=0.02, out_std=0.005, seed=42)
    state_a, state_b = _state(a), _state(b)
    for name in state_a:
        assert torch.equal(state_a[name], state_b[name]), name
    assert 0.004 < a.experts.w2_EFD.std().item() < 0.006
    bound = 1 / math.sqrt(D)
    assert a.router.weight.abs().max().item() <= bound and a.coefficient.bias.abs().max().item() <= bound


def test_layer_with_a_slice_of_experts_gets_the_full_layers_slice() -> None:
    cfg = _cfg(topk=2, swiglu=True)
    full = MoELayer(cfg, 8, layer_index=3)
    part = MoELayer(cfg, 8, layer_index=3, expert_offset=4, num_local_experts=4)
    for layer in (full, part):
        layer.init_weights(std=0.02, out_std=0.005, seed=5)
    assert part.experts.num_experts == 4 and part.experts.num_global_experts == 8
    assert torch.equal(part.router.weight, full.router.weight)
    for name in ("w1_EDF", "w3_EDF", "w2_EFD", "b1_EF", "b2_ED"):
        assert torch.equal(getattr(part.experts, name), getattr(full.experts, name)[4:]), name
    with pytest.raises(ValueError, match="expert-parallel dispatcher"):
        part(torch.randn(B, T, D))  # the local dispatcher would hand it all 8 experts' rows


def test_identical_expert_init_copies_one_template_including_the_residual_mlp() -> None:
    layer = MoELayer(_cfg(mlp_type="residual", moe_identical_expert_init=True), 8, layer_index=1)
    layer.init_weights(std=0.02, out_std=0.005, seed=5)
    for e in range(8):
        assert torch.equal(layer.experts.w1_EDF[e], layer.experts.w1_EDF[0])
    assert torch.equal(layer.mlp.w1_EDF[0], layer.experts.w1_EDF[0])  # DeepSpeed: the mlp IS the template


# ---------------------------------------------------------------- precision
def test_bf16_autocast_smoke() -> None:
    layer = _layer(_cfg(topk=2, swiglu=True, moe_token_dropping=False, num_shared_experts=1))
    x = torch.randn(B, T, D, requires_grad=True)
    torch.manual_seed(0)
    ref, _ = layer(x)
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, aux = layer(x)
    assert y.dtype == torch.bfloat16 and aux.aux_loss.dtype == torch.float32
    y.float().sum().backward()
    assert layer.router.weight.grad.dtype == torch.float32 and torch.isfinite(x.grad).all()
    torch.testing.assert_close(y.float(), ref, rtol=0.05, atol=0.05 * ref.abs().max().item())


def test_swapped_dispatcher_is_used() -> None:
    layer = _layer(_cfg(topk=1, moe_token_dropping=False))
    calls = []

    class Recording(type(layer.dispatcher)):
        def dispatch(self, x_TD, routing):
            calls.append("dispatch")
            return super().dispatch(x_TD, routing)

    layer.dispatcher = Recording(8)
    layer(torch.randn(B, T, D))
    assert calls == ["dispatch"]

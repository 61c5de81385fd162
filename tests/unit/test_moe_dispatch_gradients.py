"""How the dispatcher hands gradients back: values equal to autograd's own index_select backward, in tensors that let
autograd add the layer input's second gradient (the router's) in place; and dropless top-1's permutation path."""

from __future__ import annotations

import pytest
import torch

from moetron.model.config import ModelConfig
from moetron.model.moe import dispatch
from moetron.model.moe.dispatch import ExpertCounts, LocalContext, LocalDispatcher, PermuteRows, gather_rows, permute
from moetron.model.moe.layer import MoELayer


def test_gather_rows_gradient_is_index_selects_backward_in_a_whole_tensor():
    g = torch.Generator().manual_seed(0)
    src = torch.randn(10, 4, generator=g)
    index_R = torch.tensor([3, 0, 3, 9, 5, 1])
    keep_R = torch.tensor([True, True, False, True, True, False])
    grad_RA = torch.randn(6, 4, generator=g)
    x = src.clone().requires_grad_()
    gather_rows(x, index_R, keep_R).backward(grad_RA)
    want = src.clone().requires_grad_()
    (want.index_select(0, index_R[keep_R])).backward(grad_RA[keep_R])
    assert torch.equal(x.grad, want.grad)

    grads = []
    x2 = src.clone().requires_grad_()
    x2.register_hook(grads.append)
    gather_rows(x2, index_R, keep_R).backward(grad_RA)
    # Not a view of the [X + 1, A] buffer with the sink row: autograd accumulates into a view out of place (a fresh
    # [X, A] sum), into a whole tensor in place (torch's InputBuffer::accumulate).
    assert grads[0]._base is None and grads[0].shape == src.shape and grads[0].is_contiguous()


def test_a_second_gradient_of_the_layer_input_is_added_in_place():
    """x feeding the router (a matmul) and the dispatch, as in the MoE layer: the two gradients sum without an
    out-of-place [T, D] add."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 12, 4, generator=g, requires_grad=True)
    x_TD = x.reshape(-1, 4)
    w = torch.randn(3, 4, generator=g)
    index_R = torch.randperm(12, generator=g)
    logits = torch.nn.functional.linear(x_TD, w)  # first, as the router: its backward runs after the dispatch's
    out = gather_rows(x_TD, index_R, torch.ones(12, dtype=torch.bool)).sum() + logits.sum()
    with torch.profiler.profile() as prof:
        out.backward()
    names = [event.name for event in prof.events()]
    assert "aten::add_" in names and "aten::add" not in names
    assert torch.equal(x.grad, (torch.ones(12, 4) + w.sum(0)).reshape(1, 12, 4))


@pytest.mark.parametrize("backend", ["auto", "loop"])  # on CPU auto runs the expert-by-expert kernel
@pytest.mark.parametrize("renorm", [True, False], ids=["unit-weights", "raw-weights"])
def test_dropless_top1_permutation_path_equals_the_gather_and_index_add_path(
    monkeypatch, each_swiglu_engine, renorm, backend
):
    """Dropless top-1: each token has exactly one row, so the dispatch is a permutation (`PermuteRows`, gradient by
    the inverse permutation) and, with unit weights, so is the combine; with unit weights the experts get the rows in
    token order instead (`TokenOrder`: the CPU kernel reads and writes them in place, the other backends permute
    themselves). Output and every gradient equal the path every other mode takes (zeros + index_add_)."""
    cfg = ModelConfig(hidden_size=16, num_attention_heads=1, ffn_hidden_size=32, swiglu=True)
    cfg.add_bias_linear, cfg.num_experts, cfg.topk = False, [8], 1
    cfg.moe_token_dropping, cfg.moe_router_topk_renorm = False, renorm
    cfg.moe_expert_backend = backend
    layer = MoELayer(cfg, 8, layer_index=0)
    g = torch.Generator().manual_seed(2)
    x_BTD, grad_BTD = torch.randn(2, 40, 16, generator=g), torch.randn(2, 40, 16, generator=g)
    in_place = backend == "auto"
    permutes = {  # PermuteRows calls: the dispatch's, and the combine's where the weights are all 1
        "token order": (0 if in_place else 2) if renorm else 1,
        "permutation": 2 if renorm else 1,
        "gather": 0,
    }
    dispatchers = {
        "token order": LocalDispatcher(8),
        "permutation": PermutingDispatcher(8),
        "gather": GatherDispatcher(8),
    }
    runs = []
    for mode, expected_calls in permutes.items():
        layer.dispatcher = dispatchers[mode]
        calls = []
        monkeypatch.setattr(dispatch.PermuteRows, "apply", _counting(dispatch.PermuteRows.apply, calls))
        layer.zero_grad(set_to_none=True)
        x = x_BTD.clone().requires_grad_()
        y, _aux = layer(x)
        y.backward(grad_BTD)
        runs.append([y.detach(), x.grad, *(p.grad for p in layer.parameters())])
        assert len(calls) == expected_calls, mode
    assert len(runs[0]) == 6
    for reference in runs[1:]:
        for new, old in zip(runs[0], reference, strict=True):
            assert torch.equal(new, old)


class PermutingDispatcher(LocalDispatcher):
    """Dropless top-1 with unit weights permuting x (and y, in the combine) itself instead of handing the experts
    the rows in token order."""

    def dispatch(self, x_TD, routing):
        x_ND, counts, ctx = super().dispatch(x_TD, routing)
        if not ctx.in_token_order:
            return x_ND, counts, ctx
        ctx.in_token_order = False
        return PermuteRows.apply(x_TD, ctx.order_R, ctx.inverse_R), ExpertCounts(counts.counts_E, counts.capacity), ctx


class GatherDispatcher(LocalDispatcher):
    """The path of every mode but dropless top-1: `gather_rows` in, `WeightedIndexAdd` out."""

    def dispatch(self, x_TD, routing):
        x_RD, counts_E, order_R, kept_R = permute(x_TD, routing.expert_ids_TK, routing.kept_TK, self.num_experts)
        kept = self._kept_rows(routing, kept_R)
        ctx = LocalContext(order_R, kept, routing.weights_TK, x_TD.shape[0], routing.unit_weights)
        return x_RD, ExpertCounts(counts_E, routing.host_capacity), ctx


def _counting(fn, calls):
    def counted(*args):
        calls.append(1)
        return fn(*args)

    return counted


def test_weighted_index_add_with_a_sink_row_is_the_sliced_sum_without_the_slice():
    """Dropped routes (weight 0) go to a sink row the output leaves out: the values and gradients of
    `zeros(T + 1, D).index_add_(...)[:T]`, in a whole tensor (no slice, whose backward is a [T + 1, D] zero fill)."""
    g = torch.Generator().manual_seed(3)
    num_tokens, hidden, routes = 9, 4, 14
    token_R = torch.randint(0, num_tokens + 1, (routes,), generator=g)
    token_R[:3] = num_tokens  # some sink rows
    y_RD = torch.randn(routes, hidden, generator=g)
    weights_R = torch.where(token_R < num_tokens, torch.rand(routes, generator=g), 0.0)
    grad_TD = torch.randn(num_tokens, hidden, generator=g)
    outs = []
    for sink in (True, False):
        y, w = y_RD.clone().requires_grad_(), weights_R.clone().requires_grad_()
        if sink:
            out = dispatch.WeightedIndexAdd.apply(y, w, token_R, num_tokens, True)
            assert out._base is None and out.shape == (num_tokens, hidden)
        else:
            out = dispatch.WeightedIndexAdd.apply(y, w, token_R, num_tokens + 1)[:num_tokens]
        out.backward(grad_TD)
        outs.append((out.detach(), y.grad, w.grad[token_R < num_tokens]))
    for new, ref in zip(*outs, strict=True):
        assert torch.equal(new, ref)


def test_dispatch_and_combine_with_dropped_routes_trace_as_one_graph():
    """Under torch.compile the sink row is dropped by a view, not `resize_` (which Dynamo cannot trace): the
    LocalDispatcher's permute and unpermute compile with fullgraph=True and give eager's values."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 8, generator=g, requires_grad=True)
    weights = torch.rand(64, 1, generator=g, requires_grad=True)
    expert_ids = torch.randint(0, 4, (64, 1), generator=g)
    kept = torch.rand(64, 1, generator=g) > 0.3
    scale_D = torch.arange(8.0)

    def layer(x, weights):
        x_RD, _, order_R, kept_R = dispatch.permute(x, expert_ids, kept, 4)
        return (dispatch.unpermute(x_RD * 2, order_R, weights, 64, kept_R) * scale_D).sum()

    eager = layer(x, weights)
    eager_grads = torch.autograd.grad(eager, (x, weights))
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")(x, weights)
    compiled_grads = torch.autograd.grad(compiled, (x, weights))
    torch.testing.assert_close(compiled, eager)
    for got, want in zip(compiled_grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want)

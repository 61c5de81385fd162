"""The CPU expert-by-expert SwiGLU kernel under zero bubble's split backward.

`torch.distributed.pipelining`'s zero-bubble schedule runs a stage's backward in two passes: the input gradient
(`stage_backward_input`: autograd.grad w.r.t. the stage inputs, graph kept) and later the weight gradients
(`stage_backward_weight`, restarting at the nodes both paths share, the expert kernel among them). The kernel's
backward then runs twice on one graph; it once freed its activations in the first call and crashed in the second
("Value after * must be an iterable, not NoneType"). These run torch's own two passes on a router + experts stage
whose experts take the kernel path and compare every gradient with one full backward, bit for bit, with each of
the kernel's two engines (C++ and the Python loop).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from moetron.cpu.experts import ExpertByExpertSwiGLU, expert_by_expert_swiglu
from moetron.model.moe.experts.grouped import GroupedExperts

E, D, F, N = 4, 16, 32, 40  # aligned widths: GroupedExperts runs the expert-by-expert kernel on CPU


class _Stage(torch.nn.Module):
    """A linear in front of the experts (a weight upstream of the kernel, as attention is in a real stage)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(D, D, bias=False)
        self.experts = GroupedExperts(E, D, F, activation=torch.nn.functional.silu, swiglu=True, bias=False)
        self.experts.reset_parameters(seed=3)

    def forward(self, x_ND: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        return self.experts(self.proj(x_ND), counts_E)


def _grads(stage: _Stage, x_ND: torch.Tensor, counts_E: torch.Tensor, split: bool) -> list[torch.Tensor]:
    stage.zero_grad(set_to_none=True)
    x = x_ND.clone().requires_grad_()
    y = stage(x, counts_E)
    grad_y = torch.randn(y.shape, generator=torch.Generator().manual_seed(7))
    if split:
        _, param_groups = stage_backward_input([y], [grad_y], [x], stage.parameters())
        stage_backward_weight(stage.parameters(), param_groups)
    else:
        y.backward(grad_y)
    return [x.grad, *(p.grad for p in stage.parameters())]


@pytest.mark.quick
def test_split_backward_matches_one_full_backward_bit_for_bit(each_swiglu_engine) -> None:
    torch.manual_seed(0)
    stage = _Stage()
    assert stage.experts._runs_expert_by_expert(torch.zeros(1, D)), "the test must exercise the CPU kernel"
    x_ND, counts_E = torch.randn(N, D), torch.tensor([12, 0, 9, 15])  # 4 tail rows: dropped routes
    full = _grads(stage, x_ND, counts_E, split=False)
    split = _grads(stage, x_ND, counts_E, split=True)
    assert all(g is not None for g in split)
    for a, b in zip(full, split, strict=True):
        assert torch.equal(a, b)


@pytest.mark.quick
def test_weight_pass_first_then_input_pass_and_a_third_call_is_a_clear_error(each_swiglu_engine) -> None:
    torch.manual_seed(1)
    x = torch.randn(N, D, requires_grad=True)
    weights = [torch.randn(E, D, F, requires_grad=True), torch.randn(E, D, F, requires_grad=True)]
    weights.append(torch.randn(E, F, D, requires_grad=True))
    counts_E = torch.tensor([10, 10, 10, 6])
    x_in = x * 1.0  # a non-leaf input, as in a model
    y = expert_by_expert_swiglu(x_in, *weights, counts_E)
    full = torch.autograd.grad(y.sum(), [x, *weights], retain_graph=True)
    y = expert_by_expert_swiglu(x_in, *weights, counts_E)
    dweights = torch.autograd.grad(y.sum(), weights, retain_graph=True)
    (dx,) = torch.autograd.grad(y.sum(), [x], retain_graph=True)
    for a, b in zip(full, (dx, *dweights), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="a second time"):
        torch.autograd.grad(y.sum(), [x])


def test_frozen_weights_get_no_gradient_and_the_input_still_does(each_swiglu_engine) -> None:
    x = torch.randn(8, D, requires_grad=True)
    w1, w3 = torch.randn(E, D, F), torch.randn(E, D, F)
    w2 = torch.randn(E, F, D)
    y = ExpertByExpertSwiGLU.apply(x * 1.0, w1, w3, w2, [2, 2, 2, 2])
    (dx,) = torch.autograd.grad(y.sum(), [x])
    assert dx.shape == x.shape and torch.isfinite(dx).all()

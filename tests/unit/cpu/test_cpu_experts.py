"""The CPU experts backend (`moetron/cpu/experts.py`): `GroupedExperts` on CPU runs its SwiGLU expert by expert, in C++
or in the Python loop, within the fp32 error bound of the loop backend and the exact values, bitwise autograd's graph
of the same per-expert ops; expanded gradients, bf16 autocast and a frozen input work; the weight gradients' memory
is plain `empty_like` memory."""

from __future__ import annotations

import torch
from fp32_error_bounds import assert_within, swiglu_experts_bounds


def _swiglu_experts(backend: str):
    from moetron.model.moe.experts.grouped import GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts(4, 16, 32, swiglu=True, bias=False, backend=backend)
    with torch.no_grad():
        for w in (experts.w1_EDF, experts.w3_EDF, experts.w2_EFD):
            w.normal_(0, 0.3)
    return experts


def test_expert_by_expert_swiglu_matches_the_loop_backend_values_and_gradients(each_swiglu_engine):
    counts_E = torch.tensor([3, 0, 5, 2])  # an expert without rows gets a zero gradient
    grouped, loop = _swiglu_experts("grouped_mm"), _swiglu_experts("loop")
    x_ND = torch.randn(10, 16)
    grad_ND = torch.randn(10, 16)
    outs = []
    for experts in (grouped, loop):
        x = x_ND.clone().requires_grad_(True)
        y = experts(x, counts_E)
        y.backward(grad_ND)
        outs.append((y, x.grad, experts.w1_EDF.grad, experts.w3_EDF.grad, experts.w2_EFD.grad))
    assert grouped._runs_expert_by_expert(x_ND)
    # two fp32 evaluations: each within its error bound of the exact values, so within twice it of each other
    exact = swiglu_experts_bounds(x_ND, counts_E, grouped.w1_EDF, grouped.w3_EDF, grouped.w2_EFD, grad_ND)
    names = ("y", "dx", "dW1", "dW3", "dW2")
    for name, ours, reference, bound in zip(names, *outs, exact.bounds, strict=True):
        assert_within(ours, reference, 2 * bound, f"expert by expert vs loop: {name}")
        assert_within(ours, exact.values[names.index(name)], bound, f"expert by expert vs exact: {name}")
    assert torch.equal(outs[0][2][1], torch.zeros(16, 32))


def test_expert_by_expert_swiglu_is_bitwise_the_autograd_graph_of_its_per_expert_ops(each_swiglu_engine):
    """Saved silu/product and the in-place backward change no bit against autograd on the same mm calls."""
    from moetron.cpu.experts import ExpertByExpertSwiGLU

    experts, counts = _swiglu_experts("grouped_mm"), [3, 0, 5, 1]  # row 9 is a dropped route (the tail)
    weights = [experts.w1_EDF, experts.w3_EDF, experts.w2_EFD]
    x_ND, grad_ND = torch.randn(10, 16), torch.randn(10, 16)

    def reference(x, w1, w3, w2):
        rows = [
            torch.mm(torch.nn.functional.silu(torch.mm(x_e, w1[e])) * torch.mm(x_e, w3[e]), w2[e])
            for e, x_e in enumerate(x[:9].split(counts))
        ]
        return torch.cat([*rows, torch.zeros(1, 16)])

    results = []
    for run in (lambda *leaves: ExpertByExpertSwiGLU.apply(*leaves, counts), reference):
        leaves = [t.detach().clone().requires_grad_(True) for t in (x_ND, *weights)]
        y = run(*leaves)
        y.backward(grad_ND)
        results.append([y.detach(), *(t.grad for t in leaves)])
    for ours, expected in zip(*results, strict=True):
        assert torch.equal(ours, expected)
    assert torch.equal(results[0][0][9], torch.zeros(16)) and torch.equal(results[0][1][9], torch.zeros(16))


def test_expert_by_expert_swiglu_expanded_gradient_and_bf16_autocast():
    experts = _swiglu_experts("grouped_mm")
    x_ND = torch.randn(6, 16, requires_grad=True)
    experts(x_ND, torch.tensor([1, 2, 0, 3])).sum().backward()  # a stride-0 output gradient
    assert torch.isfinite(x_ND.grad).all() and experts.w2_EFD.grad.shape == (4, 32, 16)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        y = experts(x_ND, torch.tensor([1, 2, 0, 3]))
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert experts.w1_EDF.grad.dtype == torch.float32


def test_empty_for_gradient_is_empty_like_large_or_small():
    from moetron.cpu.experts import empty_for_gradient

    for like in (torch.zeros(3, 4), torch.zeros(9, 1024, 1024)):  # below and above the 32 MiB threshold
        out = empty_for_gradient(like)
        assert out.shape == like.shape and out.dtype == like.dtype and out.is_contiguous()
        out.fill_(2.0)
        assert out.sum().item() == 2.0 * like.numel()


def test_expert_by_expert_swiglu_input_without_gradient(each_swiglu_engine):
    experts = _swiglu_experts("grouped_mm")
    experts(torch.randn(6, 16), torch.tensor([1, 2, 0, 3])).sum().backward()  # frozen input: weights only
    assert experts.w1_EDF.grad is not None and torch.isfinite(experts.w1_EDF.grad).all()

"""How the dispatcher hands gradients back: values equal to autograd's own index_select backward, in tensors that let
autograd add the layer input's second gradient (the router's) in place."""

from __future__ import annotations

import torch

from moetron.model.moe.dispatch import gather_rows


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

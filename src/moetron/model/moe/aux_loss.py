"""MoE auxiliary losses that reach their gradients at the layer, not through the caller's loss.

A MoE layer's weighted aux loss (`moe_loss_coeff · aux + moe_z_loss_coeff · z`) is attached to the layer's
output by `attach_aux_loss`: the forward returns the output unchanged, and the backward hands the aux loss
the gradient `grad_scale` while passing the output's gradient through. So the trainer back-propagates the LM loss
alone, and the router still receives d(lm_loss + moe_loss)/d(router) — exactly the gradient of the summed loss.
Nothing has to travel from the layer to the loss: a pipeline stage stays tensor-in / tensor-out and no scalar
crosses a stage boundary (Megatron-Core's `MoEAuxLossAutoScaler`).

`grad_scale` is what the caller multiplies its LM loss by before the backward. Megatron-Core keeps it in a class
attribute that the schedule sets; here each MoE layer holds it (`MoELayer.aux_loss_grad_scale`, 1.0: calling
`lm_loss.backward()` on a plain forward gives the gradient of lm_loss + moe_loss) and passes it to
`attach_aux_loss` in its forward. The executors set it for a step with `aux_loss_grad_scale(layers, factor)`,
the factor they multiply each micro-batch's LM loss by (`loss_scale / num_micro_batches`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn


class _AttachAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, grad_scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.grad_scale = grad_scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, ctx.grad_scale), None


def attach_aux_loss(output: torch.Tensor, aux_loss: torch.Tensor, grad_scale: float = 1.0) -> torch.Tensor:
    """`output`, with `aux_loss` (a differentiable fp32 scalar) receiving the gradient `grad_scale` when output's
    backward runs."""
    if not (torch.is_grad_enabled() and aux_loss.requires_grad):
        return output
    return _AttachAuxLoss.apply(output, aux_loss, grad_scale)


@contextlib.contextmanager
def aux_loss_grad_scale(moe_layers: Sequence[nn.Module], grad_scale: float) -> Iterator[None]:
    """Within the block (a step's forwards and backwards, activation checkpointing's recomputed forwards included),
    `moe_layers` give their aux losses the gradient `grad_scale`; their previous scale after it."""
    previous = [layer.aux_loss_grad_scale for layer in moe_layers]
    for layer in moe_layers:
        layer.aux_loss_grad_scale = float(grad_scale)
    try:
        yield
    finally:
        for layer, scale in zip(moe_layers, previous, strict=True):
            layer.aux_loss_grad_scale = scale

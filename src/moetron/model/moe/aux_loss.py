"""MoE auxiliary losses that reach their gradients at the layer, not through the caller's loss.

A MoE layer's weighted aux loss (`moe_loss_coeff · aux + moe_z_loss_coeff · z`) is attached to the layer's
output by `attach_aux_loss`: the forward returns the output unchanged, and the backward hands the aux loss
the gradient `LOSS_GRADIENT_SCALE.value` while passing the output's gradient through. So the trainer back-propagates
the LM loss alone, and the router still receives d(lm_loss + moe_loss)/d(router) — exactly the gradient of
the summed loss. Nothing has to travel from the layer to the loss: a pipeline stage stays tensor-in /
tensor-out and no scalar crosses a stage boundary (Megatron-Core's `MoEAuxLossAutoScaler`).

`LOSS_GRADIENT_SCALE.value` is what the LM loss is multiplied by before its backward (1.0 by default: calling
`lm_loss.backward()` on a plain forward gives the gradient of lm_loss + moe_loss). The executors set it to
`loss_scale / num_micro_batches`, the factor they multiply the LM loss by, for the step (`scaled`).
"""

from __future__ import annotations

import torch

from moetron.model.gradient_scale import LOSS_GRADIENT_SCALE


class _AttachAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, LOSS_GRADIENT_SCALE.value)


def attach_aux_loss(output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
    """`output`, with `aux_loss` (a differentiable fp32 scalar) receiving its gradient when output's backward runs."""
    if not (torch.is_grad_enabled() and aux_loss.requires_grad):
        return output
    return _AttachAuxLoss.apply(output, aux_loss)

"""The router probabilities' mean over tokens and their values at the chosen routes, with one [T, E] gradient.

Every gating path needs both from the same softmax: the mean for the aux loss, the routes' values for the combine
weights. Shape legend: T tokens, E experts, K routes per token.
"""

from __future__ import annotations

import torch


class MeanAndGather(torch.autograd.Function):
    """(probs_TE.mean(0), probs_TE.gather(1, ids_TK)) with one [T, E] gradient instead of two: the mean's
    (grad / T, expanded) with the routes' gradients scatter-added into it. Autograd would build the gather's
    gradient as a zero-filled [T, E] and add the two; the sums are the same bits (a + (0 + g) = a + g)."""

    @staticmethod
    def forward(ctx, probs_TE: torch.Tensor, ids_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(ids_TK)
        ctx.shape = probs_TE.shape
        ctx.set_materialize_grads(False)  # an unused output (unit weights: the routes' scores) adds nothing
        return probs_TE.mean(0), probs_TE.gather(1, ids_TK)

    @staticmethod
    def backward(ctx, grad_E: torch.Tensor | None, grad_TK: torch.Tensor | None):
        (ids_TK,) = ctx.saved_tensors
        num_tokens, num_experts = ctx.shape
        if grad_E is None:
            grad_E = grad_TK.new_zeros(num_experts)
        grad_TE = grad_E.expand(num_tokens, num_experts) / num_tokens  # `mean`'s backward, bitwise
        return grad_TE if grad_TK is None else grad_TE.scatter_add_(1, ids_TK, grad_TK), None

"""The balancing losses both gating paths share: Switch/GShard's aux loss (global or per sequence) and the
ST-MoE router z-loss. Each is returned WITHOUT its coefficient (`moe_loss_coeff`, `moe_z_loss_coeff`).

Shape legend: T tokens, E experts, K routes per token, B sequences of L tokens; X any leading dims.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moetron.model.moe.routing.decision import RoutingInputError, route_counts, route_fraction


def balance_loss(probs_XE: torch.Tensor, route_fraction_XE: torch.Tensor, k: int) -> torch.Tensor:
    """E/k · Σ_e mean-probability_e · route-fraction_e along the last dim: 1.0 when perfectly uniform."""
    num_experts = probs_XE.shape[-1]
    return (probs_XE * route_fraction_XE).sum(-1) * num_experts / k


def sequence_aux_loss(
    probs_TE: torch.Tensor,
    ids_TK: torch.Tensor,
    seq_len: int | None,
    sequence_mean: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss: the global formula per sequence, averaged over sequences.

    Tokens are the flattening of [B, L] (each sequence contiguous); `seq_len=None` means one sequence.
    `sequence_mean` (context parallelism: each of N ranks holds L tokens of every sequence) averages the route
    fractions over the sequence's other parts, so they are the whole sequence's; the loss is then linear in the
    local mean probabilities, and its mean over the N ranks (what averaging their gradients and reports does) is
    the whole sequences' loss.
    """
    num_tokens, num_experts = probs_TE.shape
    seq_len = seq_len or num_tokens
    if num_tokens % seq_len:
        raise RoutingInputError(
            f"--moe-aux-loss-type seq: {num_tokens} tokens are not a whole number of {seq_len}-token sequences; "
            f"route whole sequences (x flattened from [B, seq_len, D])"
        )
    mask_TE = torch.zeros_like(probs_TE).scatter_(1, ids_TK, 1.0)
    probs_BLE = probs_TE.view(-1, seq_len, num_experts)
    mask_BLE = mask_TE.view(-1, seq_len, num_experts)
    fraction_BE = mask_BLE.mean(1)
    if sequence_mean is not None:
        fraction_BE = sequence_mean(fraction_BE)
    return balance_loss(probs_BLE.mean(1), fraction_BE, ids_TK.shape[1]).mean()


def split_micro_batch_aux_loss(
    probs_TE: torch.Tensor, counted_ids_TK: torch.Tensor, k: int, sequence_mean: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """The `global` aux loss, `balance_loss(mean probability, route fraction, k)`, of a micro-batch whose sequences
    are split over context-parallel ranks (each of N ranks holds an equal part of every sequence).

    Every gating path's global aux loss has this form (DeepSpeed's top-1: k = 1; GShard's top-2: the first
    choices' fractions only, k = 1; top-k and the generic path: every route, k), over the tokens it routes. The
    one-process micro-batch is the union of the ranks' tokens: `sequence_mean` averages the detached route
    fractions over the ranks, so they are the whole micro-batch's, and the loss, linear in the local mean
    probabilities, has as its mean over the N ranks (what averaging their gradients and reports does) the
    one-process loss, gradient included. `counted_ids_TK`: the routes the path counts (before capacity)."""
    num_tokens, num_experts = probs_TE.shape
    fraction_E = sequence_mean(route_fraction(route_counts(counted_ids_TK, num_experts), num_tokens))
    return balance_loss(probs_TE.mean(0), fraction_E, k)


def z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)²."""
    return torch.logsumexp(logits_TE, dim=-1).square().mean()


def z_loss_from_route(logit_T: torch.Tensor, prob_T: torch.Tensor) -> torch.Tensor:
    """`z_loss` from one logit and its softmax probability per token: logsumexp = logit − log(prob).

    O(T) instead of O(T·E). Exact up to rounding when the route's probability is not tiny, which holds for
    a token's first choice; only for a z-loss that is reported, not trained on (no gradient)."""
    lse_T = logit_T.float() - prob_T.float().clamp_min(torch.finfo(torch.float32).tiny).log()
    return lse_T.square().mean()

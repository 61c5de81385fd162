"""Token dispatch for one MoE layer: sort the kept routes by expert (permute), then add the weighted expert
outputs back onto their tokens (unpermute). Never builds an [S, E, C] tensor: the cost is O(T·K·D).

    x_ND, counts_E, ctx = dispatcher.dispatch(x_TD, routing)  # rows grouped by expert, counts per expert
    y_ND = experts(x_ND, counts_E)
    y_TD = dispatcher.combine(y_ND, ctx)                        # Σ_k weight_tk · expert_k(x_t)

Capacity mode and dropless mode share this path: a dropped route is simply not dispatched. `permute` and
`unpermute` are plain functions so that the expert-parallel `AllToAllDispatcher` can reuse them: it
sorts by GLOBAL expert id here, exchanges `counts_E` (per global expert) and the sorted rows with its
peers, and runs `unpermute` on the rows it gets back.

Shape legend: T tokens, K routes per token, D hidden size, E experts (global ids),
N kept routes (rows sent to experts), order_N: flat route index t·K + k of each sorted row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from moetron.model.moe.routing_decision import Routing


def sort_routes(
    expert_ids_TK: torch.Tensor, kept_TK: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(order_N, counts_E): kept routes' flat indices sorted by expert (stable: token order within an expert)
    and the kept routes per expert. One host sync, to learn N."""
    ids_R = expert_ids_TK.reshape(-1)
    keys_R = torch.where(kept_TK.reshape(-1), ids_R, num_experts)  # dropped routes sort to the tail
    counts_E = torch.bincount(keys_R, minlength=num_experts + 1)[:num_experts]
    order_R = torch.sort(keys_R, stable=True).indices
    num_kept = int(counts_E.sum().item())
    return order_R[:num_kept], counts_E


def permute(
    x_TD: torch.Tensor, expert_ids_TK: torch.Tensor, kept_TK: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gather the kept routes' token rows grouped by expert: (x_ND, counts_E, order_N).

    Gradient flows to x_TD (index_select's backward adds the rows of a token routed K times)."""
    order_N, counts_E = sort_routes(expert_ids_TK, kept_TK, num_experts)
    x_ND = x_TD.index_select(0, route_tokens(order_N, expert_ids_TK.shape[1]))
    return x_ND, counts_E, order_N


def route_tokens(order_N: torch.Tensor, topk: int) -> torch.Tensor:
    """The token of each flat route index (t·K + k → t)."""
    return order_N if topk == 1 else order_N // topk


def unpermute(y_ND: torch.Tensor, order_N: torch.Tensor, weights_TK: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """y_TD[t] = Σ over t's kept routes of weight · expert output; tokens with no kept route get 0.

    The weighted sum accumulates in fp32 (DeepSpeed >= 0.19.4) and is cast back to y's dtype. Gradients
    flow to y_ND and to weights_TK (hence to the router)."""
    topk = weights_TK.shape[1]
    acc_dtype = torch.promote_types(y_ND.dtype, torch.float32)
    weights_N = weights_TK.reshape(-1).index_select(0, order_N).to(acc_dtype)
    weighted_ND = y_ND.to(acc_dtype) * weights_N.unsqueeze(1)
    # In place on a fresh buffer: the out-of-place index_add would first copy the zeros.
    y_TD = weighted_ND.new_zeros(num_tokens, y_ND.shape[1]).index_add_(0, route_tokens(order_N, topk), weighted_ND)
    return y_TD.to(y_ND.dtype)


class TokenDispatcher(Protocol):
    """Moves tokens to their experts and back. The layer holds one and never does communication itself."""

    def dispatch(self, x_TD: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """(x_sorted_ND, counts_local_E, ctx): rows for this process's experts, sorted by local expert."""
        ...

    def combine(self, y_ND: torch.Tensor, ctx: Any) -> torch.Tensor:
        """y_TD: the expert outputs back on their tokens, weighted by routing.weights_TK and summed over k."""
        ...


@dataclass
class LocalContext:
    order_N: torch.Tensor  # flat route index of each sorted row
    counts_E: torch.Tensor  # kept routes per (global) expert
    weights_TK: torch.Tensor
    num_tokens: int


class LocalDispatcher:
    """Every expert lives in this process: permute, run, unpermute."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def dispatch(self, x_TD: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, LocalContext]:
        x_ND, counts_E, order_N = permute(x_TD, routing.expert_ids_TK, routing.kept_TK, self.num_experts)
        return x_ND, counts_E, LocalContext(order_N, counts_E, routing.weights_TK, x_TD.shape[0])

    def combine(self, y_ND: torch.Tensor, ctx: LocalContext) -> torch.Tensor:
        return unpermute(y_ND, ctx.order_N, ctx.weights_TK, ctx.num_tokens)

    def __repr__(self) -> str:
        return f"LocalDispatcher(num_experts={self.num_experts})"

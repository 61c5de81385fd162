"""`Routing`: what the router decides for one batch of tokens, in per-route [T, K] form.

Shape legend: T tokens (the flattened batch), K routes per token (topk), E experts in the layer.
Column k of every `_TK` tensor is a token's k-th choice (column 0 = first choice). Dropped routes keep
their expert id (so statistics can see where they wanted to go) but carry weight 0 and `kept=False`.

`slots_TK` and `z_loss` are computed on first read: the dispatcher needs neither, and building them
eagerly (an int64 [T, E] cumsum, a [T, E] logsumexp) cost more than the routing decision itself.
`capacity` is read on demand too: in dropless mode it is the busiest expert's load, a device value, and
reading it on the host would stall a GPU's queue in every forward (see `capacity_source`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from moetron.errors import UserError
from moetron.model.moe.stats import load_max_over_mean

SLOT_ORDERS = ("token", "choice")


class RoutingInputError(UserError, ValueError):
    """Tokens the router cannot route as configured (a ValueError; the CLI prints it as one line)."""


@dataclass(eq=False)
class Routing:
    expert_ids_TK: torch.Tensor  # int64 [T, K]: the global expert of each route
    weights_TK: torch.Tensor  # fp32 [T, K]: combine weight, 0.0 for dropped routes; carries the gate's gradient
    kept_TK: torch.Tensor  # bool [T, K]: the route fits in its expert's capacity
    # Per-expert capacity: a host int in capacity-factor mode (computed from shapes); in dropless mode the max
    # load as an int64 0-dim DEVICE tensor, so that routing never waits for the device. Read `capacity`.
    capacity_source: int | torch.Tensor
    aux_loss: torch.Tensor  # fp32 scalar load-balancing loss, NOT multiplied by moe_loss_coeff
    tokens_per_expert_E: torch.Tensor  # int64 [E]: routes per expert before dropping (DeepSpeed's exp_counts)
    probs_TE: torch.Tensor | None = None  # fp32 [T, E]: router probabilities over all experts (sum to 1 per token)
    # How an expert's buffer fills: "token" = in token order; "choice" = all first choices (in token order)
    # before any second choice (DeepSpeed's top-2). Only `slots_TK` reads it.
    slot_order: str = "token"
    # fp32 scalar router z-loss (NOT multiplied by moe_z_loss_coeff), or a function computing it on first read.
    z_loss_source: torch.Tensor | Callable[[], torch.Tensor] | None = field(default=None, repr=False)
    # Every kept route's weight is exactly 1 (top-1 of softmax scores renormalised over its one route: s / s), so a
    # combine may skip the product, and the weights' gradient (0 there, up to the rounding of s / s's backward).
    unit_weights: bool = False
    _slots_TK: torch.Tensor | None = field(default=None, init=False, repr=False)

    @property
    def z_loss(self) -> torch.Tensor:
        """fp32 scalar router z-loss (0 when the router did not set one)."""
        if callable(self.z_loss_source):
            self.z_loss_source = self.z_loss_source()
        if self.z_loss_source is None:
            self.z_loss_source = torch.zeros((), dtype=torch.float32, device=self.expert_ids_TK.device)
        return self.z_loss_source

    @property
    def slots_TK(self) -> torch.Tensor:
        """int64 [T, K]: position in the expert's capacity buffer, -1 if dropped (computed on first read)."""
        if self._slots_TK is None:
            self._slots_TK = buffer_slots(self.expert_ids_TK, self.kept_TK, self.num_experts, self.slot_order)
        return self._slots_TK

    @property
    def capacity(self) -> int:
        """Per-expert capacity as a host int. In dropless mode the first read copies the max load from the
        device (a host sync on a GPU) and keeps it: read it for reports, never in the forward."""
        if isinstance(self.capacity_source, torch.Tensor):
            self.capacity_source = int(self.capacity_source)
        return self.capacity_source

    @property
    def host_capacity(self) -> int | None:
        """The capacity when it is known without reading the device (capacity-factor mode), else None."""
        return self.capacity_source if isinstance(self.capacity_source, int) else None

    @property
    def num_tokens(self) -> int:
        return self.expert_ids_TK.shape[0]

    @property
    def topk(self) -> int:
        return self.expert_ids_TK.shape[1]

    @property
    def num_experts(self) -> int:
        return self.tokens_per_expert_E.shape[0]

    def kept_tokens_per_expert(self) -> torch.Tensor:
        """int64 [E]: routes per expert after capacity dropping (what the experts actually compute)."""
        counts_E = torch.zeros(self.num_experts, dtype=torch.int64, device=self.expert_ids_TK.device)
        return counts_E.index_add_(0, self.expert_ids_TK.flatten(), self.kept_TK.flatten().long())

    @torch.no_grad()
    def stats(self) -> dict[str, torch.Tensor]:
        """Detached per-layer routing statistics (device tensors: no host sync until the caller reads them).

        tokens_per_expert [E] (before dropping), dropped_fraction (of all T·K routes), load_max_over_mean
        (1.0 = perfectly balanced), entropy (mean over tokens of the router distribution's entropy, nats).
        """
        load_E = self.tokens_per_expert_E.float()
        routes = max(self.kept_TK.numel(), 1)
        out = {
            "tokens_per_expert": self.tokens_per_expert_E.detach(),
            "dropped_fraction": 1.0 - self.kept_TK.float().sum() / routes,
            "load_max_over_mean": load_max_over_mean(load_E),
        }
        if self.probs_TE is not None and self.probs_TE.numel():
            probs_TE = self.probs_TE.detach().float()
            out["entropy"] = -(probs_TE * probs_TE.clamp_min(1e-30).log()).sum(-1).mean()
        return out


@torch.no_grad()
def buffer_slots(expert_ids_TK: torch.Tensor, kept_TK: torch.Tensor, num_experts: int, order: str) -> torch.Tensor:
    """int64 [T, K]: each kept route's rank among its expert's kept routes, -1 for dropped routes.

    Ranks count in token order ("token"), or choice-major ("choice": column 0 of every token, then column 1…).
    Every path keeps a prefix of its expert's queue or keeps by key, so the rank among KEPT routes is the
    buffer position DeepSpeed's cumsum over the [T, E] mask gives them.
    """
    if order not in SLOT_ORDERS:
        raise ValueError(f"slot order {order!r} is not one of {SLOT_ORDERS}")
    ids_TK = torch.where(kept_TK, expert_ids_TK, num_experts)  # dropped routes queue at a phantom expert
    keys_R = (ids_TK.t() if order == "choice" else ids_TK).reshape(-1)
    order_R = torch.sort(keys_R, stable=True).indices
    counts_E = route_counts(keys_R, num_experts + 1)
    starts_R = (torch.cumsum(counts_E, 0) - counts_E)[keys_R[order_R]]
    sorted_ranks_R = torch.arange(keys_R.numel(), device=keys_R.device) - starts_R
    ranks_R = torch.empty_like(keys_R).index_copy_(0, order_R, sorted_ranks_R)
    ranks_TK = ranks_R.view(ids_TK.t().shape).t() if order == "choice" else ranks_R.view(ids_TK.shape)
    return torch.where(kept_TK, ranks_TK, -1).contiguous()


def route_counts(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 [E]: routes per expert (= the one-hot [T, E] mask summed over tokens, without building it).

    A scatter-add, not `torch.bincount`: CUDA's bincount reads the ids' min and max on the host to size its
    output (two syncs); this output size is known. As fast as bincount on CPU."""
    ids_R = expert_ids.reshape(-1)
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=ids_R.device)
    return counts_E.scatter_add_(0, ids_R, torch.ones_like(ids_R))


def route_fraction(counts_E: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """fp32 [E]: the one-hot mask's mean over tokens, `mask_TE.float().mean(0)`, bitwise (mean = exact sum / T)."""
    return counts_E.float() / num_tokens

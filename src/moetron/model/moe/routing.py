"""`Routing`: what the router decides for one batch of tokens, in per-route [T, K] form.

Shape legend: T tokens (the flattened batch), K routes per token (topk), E experts in the layer.
Column k of every `_TK` tensor is a token's k-th choice (column 0 = first choice). Dropped routes keep
their expert id (so statistics can see where they wanted to go) but carry weight 0 and `kept=False`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Routing:
    expert_ids_TK: torch.Tensor  # int64 [T, K]: the global expert of each route
    weights_TK: torch.Tensor  # fp32 [T, K]: combine weight, 0.0 for dropped routes; carries the gate's gradient
    kept_TK: torch.Tensor  # bool [T, K]: the route fits in its expert's capacity
    capacity: int  # per-expert capacity used (the max load in dropless mode)
    aux_loss: torch.Tensor  # fp32 scalar load-balancing loss, NOT multiplied by moe_loss_coeff
    z_loss: torch.Tensor  # fp32 scalar router z-loss, NOT multiplied by moe_z_loss_coeff
    tokens_per_expert_E: torch.Tensor  # int64 [E]: routes per expert before dropping (DeepSpeed's exp_counts)
    slots_TK: torch.Tensor | None = None  # int64 [T, K]: position in the expert's capacity buffer, -1 if dropped
    probs_TE: torch.Tensor | None = None  # fp32 [T, E]: router probabilities over all experts (sum to 1 per token)

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
            "load_max_over_mean": load_E.max() / load_E.mean().clamp_min(1e-9),
        }
        if self.probs_TE is not None and self.probs_TE.numel():
            probs_TE = self.probs_TE.detach().float()
            out["entropy"] = -(probs_TE * probs_TE.clamp_min(1e-30).log()).sum(-1).mean()
        return out

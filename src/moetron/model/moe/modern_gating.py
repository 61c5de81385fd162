"""The generic top-k router behind the modern options, and the balancing losses shared by both paths.

Options (ModelConfig fields): sigmoid or softmax scores; `moe_router_pre_softmax` (top-k on logits, then
softmax over the k — Mixtral); forced renormalisation on/off; a weight scaling factor; a selection-only
expert bias (aux-loss-free balancing, DeepSeek-V3); group-limited routing (DeepSeek-V3: a group's score is
the sum of its two best scores, tokens pick from their best `topk_groups` groups).

Capacity and dropping follow DeepSpeed's `topkgating`: capacity max(ceil(T/E·k·cf), min_capacity), or the
max load when dropless. Drop policy: with `moe_use_rts` (the default) the 'probs' policy — each over-full
expert keeps its highest-scoring routes; with `moe_use_rts=False` the 'position' policy — the earliest
tokens. Renormalisation (when on) runs over the routes kept after dropping, as DeepSpeed's does.

Shape legend: T tokens, E experts, K routes per token, G expert groups, B sequences of L tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moetron.model.config import ModelConfig
from moetron.model.moe.capacity import (
    RoutingInputError,
    capacity_from_factor,
    dropless_capacity,
    gather_slots,
    keep_by_position,
    keep_top_keys,
    slots_in_token_order,
)
from moetron.model.moe.routing import Routing


def routing_probs(logits_TE: torch.Tensor, score_function: str) -> torch.Tensor:
    """[T, E] probabilities over all experts (sum to 1), what the aux losses and the entropy measure."""
    if score_function == "sigmoid":
        scores_TE = torch.sigmoid(logits_TE)
        return scores_TE / scores_TE.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).eps)
    return F.softmax(logits_TE, dim=-1)


def limit_to_best_groups(select_TE: torch.Tensor, num_groups: int, topk_groups: int) -> torch.Tensor:
    """Mask (−inf) the experts outside each token's `topk_groups` best groups; group score = top-2 sum."""
    num_tokens, num_experts = select_TE.shape
    grouped_TGX = select_TE.view(num_tokens, num_groups, num_experts // num_groups)
    best_in_group = min(2, grouped_TGX.shape[-1])
    group_scores_TG = grouped_TGX.topk(best_in_group, dim=-1).values.sum(-1)
    best_groups_TG = group_scores_TG.topk(topk_groups, dim=-1).indices
    allowed_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter_(1, best_groups_TG, True)
    allowed_TE = allowed_TG.repeat_interleave(num_experts // num_groups, dim=1)
    return select_TE.masked_fill(~allowed_TE, float("-inf"))


def _choose_experts(logits_TE: torch.Tensor, cfg: ModelConfig, k: int, expert_bias_E: torch.Tensor | None):
    """(ids_TK, route_scores_TK): which experts each token picks, and the unbiased score of each pick."""
    if cfg.moe_router_pre_softmax:
        scores_TE = logits_TE  # select on logits; weights are a softmax over the chosen k
    elif cfg.moe_router_score_function == "sigmoid":
        scores_TE = torch.sigmoid(logits_TE)
    else:
        scores_TE = F.softmax(logits_TE, dim=-1)
    select_TE = scores_TE.detach()
    if expert_bias_E is not None:  # the bias steers selection only, never the weights
        select_TE = select_TE + expert_bias_E
    if cfg.num_expert_groups > 1:
        select_TE = limit_to_best_groups(select_TE, cfg.num_expert_groups, cfg.topk_groups)
    ids_TK = torch.topk(select_TE, k=k, dim=1).indices
    route_scores_TK = scores_TE.gather(1, ids_TK)
    if cfg.moe_router_pre_softmax:
        route_scores_TK = F.softmax(route_scores_TK, dim=-1)
    return ids_TK, route_scores_TK


def renormalises(cfg: ModelConfig, k: int) -> bool:
    """DeepSpeed's rule unless forced: k = 1 keeps the raw score, k >= 2 renormalises over kept routes."""
    return cfg.moe_router_topk_renorm if cfg.moe_router_topk_renorm is not None else k >= 2


def generic_topk_gating(
    logits_TE: torch.Tensor,
    cfg: ModelConfig,
    k: int,
    capacity_factor: float,
    expert_bias_E: torch.Tensor | None = None,
) -> Routing:
    """Top-k routing with the modern options; capacity and dropping as DeepSpeed's `topkgating`."""
    num_tokens, num_experts = logits_TE.shape
    ids_TK, route_scores_TK = _choose_experts(logits_TE, cfg, k, expert_bias_E)
    mask_TE = torch.zeros_like(logits_TE, dtype=torch.bool).scatter_(1, ids_TK, True)
    counts_E = mask_TE.sum(0).detach()
    probs_TE = routing_probs(logits_TE, cfg.moe_router_score_function)

    if not cfg.moe_token_dropping:
        capacity = dropless_capacity(counts_E)
    else:
        capacity = capacity_from_factor(num_tokens, num_experts, capacity_factor, k, cfg.moe_min_capacity)
        if cfg.moe_use_rts:  # 'probs': keep each expert's highest-scoring routes
            keys_TE = torch.zeros_like(logits_TE).scatter(1, ids_TK, route_scores_TK.detach())
            mask_TE = keep_top_keys(mask_TE, keys_TE, capacity, sort=False)
        else:  # 'position': keep each expert's earliest routes
            mask_TE = keep_by_position(mask_TE, capacity)
    kept_TK = mask_TE.gather(1, ids_TK)

    weights_TK = route_scores_TK * kept_TK
    if renormalises(cfg, k):
        weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).eps)
    weights_TK = weights_TK * cfg.moe_router_topk_scaling_factor
    aux_loss = global_aux_loss(probs_TE, ids_TK)
    slots_TK = gather_slots(slots_in_token_order(mask_TE), ids_TK, kept_TK)
    zero = torch.zeros((), dtype=torch.float32, device=logits_TE.device)
    return Routing(ids_TK, weights_TK, kept_TK, capacity, aux_loss, zero, counts_E, slots_TK, probs_TE)


# ---------------------------------------------------------------- balancing losses
def _balance(probs_XE: torch.Tensor, route_fraction_XE: torch.Tensor, k: int) -> torch.Tensor:
    """E/k · Σ_e mean-probability_e · route-fraction_e along the last dim: 1.0 when perfectly uniform."""
    num_experts = probs_XE.shape[-1]
    return (probs_XE * route_fraction_XE).sum(-1) * num_experts / k


def global_aux_loss(probs_TE: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
    """Switch/GShard loss over the whole batch, every route counted, divided by k (DeepSpeed's top-k form)."""
    mask_TE = torch.zeros_like(probs_TE).scatter_(1, ids_TK, 1.0)
    return _balance(probs_TE.mean(0), mask_TE.mean(0), ids_TK.shape[1])


def sequence_aux_loss(probs_TE: torch.Tensor, ids_TK: torch.Tensor, seq_len: int | None) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss: the global formula per sequence, averaged over sequences.

    Tokens are the flattening of [B, L] (each sequence contiguous); `seq_len=None` means one sequence.
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
    return _balance(probs_BLE.mean(1), mask_BLE.mean(1), ids_TK.shape[1]).mean()


def z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)²."""
    return torch.logsumexp(logits_TE, dim=-1).square().mean()

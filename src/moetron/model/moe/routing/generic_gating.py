"""The generic top-k router behind the modern options (DeepSpeed's exact paths are in `deepspeed_gating.py`).

Options (RouterConfig fields): sigmoid or softmax scores; `moe_router_pre_softmax` (top-k on logits, then
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

from moetron.model.backends import experts_backend
from moetron.model.config import RouterConfig
from moetron.model.moe.routing.deepspeed_gating import (
    LOCAL_ROWS,
    MeanAndGather,
    Routing,
    TokenRows,
    balance_loss,
    capacity_from_factor,
    dropless_capacity,
    keep_top_keys,
    route_counts,
    route_fraction,
)


def routing_probs(logits_TE: torch.Tensor, score_function: str) -> torch.Tensor:
    """[T, E] probabilities over all experts (sum to 1), what the aux losses and the entropy measure."""
    if score_function == "sigmoid":
        return normalised(torch.sigmoid(logits_TE))
    return F.softmax(logits_TE, dim=-1)


def normalised(scores_TE: torch.Tensor) -> torch.Tensor:
    """Sigmoid scores rescaled to sum to 1 per token."""
    return scores_TE / scores_TE.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).eps)


def limit_to_best_groups(select_TE: torch.Tensor, num_groups: int, topk_groups: int) -> torch.Tensor:
    """Mask (−inf) the experts outside each token's `topk_groups` best groups; group score = top-2 sum."""
    num_tokens, num_experts = select_TE.shape
    grouped_TGX = select_TE.view(num_tokens, num_groups, num_experts // num_groups)
    best_in_group = min(2, grouped_TGX.shape[-1])
    group_scores_TG = grouped_TGX.topk(best_in_group, dim=-1).values.sum(-1)
    best_groups_TG = group_scores_TG.topk(topk_groups, dim=-1).indices
    allowed_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter_(1, best_groups_TG, True)
    allowed_TE = allowed_TG.repeat_interleave(num_experts // num_groups, dim=1, output_size=num_experts)
    return select_TE.masked_fill(~allowed_TE, float("-inf"))


def _scores(logits_TE: torch.Tensor, cfg: RouterConfig) -> torch.Tensor:
    """[T, E] selection scores: logits (pre-softmax: weights are a softmax over the chosen k), sigmoid or softmax."""
    if cfg.moe_router_pre_softmax:
        return logits_TE
    if cfg.moe_router_score_function == "sigmoid":
        return torch.sigmoid(logits_TE)
    return F.softmax(logits_TE, dim=-1)


def _probs_from_scores(logits_TE: torch.Tensor, scores_TE: torch.Tensor, cfg: RouterConfig) -> torch.Tensor:
    """`routing_probs`, reusing the selection scores when they already are (or hold) the same function:
    one softmax (and one softmax backward) per step instead of two."""
    if cfg.moe_router_pre_softmax:
        return routing_probs(logits_TE, cfg.moe_router_score_function)
    return normalised(scores_TE) if cfg.moe_router_score_function == "sigmoid" else scores_TE


# CPU topk picks by heap selection (std::partial_sort) when k · 64 <= E, else by std::nth_element. With a
# one-element heap that is replaced only by a strictly larger value (NaN counts as largest), it returns the FIRST
# maximal column, which is what `max(dim)` returns (documented); nth_element breaks ties its own way.
_HEAP_TOPK_MIN_EXPERTS = 64


def top_experts(select_TE: torch.Tensor, k: int) -> torch.Tensor:
    """int64 [T, k]: `torch.topk(select_TE, k, dim=1).indices`, ties included.

    For k = 1 on CPU with at least 64 experts, `max(dim=1)` instead: ~1.5× faster (one scan per row, no heap),
    and the same index (see `_HEAP_TOPK_MIN_EXPERTS`; `test_top_experts_equals_topk_with_ties` holds it to
    that). Elsewhere topk itself: fewer experts, k > 1 or another device break ties differently."""
    if k == 1 and select_TE.device.type == "cpu" and select_TE.shape[1] >= _HEAP_TOPK_MIN_EXPERTS:
        picked_T = experts_backend(select_TE.device).first_max_column(select_TE)  # the same column, or None
        return picked_T.unsqueeze(1) if picked_T is not None else select_TE.max(dim=1, keepdim=True).indices
    return torch.topk(select_TE, k=k, dim=1).indices


def _select_ids(scores_TE: torch.Tensor, cfg: RouterConfig, k: int, expert_bias_E: torch.Tensor | None):
    """int64 [T, k]: which experts each token picks (bias and expert groups steer the choice only)."""
    select_TE = scores_TE.detach()
    if expert_bias_E is not None:  # the bias steers selection only, never the weights
        select_TE = select_TE + expert_bias_E
    if cfg.num_expert_groups > 1:
        select_TE = limit_to_best_groups(select_TE, cfg.num_expert_groups, cfg.topk_groups)
    return top_experts(select_TE, k)


def renormalises(cfg: RouterConfig, k: int) -> bool:
    """DeepSpeed's rule unless forced: k = 1 keeps the raw score, k >= 2 renormalises over kept routes."""
    return cfg.moe_router_topk_renorm if cfg.moe_router_topk_renorm is not None else k >= 2


def generic_topk_gating(
    logits_TE: torch.Tensor,
    cfg: RouterConfig,
    k: int,
    capacity_factor: float,
    expert_bias_E: torch.Tensor | None = None,
    rows: TokenRows = LOCAL_ROWS,
) -> Routing:
    """Top-k routing with the modern options; capacity and dropping as DeepSpeed's `topkgating`, over the whole
    micro-batch `rows` places these tokens in (`TokenRows`)."""
    num_tokens, num_experts = logits_TE.shape
    scores_TE = _scores(logits_TE, cfg)
    probs_TE = _probs_from_scores(logits_TE, scores_TE, cfg)
    ids_TK = _select_ids(scores_TE, cfg, k, expert_bias_E)
    if probs_TE is scores_TE:  # softmax scores: the aux loss's mean and the routes' scores share one gradient
        mean_probs_E, route_scores_TK = MeanAndGather.apply(scores_TE, ids_TK)
    else:
        mean_probs_E, route_scores_TK = probs_TE.mean(0), scores_TE.gather(1, ids_TK)
        if cfg.moe_router_pre_softmax:  # the weights: a softmax over the chosen k logits (Mixtral)
            route_scores_TK = F.softmax(route_scores_TK, dim=-1)
    counts_E = route_counts(ids_TK, num_experts)

    if not cfg.moe_token_dropping:  # every route fits: no [T, E] mask at all
        capacity = dropless_capacity(counts_E)
        kept_TK = torch.ones_like(ids_TK, dtype=torch.bool)
    else:
        capacity = capacity_from_factor(rows.tokens(num_tokens), num_experts, capacity_factor, k, cfg.moe_min_capacity)
        every_id_TK, every_score_TK = rows.whole(ids_TK), rows.whole(route_scores_TK.detach())
        kept_TK = rows.mine(_keep_within_capacity(num_experts, every_id_TK, every_score_TK, capacity, cfg.moe_use_rts))

    weights_TK = route_scores_TK * kept_TK
    if renormalises(cfg, k):
        weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).eps)
    weights_TK = weights_TK * cfg.moe_router_topk_scaling_factor
    aux_loss = balance_loss(mean_probs_E, route_fraction(counts_E, num_tokens), k)
    routing = Routing(ids_TK, weights_TK, kept_TK, capacity, aux_loss, counts_E, probs_TE, "token")
    routing.unit_weights = has_unit_weights(cfg, k)
    return routing


def has_unit_weights(cfg: RouterConfig, k: int) -> bool:
    """Whether every kept route's weight is exactly 1: one route, renormalised (s / max(s, eps) = s / s, as a
    softmax's top score is >= 1/E > eps), or a pre-softmax over that one route (exp(0) / exp(0)), unscaled.
    Sigmoid scores are left out: one below eps would be renormalised to s / eps."""
    if k != 1 or cfg.moe_router_topk_scaling_factor != 1.0:
        return False
    return cfg.moe_router_pre_softmax or (renormalises(cfg, k) and cfg.moe_router_score_function == "softmax")


def _keep_within_capacity(
    num_experts: int, ids_TK: torch.Tensor, route_scores_TK: torch.Tensor, capacity: int, by_score: bool
) -> torch.Tensor:
    """bool [T, K]: 'probs' policy (each over-full expert keeps its highest-scoring routes) or 'position'
    (its earliest tokens)."""
    shape = (ids_TK.shape[0], num_experts)
    mask_TE = torch.zeros(shape, dtype=torch.bool, device=ids_TK.device).scatter_(1, ids_TK, True)
    if by_score:
        keys_TE = torch.zeros(shape, dtype=route_scores_TK.dtype, device=ids_TK.device).scatter(
            1, ids_TK, route_scores_TK
        )
        mask_TE = keep_top_keys(mask_TE, keys_TE, capacity, sort=False)
    else:
        mask_TE = keep_by_position(mask_TE, capacity)
    return mask_TE.gather(1, ids_TK)


def slots_in_token_order(mask_TE: torch.Tensor) -> torch.Tensor:
    """int64 [T, E]: each route's position among its expert's routes, counted in token order."""
    return torch.cumsum(mask_TE.long(), dim=0) - 1


def keep_by_position(mask_TE: torch.Tensor, capacity: int) -> torch.Tensor:
    """Keep the first `capacity` routes of each expert in token order (Megatron's 'position' policy)."""
    return mask_TE & (slots_in_token_order(mask_TE) < capacity)

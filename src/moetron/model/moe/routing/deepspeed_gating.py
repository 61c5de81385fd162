"""DeepSpeed's `top1gating` / `top2gating` / `topkgating` (0.19.x), reproduced in per-route form.

Same op order, same RNG draws in the same order (so one torch seed gives the same random choices), same
capacity arithmetic and the same `torch.topk` calls for dropping, so the kept routes, weights and aux loss
match DeepSpeed's; only the output layout differs: [T, K] routes instead of dense [S, E, C] tensors.

Shape legend: T tokens, E experts, K routes per token; `mask_TE` one-hot (token, expert) routes.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from moetron.model.backends import experts_backend
from moetron.model.moe.host_reads import host_reads_are_free
from moetron.model.moe.routing.capacity_and_dropping import (
    capacity_from_factor,
    dropless_capacity,
    keep_top_keys,
    keep_top_keys_top1,
    keep_top_random_keys_top1,
)
from moetron.model.moe.routing.decision import Routing, RoutingInputError, buffer_slots, route_counts, route_fraction
from moetron.model.moe.routing.mean_and_gather import MeanAndGather
from moetron.model.moe.routing.token_rows import LOCAL_ROWS, TokenRows


# ---------------------------------------------------------------- noise (torch.distributions' formulas)
def uniform_rsample(shape: torch.Size, low: float, high: float, device: torch.device) -> torch.Tensor:
    """`Uniform(low, high).rsample(shape)` with float32 tensor bounds: low + rand·(high − low), bitwise.

    DeepSpeed builds the bounds as float32 0-dim tensors on the device (a blocking host-to-device copy
    each). Here the bounds and their float32 difference are computed on the host, and the kernels get them
    as Python scalars, which a float32 kernel casts to float32 (exactly: they already are): the same two
    float32 operations on the same operands, so the same bits on every device.
    """
    if low == 0.0 and high == 1.0:  # 0 + r·1 is r bitwise: skip two passes over the [T, E] draw (RTS keys)
        return torch.rand(shape, device=device)
    low32 = np.float32(low)  # what torch.tensor(low) stores
    span32 = np.float32(high) - low32  # a float32 subtraction, as high_t - low_t
    return torch.rand(shape, device=device).mul_(float(span32)).add_(float(low32))


def gumbel_rsample(shape: torch.Size, device: torch.device) -> torch.Tensor:
    """`Gumbel(0, 1).rsample(shape)`: −log(−log(u)), u ~ Uniform(tiny, 1 − eps) of float32."""
    finfo = torch.finfo(torch.float32)
    u = uniform_rsample(shape, finfo.tiny, 1 - finfo.eps, device)
    return -torch.log(-torch.log(u))


def multiplicative_jitter(x: torch.Tensor, epsilon: float = 1e-2, rows: TokenRows = LOCAL_ROWS) -> torch.Tensor:
    """Switch Transformer's input jitter: x · U(1 − eps, 1 + eps), elementwise."""
    return x * rows.draw(lambda shape: uniform_rsample(shape, 1.0 - epsilon, 1.0 + epsilon, x.device), x.shape)


# ---------------------------------------------------------------- helpers
# From here `max(dim=1)` is faster on CPU than the vectorised amax form below (T=8192: 0.25 vs 0.29 ms at E=16; at
# E=8 it is not, 0.16 vs 0.14 ms).
_MAX_DIM_MIN_EXPERTS = 16


def first_argmax(x_TE: torch.Tensor) -> torch.Tensor:
    """int64 [T]: `torch.argmax(x_TE, dim=1)` (the FIRST maximal column), faster on CPU.

    argmax's CPU kernel is scalar; amax and the comparisons vectorise. Ties resolve to the lowest column
    exactly as argmax does. NaN rows differ (argmax points at the NaN); the router's logits have none.
    On CPU with at least `_MAX_DIM_MIN_EXPERTS` columns, `max(dim=1)` instead: one pass and no [T, E]
    temporaries (0.59 vs 0.79 ms at T=8192, E=64; 0.91 vs 1.58 ms at E=128), the first maximal column as
    documented, NaN rows included (the NaN's column, as argmax). There the experts backend's `first_max_column`
    where it has one (the CPU kernels, float32): the same column (0.50 vs 0.80 ms at T=8192, E=64; 0.78 vs 1.22 at
    E=128).
    """
    num_experts = x_TE.shape[1]
    if x_TE.device.type == "cpu" and num_experts >= _MAX_DIM_MIN_EXPERTS:
        picked_T = experts_backend(x_TE.device).first_max_column(x_TE)  # the same column, faster, or None
        return picked_T if picked_T is not None else x_TE.max(dim=1).indices
    is_max_TE = x_TE == x_TE.amax(dim=1, keepdim=True)
    # Score E - e at the maxima (0 elsewhere): the largest score is the lowest maximal column.
    reverse_E = torch.arange(num_experts, 0, -1, device=x_TE.device, dtype=torch.int32)
    return num_experts - (is_max_TE * reverse_E).amax(dim=1).long()


def _one_hot_bool(ids_T: torch.Tensor, num_experts: int) -> torch.Tensor:
    """bool [T, E] mask of one route per token (DeepSpeed's int64 one-hot, as a cheaper bool)."""
    mask_TE = torch.zeros(ids_T.shape[0], num_experts, dtype=torch.bool, device=ids_T.device)
    return mask_TE.scatter_(1, ids_T.unsqueeze(1), True)


def _check_top1_tokens(num_tokens: int, min_capacity: int) -> None:
    if num_tokens < min_capacity:
        raise RoutingInputError(
            f"top-1 routing got {num_tokens} tokens but --moe-min-capacity is {min_capacity}; DeepSpeed's top-1 "
            f"gate needs at least min_capacity tokens per batch: lower --moe-min-capacity (0 is allowed) "
            f"or route more tokens at once (larger micro batch or sequence)"
        )


# ---------------------------------------------------------------- top-1
def top1_gating(
    logits_TE: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    noisy_gate_policy: str | None = None,
    drop_tokens: bool = True,
    use_rts: bool = True,
    rows: TokenRows = LOCAL_ROWS,
) -> Routing:
    """Switch routing: one expert per token, weight = its raw softmax probability.

    `noisy_gate_policy` must already be None in eval mode (the caller decides, as TopKGate does).
    Random draws: RSample Gumbel [T, E] first (if asked), then the RTS uniform [T, E] (if `use_rts`).
    `rows`: these tokens' place in the micro-batch (`token_rows.py`): draws, capacity and drops are its.
    """
    num_tokens, num_experts = logits_TE.shape
    device = logits_TE.device
    _check_top1_tokens(rows.tokens(num_tokens), min_capacity)  # DeepSpeed asserts this; we say what to change
    noisy_logits_TE = None
    if noisy_gate_policy == "RSample":  # noise only picks the expert; the weight stays the clean probability
        noisy_logits_TE = logits_TE + rows.draw(lambda shape: gumbel_rsample(shape, device), logits_TE.shape)
    probs_TE = F.softmax(logits_TE, dim=1)
    capacity = capacity_from_factor(rows.tokens(num_tokens), num_experts, capacity_factor, 1, min_capacity)

    ids_T = first_argmax(noisy_logits_TE if noisy_logits_TE is not None else probs_TE)
    ids_TK = ids_T.unsqueeze(1)
    counts_E = route_counts(ids_T, num_experts)
    mean_probs_E, gates_TK = MeanAndGather.apply(probs_TE, ids_TK)  # autograd's mean and gather, one [T, E] grad
    aux_loss = torch.sum(mean_probs_E * route_fraction(counts_E, num_tokens)) * num_experts

    # Random token selection: an over-full expert keeps the C routes with the largest random keys. The
    # draw happens even when nothing can overflow (dropless), to keep the RNG stream in step with DeepSpeed.
    # The keys of the whole micro-batch: an over-full expert's C winners are chosen among all its routes.
    uniform = lambda shape: uniform_rsample(shape, 0.0, 1.0, device)
    rand_TE = rows.draw_whole(uniform, logits_TE.shape) if use_rts else None
    if not drop_tokens:
        # Capacity = the max load: every route fits. (DeepSpeed's topk at k = max load agrees, except that
        # it may drop a route whose random key is exactly 0.0, tied with the unrouted zeros of a full column
        # — a 2^-24 chance per route; dropless mode keeps it.)
        capacity = dropless_capacity(counts_E, num_tokens)
        kept_T = torch.ones_like(ids_T, dtype=torch.bool)
    else:
        kept_T = rows.mine(_keep_top1(rows.whole(ids_T), rand_TE, capacity, num_experts))

    kept_TK = kept_T.unsqueeze(1)
    weights_TK = gates_TK * kept_TK  # raw probability, no renormalisation for k = 1
    return Routing(ids_TK, weights_TK, kept_TK, capacity, aux_loss, counts_E, probs_TE, "token")


def _keep_top1(ids_T: torch.Tensor, rand_TE: torch.Tensor | None, capacity: int, num_experts: int) -> torch.Tensor:
    """bool [T]: the routes each over-full expert keeps — the largest random keys (RTS), else DeepSpeed's ties."""
    if rand_TE is not None and host_reads_are_free(rand_TE.device):
        return keep_top_random_keys_top1(ids_T, rand_TE, capacity)  # reads the device once: free on a CPU
    if rand_TE is not None:  # keys = one-hot mask · U(0, 1), as DeepSpeed computes them
        return keep_top_keys_top1(ids_T, torch.where(_one_hot_bool(ids_T, num_experts), rand_TE, 0.0), capacity)
    return keep_top_keys_top1(ids_T, _one_hot_bool(ids_T, num_experts).long(), capacity)  # DeepSpeed's exact ties


# ---------------------------------------------------------------- top-2
def top2_gating(
    logits_TE: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    second_expert_sampling: bool = True,
    rows: TokenRows = LOCAL_ROWS,
) -> Routing:
    """GShard routing: first choice = argmax, second = argmax of Gumbel-perturbed logits (train and eval).

    Slots queue every first choice before any second choice; overflowing routes drop by position; the two
    weights are renormalised over the kept routes (eps floor), so a lone surviving first route weighs 1.0.
    `rows`: these tokens' place in the micro-batch (`token_rows.py`): the noise, capacity and queue are its.
    """
    num_tokens, num_experts = logits_TE.shape
    probs_TE = F.softmax(logits_TE, dim=1)
    ids1_T = first_argmax(probs_TE)
    if second_expert_sampling:  # DeepSpeed adds the noise in place; out of place gives the same values
        device = logits_TE.device
        logits_TE = logits_TE + rows.draw(lambda shape: gumbel_rsample(shape, device), logits_TE.shape)
    ids2_T = first_argmax(logits_TE.masked_fill(_one_hot_bool(ids1_T, num_experts), float("-inf")))

    counts1_E = route_counts(ids1_T, num_experts)
    aux_loss = torch.mean(probs_TE.mean(0) * route_fraction(counts1_E, num_tokens)) * num_experts * num_experts
    ids_TK = torch.stack([ids1_T, ids2_T], dim=1)
    counts_E = route_counts(ids_TK, num_experts)

    # Queue positions: every first choice (token order), then every second choice; drop past capacity.
    all_routes_TK = torch.ones_like(ids_TK, dtype=torch.bool)
    if drop_tokens:  # the queue of the whole micro-batch's routes
        capacity = capacity_from_factor(rows.tokens(num_tokens), num_experts, capacity_factor, 2, min_capacity)
        every_id_TK = rows.whole(ids_TK)
        slots_TK = buffer_slots(every_id_TK, torch.ones_like(every_id_TK, dtype=torch.bool), num_experts, "choice")
        kept_TK = rows.mine(slots_TK < capacity)
    else:
        capacity = dropless_capacity(counts_E)  # no clamp to T for top-2, as in DeepSpeed
        kept_TK = all_routes_TK

    gates_TK = probs_TE.gather(1, ids_TK) * kept_TK
    denom_T = torch.clamp(gates_TK[:, 0] + gates_TK[:, 1], min=torch.finfo(torch.float32).eps)
    weights_TK = gates_TK / denom_T[:, None]
    return Routing(ids_TK, weights_TK, kept_TK, capacity, aux_loss, counts_E, probs_TE, "choice")


# ---------------------------------------------------------------- top-k (k > 2)
def topk_gating(
    logits_TE: torch.Tensor,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    rows: TokenRows = LOCAL_ROWS,
) -> Routing:
    """DeepSpeed's general top-k ('probs' drop policy, no randomness): each over-full expert keeps its
    highest-probability routes; weights renormalised over the kept routes; aux loss divided by k."""
    num_tokens, num_experts = logits_TE.shape
    probs_TE = F.softmax(logits_TE, dim=1)
    top_probs_TK, ids_TK = torch.topk(probs_TE, k=k, dim=1)
    mask_TE = torch.zeros_like(probs_TE, dtype=torch.bool).scatter_(1, ids_TK, True)
    counts_E = route_counts(ids_TK, num_experts)
    aux_loss = torch.mean(probs_TE.mean(0) * route_fraction(counts_E, num_tokens)) * num_experts * num_experts / k

    if drop_tokens:  # each over-full expert keeps its best routes of the whole micro-batch
        capacity = capacity_from_factor(rows.tokens(num_tokens), num_experts, capacity_factor, k, min_capacity)
        every_id_TK, every_prob_TK = rows.whole(ids_TK), rows.whole(top_probs_TK.detach())
        every_TE = torch.zeros((every_id_TK.shape[0], num_experts), dtype=probs_TE.dtype, device=probs_TE.device)
        keys_TE = every_TE.scatter(1, every_id_TK, every_prob_TK)
        every_mask_TE = torch.zeros_like(keys_TE, dtype=torch.bool).scatter_(1, every_id_TK, True)
        mask_TE = rows.mine(keep_top_keys(every_mask_TE, keys_TE, capacity, sort=False))
    else:
        capacity = dropless_capacity(counts_E)

    # Renormalise in [T, E] so the sum runs over experts in the same order as DeepSpeed's (bitwise equal).
    gates_TE = probs_TE * mask_TE
    denom_T1 = torch.clamp(gates_TE.sum(-1, keepdim=True), min=torch.finfo(torch.float32).eps)
    weights_TK = (gates_TE / denom_T1).gather(1, ids_TK)
    kept_TK = mask_TE.gather(1, ids_TK)
    return Routing(ids_TK, weights_TK, kept_TK, capacity, aux_loss, counts_E, probs_TE, "token")

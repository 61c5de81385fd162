"""Expert capacity and token dropping, with DeepSpeed's exact arithmetic and tie-breaking.

Shape legend: T tokens, E experts, K routes per token; `mask_TE` marks (token, expert) routes.
Dropping never builds a [T, E, C] tensor: a route either fits in its expert's C slots or it is dropped.
Nothing here reads a device tensor on the host except `keep_top_random_keys_top1`, the CPU-only fast path.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from moetron.model.moe.routing.decision import route_counts


@functools.lru_cache(maxsize=1024)  # pure function of a few numbers; called every forward
def capacity_from_factor(num_tokens: int, num_experts: int, capacity_factor: float, k: int, min_capacity: int) -> int:
    """DeepSpeed's `_capacity`: max(ceil(T / E · k·cf), min_capacity).

    Pure host arithmetic (no tensor, no device), rounded the way DeepSpeed's is: it multiplies the Python
    float T / E by the float32 0-dim tensor `torch.tensor(cf·k)`, which torch computes as a float32 product
    of the two values rounded to float32 — numpy's float32 scalars do the same. It matters: T=25, E=2, cf=1.2
    gives 16 (float64 arithmetic would give 15).
    """
    multiplier = np.float32(capacity_factor * k)
    capacity = math.ceil(np.float32(num_tokens / num_experts) * multiplier)
    return max(int(capacity), min_capacity)


def dropless_capacity(counts_E: torch.Tensor, num_tokens: int | None = None) -> torch.Tensor:
    """No-drop capacity: the busiest expert's load (top-1 also clamps it to T; pass `num_tokens` for that).

    An int64 0-dim device tensor, not an int: DeepSpeed's `int(.max())` would stall a GPU every forward for
    a number that only reports read (`Routing.capacity` turns it into an int on demand).
    """
    capacity = counts_E.amax() if counts_E.numel() else counts_E.new_zeros(())
    return capacity if num_tokens is None else capacity.clamp(max=num_tokens)


def keep_top_keys(mask_TE: torch.Tensor, keys_TE: torch.Tensor, capacity: int, sort: bool) -> torch.Tensor:
    """Per expert, keep the routes whose keys are among the `capacity` largest of its column.

    The same `torch.topk(keys, k=min(C, T), dim=0)` call as DeepSpeed's top-1 (RTS or not) and top-k
    'probs' policy, so even ties (the 0/1 mask used as keys when RTS is off) break identically on the
    same device. `sort` mirrors the call being replicated (top-1: True, top-k: False) because the
    selected set under ties may depend on it. Returns `mask_TE` with the non-selected routes zeroed.
    """
    num_tokens = mask_TE.shape[0]
    top_rows_CE = torch.topk(keys_TE, k=min(capacity, num_tokens), dim=0, sorted=sort).indices
    selected_TE = torch.zeros_like(mask_TE).scatter_(0, top_rows_CE, 1)
    return mask_TE * selected_TE if mask_TE.dtype != torch.bool else mask_TE & selected_TE


def slots_in_token_order(mask_TE: torch.Tensor) -> torch.Tensor:
    """int64 [T, E]: each route's position among its expert's routes, counted in token order."""
    return torch.cumsum(mask_TE.long(), dim=0) - 1


def keep_by_position(mask_TE: torch.Tensor, capacity: int) -> torch.Tensor:
    """Keep the first `capacity` routes of each expert in token order (Megatron's 'position' policy)."""
    return mask_TE & (slots_in_token_order(mask_TE) < capacity)


def keep_top_keys_top1(ids_T: torch.Tensor, keys_TE: torch.Tensor, capacity: int) -> torch.Tensor:
    """bool [T]: `keep_top_keys(one_hot(ids_T), keys_TE, capacity, sort=True)` read at each token's expert.

    The same `torch.topk` call (so ties break identically), but the kept routes are read off the [C, E]
    winners instead of scattering them into a [T, E] mask and multiplying it with the one-hot mask.
    """
    num_tokens, num_experts = keys_TE.shape
    top_rows_CE = torch.topk(keys_TE, k=min(capacity, num_tokens), dim=0, sorted=True).indices
    # A winner row counts only if that token really routes to this column's expert. The others are sent
    # to a sink row past the last token (a boolean-mask index would read its size on the host).
    routed_CE = ids_T[top_rows_CE] == torch.arange(num_experts, device=ids_T.device)
    rows_CE = torch.where(routed_CE, top_rows_CE, num_tokens)
    kept_T = torch.zeros(num_tokens + 1, dtype=torch.bool, device=ids_T.device)
    return kept_T.index_fill_(0, rows_CE.reshape(-1), True)[:num_tokens]


def keep_top_random_keys_top1(ids_T: torch.Tensor, rand_TE: torch.Tensor, capacity: int) -> torch.Tensor:
    """bool [T]: `keep_top_keys_top1(ids_T, one_hot(ids_T) · rand_TE, capacity)` without the [T, E] topk.

    One sort of the T routes (expert ascending, key descending) ranks each route within its expert; the
    routes ranked below C are kept. That is exactly the topk's choice whenever it has a unique answer: no
    routed key is 0 (0 ties with every unrouted entry of the column) and no over-full expert has equal
    keys across its capacity boundary. Otherwise (one batch in millions) it runs the topk itself, so the
    result is DeepSpeed's, ties included. Reads the device once (the tie check): a CPU-only fast path,
    chosen where `host_reads_are_free`; CUDA runs `keep_top_keys_top1`.
    """
    num_tokens = ids_T.shape[0]
    keep = min(capacity, num_tokens)
    key_T = rand_TE.gather(1, ids_T.unsqueeze(1)).squeeze(1)
    # 2e + (1 − key) lies in (2e, 2e + 1]: experts never overlap, and float64 holds it exactly.
    sorted_T, order_T = torch.sort(ids_T.double() * 2 + (1 - key_T.double()), stable=True)
    counts_E = route_counts(ids_T, rand_TE.shape[1])
    rank_T = torch.arange(num_tokens, device=ids_T.device) - (torch.cumsum(counts_E, 0) - counts_E)[ids_T[order_T]]
    first_dropped_T = rank_T == keep
    boundary_tie = first_dropped_T[1:] & (sorted_T[1:] == sorted_T[:-1])
    if bool(boundary_tie.any() | (key_T == 0).any()):
        keys_TE = torch.zeros_like(rand_TE).scatter_(1, ids_T.unsqueeze(1), key_T.unsqueeze(1))
        return keep_top_keys_top1(ids_T, keys_TE, capacity)
    return torch.empty_like(ids_T, dtype=torch.bool).index_copy_(0, order_T, rank_T < keep)

"""DeepSpeed's `top1gating` / `top2gating` / `topkgating` (0.19.x) in per-route form, and the routing machinery
every gating path shares.

Same op order, same RNG draws in the same order (so one torch seed gives the same random choices), same capacity
arithmetic and the same `torch.topk` calls for dropping, so the kept routes, weights and aux loss match DeepSpeed's;
only the output layout differs: [T, K] routes instead of dense [S, E, C] tensors. The generic path
(`generic_gating.py`) reuses this file's decision type, capacity rules and drops; `router.py` picks the path. (The
shared parts live here, below both paths, because the router imports both: DeepSpeed's arithmetic is the base the
modern options are built around.)

Read top to bottom: the decision (`Routing`), where the tokens sit (`TokenRows`), capacity and dropping, the aux
loss's parts, noise, then top-1, top-2 and top-k gating.

Shape legend: T tokens, E experts, K routes per token, C capacity; `mask_TE` marks (token, expert) routes. Nothing
builds a [T, E, C] tensor: a route either fits in its expert's C slots or it is dropped.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from moetron.errors import UserError
from moetron.model.backends import experts_backend
from moetron.model.moe.stats import load_max_over_mean

# ---------------------------------------------------------------- the decision
SLOT_ORDERS = ("token", "choice")


class RoutingInputError(UserError, ValueError):
    """Tokens the router cannot route as configured (a ValueError; the CLI prints it as one line)."""


@dataclass(eq=False)
class Routing:
    """What the router decides for one batch of tokens, in per-route [T, K] form.

    Column k of every `_TK` tensor is a token's k-th choice (column 0 = first choice). Dropped routes keep their
    expert id (so statistics can see where they wanted to go) but carry weight 0 and `kept=False`. `slots_TK` and
    `z_loss` are computed on first read: the dispatcher needs neither, and building them eagerly (an int64 [T, E]
    cumsum, a [T, E] logsumexp) cost more than the routing decision itself. `capacity` is read on demand too: in
    dropless mode it is the busiest expert's load, a device value, and reading it on the host would stall a GPU's
    queue in every forward (see `capacity_source`).
    """

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


# ---------------------------------------------------------------- where the tokens sit
class TokenRows:
    """Where a router's T tokens sit in the micro-batch as one process would route it; this base: all are here.

    A router's random draws (top-2's sampled second expert, RSample, Jitter, the RTS keys) and its capacity
    decisions depend on the whole micro-batch: the draws on each token's place in the generator's stream, capacity
    on the token count and on the other tokens routed to the same expert. In one process every token is here and
    `LOCAL_ROWS` is the identity. A layout that splits the micro-batch's sequences over ranks (context parallelism,
    `parallel/cp/whole_sequence.py`) gives the router its own `TokenRows`, so that the draws and the decisions are
    the one-process run's for these tokens:

        rows.tokens(T)                 the micro-batch's token count (capacity is computed from it)
        rows.draw(torch.rand, (T, E))  draws at the micro-batch's shape, this rank's rows kept (draw_whole: all rows)
        rows.whole(ids_TK)             [T_all, ...]: every rank's rows in the one-process order (no gradient)
        rows.mine(kept_TK_all)         this rank's rows of a whole-micro-batch tensor
    """

    def tokens(self, num_tokens: int) -> int:
        return num_tokens

    def draw(self, draw: Callable[[tuple[int, ...]], torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        """This rank's rows of `draw` made at the micro-batch's shape (`shape` is this rank's)."""
        return self.mine(self.draw_whole(draw, shape))

    def draw_whole(self, draw: Callable[[tuple[int, ...]], torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        """`draw` at the micro-batch's shape (every rank's rows, in the one-process order)."""
        return draw(tuple(shape))

    def whole(self, local: torch.Tensor) -> torch.Tensor:
        return local

    def mine(self, whole: torch.Tensor) -> torch.Tensor:
        return whole


LOCAL_ROWS = TokenRows()


# ---------------------------------------------------------------- capacity and dropping
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
    result is DeepSpeed's, ties included. Reads the device once (the tie check): a CPU-only fast path (reading a
    CPU tensor waits for nothing; on a GPU it would stall the queue), so other devices run `keep_top_keys_top1`.
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


# ---------------------------------------------------------------- the aux loss's parts
def balance_loss(probs_XE: torch.Tensor, route_fraction_XE: torch.Tensor, k: int) -> torch.Tensor:
    """E/k · Σ_e mean-probability_e · route-fraction_e along the last dim: 1.0 when perfectly uniform."""
    num_experts = probs_XE.shape[-1]
    return (probs_XE * route_fraction_XE).sum(-1) * num_experts / k


class MeanAndGather(torch.autograd.Function):
    """(probs_TE.mean(0), probs_TE.gather(1, ids_TK)): the router probabilities' mean over tokens (for the aux loss)
    and their values at the chosen routes (for the combine weights), with one [T, E] gradient instead of two: the
    mean's (grad / T, expanded) with the routes' gradients scatter-added into it. Autograd would build the gather's
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
    `rows`: these tokens' place in the micro-batch (`TokenRows`): draws, capacity and drops are its.
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
    if rand_TE is None:
        return keep_top_keys_top1(ids_T, _one_hot_bool(ids_T, num_experts).long(), capacity)  # DeepSpeed's exact ties
    if rand_TE.device.type == "cpu":  # one sort and one read of the device, which waits for nothing on a CPU
        return keep_top_random_keys_top1(ids_T, rand_TE, capacity)
    # Elsewhere DeepSpeed's topk over keys = one-hot mask · U(0, 1): no host read (the dry run counts them on fake
    # CUDA tensors, tests/integration/test_dry_run.py). The same routes as the sort path.
    return keep_top_keys_top1(ids_T, torch.where(_one_hot_bool(ids_T, num_experts), rand_TE, 0.0), capacity)


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
    `rows`: these tokens' place in the micro-batch (`TokenRows`): the noise, capacity and queue are its.
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

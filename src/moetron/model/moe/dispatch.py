"""Token dispatch for one MoE layer: sort the routes by expert (permute), then add the weighted expert outputs
back onto their tokens (unpermute). Never builds an [S, E, C] tensor: the cost is O(T·K·D).

    x_RD, counts, ctx = dispatcher.dispatch(x_TD, routing)  # R = T·K rows: kept routes by expert, then the rest
    y_RD = experts(x_RD, counts)                             # computes the kept rows only
    y_TD = dispatcher.combine(y_RD, ctx)                      # Σ_k weight_tk · expert_k(x_t)

Static shapes, no host sync (the GPU never waits for Python): every one of the T·K routes gets a row. The
kept routes come first, grouped by expert (token order within an expert); the dropped routes follow (the
tail). How many rows are kept, N = Σ counts_E, stays on the device: the experts' grouped GEMM stops at
offset N. The tail is never computed — on CUDA it holds whatever memory `torch._grouped_mm`'s output got —
so nothing may carry it onward (0 · NaN is NaN): `permute`'s gather drops the tail rows' gradients, and
`unpermute` adds the tail into a sink row it discards, with the weights selected (`where`), not multiplied.
Dropless routing keeps every route: N = T·K, no tail.

Dropless top-1 with unit weights (Mixtral-style renormalised top-1) needs neither copy: each token has one row and
its output is that row's, so `LocalDispatcher` hands the experts x_TD itself with the sort order (`TokenOrder`), the
experts read their rows in place and write their outputs in token order, and the combine has nothing left to do.

`permute` and `unpermute` are plain functions so that the expert-parallel `AllToAllDispatcher` can reuse
them: it sorts by GLOBAL expert id here, exchanges `counts_E` (per global expert) and the first N rows (N is
host-side there: the split sizes are) with its peers, and runs `unpermute` on the rows it gets back.

Shape legend: T tokens, K routes per token, D hidden size, E experts (global ids), R = T·K routes (rows),
N kept routes (a device value), order_R: flat route index t·K + k of each sorted row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from moetron.model.backends import experts_backend
from moetron.model.moe.routing.router import Routing, route_counts


@dataclass(frozen=True)
class TokenOrder:
    """The rows handed to the experts are in TOKEN order, not sorted: the experts' row r is token order_R[r] (a
    permutation of the tokens), and they return their outputs in token order too (`GroupedExperts` reads and writes
    the rows in place where its kernel can, else permutes them itself)."""

    order_R: torch.Tensor  # int64 [T]: the token of each expert-sorted row
    inverse_R: torch.Tensor  # int64 [T]: the expert-sorted row of each token


@dataclass(frozen=True)
class ExpertCounts:
    """What the dispatcher tells the experts besides the rows: the rows per expert (a device tensor), and,
    when the router knows it on the host, a bound on every count (the capacity), so that the batched
    backend can pad to it without reading the counts."""

    counts_E: torch.Tensor  # int64 [E]: rows per local expert; rows past their sum are not computed
    capacity: int | None = None  # host bound on every count (capacity-factor mode), None = unknown
    token_order: TokenOrder | None = None  # the rows are in token order (see `TokenOrder`), None: sorted by expert


def without_last_row(t_XA: torch.Tensor) -> torch.Tensor:
    """`t_XA[:-1]` for a fresh tensor nothing else holds: shrunk in place in eager mode (a whole tensor, not a
    view — see GatherRows.backward for why that matters), a view under torch.compile, as Dynamo cannot trace
    `resize_` (a graph break in the middle of the MoE layer otherwise). The same values either way."""
    if torch.compiler.is_compiling():
        return t_XA.narrow(0, 0, t_XA.shape[0] - 1)
    return t_XA.resize_(t_XA.shape[0] - 1, *t_XA.shape[1:])


class GatherRows(torch.autograd.Function):
    """`src_XA.index_select(0, index_R)` whose backward sends row r's gradient to row `grad_index_R[r]`;
    rows whose grad index is X (one past the last row, a sink) pass no gradient back, whatever it holds."""

    @staticmethod
    def forward(ctx, src_XA: torch.Tensor, index_R: torch.Tensor, grad_index_R: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(grad_index_R)
        ctx.num_rows = src_XA.shape[0]
        return src_XA.index_select(0, index_R)

    @staticmethod
    def backward(ctx, grad_RA: torch.Tensor):
        (grad_index_R,) = ctx.saved_tensors
        # index_select's own backward (zeros + index_add_, same order) into one extra row, then dropped.
        zeros_XA = grad_RA.new_zeros(ctx.num_rows + 1, *grad_RA.shape[1:])
        grad_XA = experts_backend(grad_RA.device).index_add_rows(zeros_XA, grad_index_R, grad_RA)
        # Dropped by shrinking the tensor in place, not by slicing: autograd adds a second gradient of the same
        # input (the router's, for the layer's x) in place into a first one that is a whole tensor, but into a
        # fresh [T, D] buffer when the first is a view (torch's InputBuffer::accumulate), one more cold 4 MiB
        # write per step at T=8192, D=128. The same values either way.
        return without_last_row(grad_XA), None, None


class PermuteRows(torch.autograd.Function):
    """`src_XA.index_select(0, order_R)` where order_R is a permutation of src's rows (each row exactly once), with
    the backward gathering through the inverse permutation instead of autograd's zeros + index_add_: no [X, A] zero
    fill, and a gather instead of a scatter-add. The same values (0 + g = g; a -0.0 stays -0.0 instead of becoming
    +0.0, which `torch.equal` counts as equal)."""

    @staticmethod
    def forward(ctx, src_XA: torch.Tensor, order_R: torch.Tensor, inverse_R: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse_R)
        return src_XA.index_select(0, order_R)

    @staticmethod
    def backward(ctx, grad_RA: torch.Tensor):
        (inverse_R,) = ctx.saved_tensors
        return grad_RA.index_select(0, inverse_R), None, None


def inverse_permutation(order_R: torch.Tensor) -> torch.Tensor:
    """int64 [R]: inverse_R[order_R[r]] = r."""
    rows_R = torch.arange(order_R.numel(), device=order_R.device)
    return torch.empty_like(order_R).index_copy_(0, order_R, rows_R)


def gather_rows(src_XA: torch.Tensor, index_R: torch.Tensor, keep_grad_R: torch.Tensor) -> torch.Tensor:
    """Rows `index_R` of src; the gradient of row r reaches src only where `keep_grad_R[r]`."""
    return GatherRows.apply(src_XA, index_R, torch.where(keep_grad_R, index_R, src_XA.shape[0]))


def sort_routes(
    expert_ids_TK: torch.Tensor, kept_TK: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order_R, counts_E, kept_R): all routes' flat indices, kept ones first sorted by expert (stable: token
    order within an expert), dropped ones after; the kept routes per expert; which sorted rows are kept."""
    ids_R = expert_ids_TK.reshape(-1)
    keys_R = torch.where(kept_TK.reshape(-1), ids_R, num_experts)  # dropped routes sort to the tail
    sorted_keys_R, order_R = torch.sort(keys_R, stable=True)
    counts_E = route_counts(keys_R, num_experts + 1)[:num_experts]
    return order_R, counts_E, sorted_keys_R < num_experts


def permute(
    x_TD: torch.Tensor, expert_ids_TK: torch.Tensor, kept_TK: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gather every route's token row, grouped by expert: (x_RD, counts_E, order_R, kept_R).

    Gradient flows to x_TD from the kept rows only (a token routed K times gets the sum of its rows')."""
    order_R, counts_E, kept_R = sort_routes(expert_ids_TK, kept_TK, num_experts)
    x_RD = gather_rows(x_TD, route_tokens(order_R, expert_ids_TK.shape[1]), kept_R)
    return x_RD, counts_E, order_R, kept_R


def route_tokens(order_R: torch.Tensor, topk: int) -> torch.Tensor:
    """The token of each flat route index (t·K + k → t)."""
    return order_R if topk == 1 else order_R // topk


def unpermute(
    y_RD: torch.Tensor,
    order_R: torch.Tensor,
    weights_TK: torch.Tensor,
    num_tokens: int,
    kept_R: torch.Tensor | None = None,
    unit_weights: bool = False,
) -> torch.Tensor:
    """y_TD[t] = Σ over t's kept routes of weight · expert output; tokens with no kept route get 0.

    `kept_R` marks the rows that hold a kept route's output; the others (never computed, any value) reach
    neither the output nor a gradient. None: every row does. The weighted sum accumulates in fp32
    (DeepSpeed >= 0.19.4) and is cast back to y's dtype. Gradients flow to y_RD and to weights_TK, except with
    `unit_weights` (`Routing.unit_weights`: every kept weight is exactly 1): then no product and no weight gradient."""
    acc_dtype = torch.promote_types(y_RD.dtype, torch.float32)
    weights_R = None if unit_weights else weights_TK.reshape(-1).index_select(0, order_R).to(acc_dtype)
    token_R = route_tokens(order_R, weights_TK.shape[1])
    if kept_R is not None:
        if weights_R is not None:  # the gradient of a tail row's weight is 0, not 0·NaN
            weights_R = torch.where(kept_R, weights_R, 0.0)
        else:  # a tail row is added with weight 0, not 1 (its values are never computed)
            weights_R = kept_R.to(acc_dtype)
        token_R = torch.where(kept_R, token_R, num_tokens)  # the sink row
    if kept_R is None:  # no sink row, so no slice: a slice's backward is a zero fill and a copy of [T + 1, D]
        return WeightedIndexAdd.apply(y_RD.to(acc_dtype), weights_R, token_R, num_tokens).to(y_RD.dtype)
    return WeightedIndexAdd.apply(y_RD.to(acc_dtype), weights_R, token_R, num_tokens, True).to(y_RD.dtype)


# Rows per pass of `WeightedIndexAdd`: ~512 KiB of [rows, D] per operand, so that each pass's temporaries stay in
# L2 instead of one [R, D] temporary per op that the next op reads back from memory (and a fresh multi-MiB buffer
# that the allocator may fault in page by page).
CHUNK_BYTES = 1 << 19


def chunk_rows(num_cols: int, itemsize: int) -> int:
    """Rows of a [rows, num_cols] operand that fill `CHUNK_BYTES`."""
    return max(1, CHUNK_BYTES // max(1, num_cols * itemsize))


class WeightedIndexAdd(torch.autograd.Function):
    """`zeros(rows, D).index_add_(0, token_R, y_RD · weights_R)` (weights None: all 1, no product, no weight
    gradient) with a leaner backward than autograd's: the
    output gradient is gathered once and scaled in place for y, and row-dotted with y for the weights (autograd's
    chain of index_add, mul and sum allocates two more [R, D] tensors).

    Both passes run in chunks of `chunk_rows` rows. Bitwise the same as one pass: the products and the row dots
    are per row, and index_add_ still adds every destination's rows in route order (chunk by chunk).

    `sink`: token_R may also name row `rows` (the dropped routes' sink, whose weight is 0): it is added into one
    extra row that the output drops by shrinking in place — not a slice, whose backward is a zero fill and a copy
    of [rows + 1, D] per step (~1 ms at T=8192, D=128). Its rows' output gradient is then read from row rows - 1
    instead of the sink's zeros: times their weight 0, the same 0 (its sign aside) wherever that gradient is finite,
    and the rows past the kept routes pass no gradient on anyway (see the module docstring)."""

    @staticmethod
    def forward(
        ctx, y_RD: torch.Tensor, weights_R: torch.Tensor, token_R: torch.Tensor, rows: int, sink: bool = False
    ) -> torch.Tensor:
        ctx.save_for_backward(y_RD if weights_R is not None else None, weights_R, token_R)  # y: for weight grads
        ctx.sink_row = rows if sink else None
        # In place on a fresh buffer: the out-of-place index_add would first copy the zeros.
        out_XD = y_RD.new_zeros(rows + sink, y_RD.shape[1])
        step, backend = chunk_rows(y_RD.shape[1], y_RD.element_size()), experts_backend(y_RD.device)
        for lo in range(0, y_RD.shape[0], step):
            hi = lo + step
            rows_RD = y_RD[lo:hi] if weights_R is None else y_RD[lo:hi] * weights_R[lo:hi, None]
            backend.index_add_rows(out_XD, token_R[lo:hi], rows_RD)
        return without_last_row(out_XD) if sink else out_XD

    @staticmethod
    def backward(ctx, grad_XD: torch.Tensor):
        y_RD, weights_R, token_R = ctx.saved_tensors
        if ctx.sink_row is not None:
            token_R = token_R.clamp(max=ctx.sink_row - 1)
        grad_XD = grad_XD.contiguous()
        grad_RD = grad_XD.new_empty(token_R.shape[0], grad_XD.shape[1])
        need_weights = weights_R is not None and ctx.needs_input_grad[1]
        grad_weights_R = y_RD.new_empty(y_RD.shape[0]) if need_weights else None
        step = chunk_rows(grad_XD.shape[1], grad_XD.element_size())
        for lo in range(0, token_R.shape[0], step):
            hi = lo + step
            chunk_RD = torch.index_select(grad_XD, 0, token_R[lo:hi], out=grad_RD[lo:hi])
            if need_weights:
                torch.linalg.vecdot(chunk_RD, y_RD[lo:hi], out=grad_weights_R[lo:hi])
            if weights_R is not None:
                chunk_RD.mul_(weights_R[lo:hi, None])
        return grad_RD, grad_weights_R, None, None, None


class TokenDispatcher(Protocol):
    """Moves tokens to their experts and back. The layer holds one and never does communication itself."""

    def dispatch(self, x_TD: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor | ExpertCounts, Any]:
        """(x_sorted, counts, ctx): rows for this process's experts, sorted by local expert, and the rows per
        local expert (a tensor, or an `ExpertCounts` carrying a host bound too)."""
        ...

    def combine(self, y: torch.Tensor, ctx: Any) -> torch.Tensor:
        """y_TD: the expert outputs back on their tokens, weighted by routing.weights_TK and summed over k."""
        ...


def ep_load_of(ctx: Any) -> torch.Tensor | None:
    """The [2] expert-parallel load (routed, computed rows per rank, max/mean) a dispatcher's context carries, None
    without expert parallelism. A wrapping dispatcher's context is a tuple whose first item is the inner one."""
    while isinstance(ctx, tuple) and ctx:
        ctx = ctx[0]
    return getattr(ctx, "ep_load", None)


@dataclass
class LocalContext:
    order_R: torch.Tensor  # flat route index of each sorted row
    kept_R: torch.Tensor | None  # bool: the sorted row is a kept route (the experts computed it); None: all are
    weights_TK: torch.Tensor
    num_tokens: int
    unit_weights: bool = False  # `Routing.unit_weights`: the combine multiplies by no weight
    inverse_R: torch.Tensor | None = None  # dropless top-1: order_R is a permutation of the tokens, and its inverse
    in_token_order: bool = False  # the experts got and returned the rows in token order (`TokenOrder`)


class LocalDispatcher:
    """Every expert lives in this process: permute, run, unpermute."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def dispatch(self, x_TD: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, ExpertCounts, LocalContext]:
        capacity = routing.host_capacity
        if routing.topk == 1 and capacity is None:  # dropless top-1: each token has one row
            order_R, counts_E, _ = sort_routes(routing.expert_ids_TK, routing.kept_TK, self.num_experts)
            inverse_R = inverse_permutation(order_R)
            ctx = LocalContext(order_R, None, routing.weights_TK, x_TD.shape[0], routing.unit_weights, inverse_R)
            if routing.unit_weights:  # the experts permute (or read in place); the combine is y
                ctx.in_token_order = True
                return x_TD, ExpertCounts(counts_E, capacity, TokenOrder(order_R, inverse_R)), ctx
            return PermuteRows.apply(x_TD, order_R, inverse_R), ExpertCounts(counts_E, capacity), ctx
        x_RD, counts_E, order_R, kept_R = permute(x_TD, routing.expert_ids_TK, routing.kept_TK, self.num_experts)
        kept = self._kept_rows(routing, kept_R)
        ctx = LocalContext(order_R, kept, routing.weights_TK, x_TD.shape[0], routing.unit_weights)
        return x_RD, ExpertCounts(counts_E, capacity), ctx

    def combine(self, y_RD: torch.Tensor, ctx: LocalContext) -> torch.Tensor:
        if ctx.in_token_order:  # the experts' output is already y_TD
            return y_RD
        if ctx.inverse_R is not None and ctx.unit_weights:  # y_TD[t] = y_RD[inverse[t]], with no zeros to add to
            return PermuteRows.apply(y_RD, ctx.inverse_R, ctx.order_R)
        return unpermute(y_RD, ctx.order_R, ctx.weights_TK, ctx.num_tokens, ctx.kept_R, ctx.unit_weights)

    @staticmethod
    def _kept_rows(routing: Routing, kept_R: torch.Tensor) -> torch.Tensor | None:
        """`kept_R`, or None where no route can be dropped: dropless routing (its capacity is a device value,
        the max load, so every route fits; `Routing.capacity_source`) leaves no tail, and `unpermute` then
        needs neither the masks nor the sink row."""
        return kept_R if routing.host_capacity is not None else None

    def __repr__(self) -> str:
        return f"LocalDispatcher(num_experts={self.num_experts})"

"""`--moe-ep-dispatch static`: the all-to-all dispatcher with static shapes, so a MoE layer reads nothing on the host.

The uneven dispatcher (`all_to_all.py`) needs its split sizes as host integers: one `.tolist()` per layer and
forward, a host sync on a GPU (the CPU thread waits for the router's kernels before it can launch the exchange),
and shapes that change every step (no CUDA graph). Here every rank sends every peer a block of exactly B rows:

    x_QD, counts_E, order_Q, kept_Q = permute(x_TD, …)      rows sorted by global expert ⇒ grouped by owner rank
    counts_RE = all-gather(counts_E)                        as in the uneven path (device; equal splits)
    send_RBD[r, p] = x_QD[start_r + p]  for p < send_R[r]    the rows for rank r in its block; the rest is padding
    send_RBD ─all_to_all (equal splits B)─▶ recv_RBD        no host integer but B
    recv rows stable-sorted by (local expert, source)       = the uneven path's regroup; padding sorts last
    … experts (padding rows past Σ counts are not computed), and the reverse on combine, then `unpermute`
      with the rows that did not travel masked (dispatch.py's tail rule).

Every valid row meets the same operations, in the same order, as on the uneven path, so outputs and gradients are
bit-identical to it (tests/distributed/test_ep_static_overlap.py).

B, a host integer per layer (`buffer_rows`), a function of Q = T·K: every rank of the group must run the same
number of tokens (training's micro-batches all have one shape), or the blocks would not line up:
  capacity mode: C·L rows (C the router's host capacity, L local experts), at most Q = T·K. The router applies
    capacity to this rank's tokens, so no source ever sends one expert more than C rows: the block never overflows.
  dropless: ceil(f·Q / R) rows, f learned: it starts at `--moe-ep-buffer-factor` and only grows. A block that
    needs more rows than B sends its first B; the rows left behind are flagged, not silently lost:
    `overflow_share` (device: the largest (source, destination) block that exceeded B, as a multiple of Q / R; 0
    when all fit) is read ONCE per optimizer step by `static_buffers.StepGuard`, which grows f to fit and re-runs
    the whole step, so the step that is applied is always the exact one.
Under `torch.no_grad()` (evaluation, generation: nothing re-runs those) the uneven path is taken: exact, one read
per layer, off the training step's path.

Every rank of the EP group computes the same `overflow_share` from the same all-gathered counts_RE, so the
group agrees on the overflow without another collective; `StepGuard` takes the MAX over all ranks (other EP
groups, other data-parallel replicas) in its one check.

Shape legend: as `all_to_all.py`; B rows per (source, destination) block, S = R·B slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moetron.model.moe.dispatch import gather_rows, inverse_permutation, permute, unpermute
from moetron.model.moe.routing.router import Routing
from moetron.parallel.ep.all_to_all import AllToAll, AllToAllContext, AllToAllDispatcher
from moetron.parallel.ep.replica_plan import max_over_mean, owner_load


@dataclass
class StaticContext:
    order_Q: torch.Tensor  # flat route index of each sorted row (permute's order, all Q routes)
    arrived_Q: torch.Tensor  # bool: the sorted row was kept and fit its block (its output comes back)
    slot_Q: torch.Tensor  # the send slot r·B + p of each sorted row (0 where not arrived)
    valid_S: torch.Tensor  # bool: the received slot holds a row (per source: p < rows it sent me)
    order_S: torch.Tensor  # received slot of each expert-sorted row (valid rows first)
    weights_TK: torch.Tensor
    num_tokens: int
    block_rows: int
    ep_load: torch.Tensor  # fp32 [2]: rows per EP rank max/mean, routed and computed (the same: no replicas)


class StaticAllToAllDispatcher(AllToAllDispatcher):
    """The all-to-all dispatcher with B-row blocks per peer (see the module docstring)."""

    def __init__(self, num_experts: int, group, ep_size: int, ep_rank: int, layer_index=None, buffer_factor=1.5):
        super().__init__(num_experts, group, ep_size, ep_rank, layer_index)
        self.buffer_factor = float(buffer_factor)  # dropless: B = ceil(f · Q / R); grown by StepGuard
        self.overflow_share: torch.Tensor | None = None  # device fp64: largest overflowing block / (Q / R), else 0

    def __repr__(self) -> str:
        return super().__repr__().replace("AllToAllDispatcher(", "StaticAllToAllDispatcher(", 1)

    def buffer_rows(self, routing: Routing, num_routes: int) -> int:
        """B: the rows of every (source, destination) block of this forward."""
        capacity = routing.host_capacity
        if capacity is not None:
            return max(1, min(num_routes, capacity * self.num_local))
        return max(1, min(num_routes, math.ceil(self.buffer_factor * num_routes / self.ep_size)))

    def dispatch(self, x_TD: torch.Tensor, routing: Routing):
        if not torch.is_grad_enabled():
            return super().dispatch(x_TD, routing)
        x_QD, counts_E, order_Q, kept_Q = permute(x_TD, routing.expert_ids_TK, routing.kept_TK, self.num_experts)
        num_routes, ranks = x_QD.shape[0], self.ep_size
        block = self.buffer_rows(routing, num_routes)
        with self.forward_site:
            counts_RE = self.gather_counts(counts_E)
            self._note_overflow(counts_RE, num_routes, block)
            send_R = counts_E.view(ranks, self.num_local).sum(1)
            slot_Q, arrived_Q, source_S, sent_S = send_layout(send_R, kept_Q, block)
            send_SD = gather_rows(x_QD, source_S, sent_S)
            recv_SD = AllToAll.apply(send_SD, [block] * ranks, [block] * ranks, self.group, self.backward_site)
        recv_RL = arrived_rows(self.my_experts(counts_RE), block)  # what fit: the rest is flagged, then re-run
        valid_S, order_S = regroup_blocks(recv_RL, block)
        x_SD = gather_rows(recv_SD, order_S, valid_S.index_select(0, order_S))
        load = max_over_mean(owner_load(counts_RE)).repeat(2)
        weights_TK, num_tokens = routing.weights_TK, x_TD.shape[0]
        ctx = StaticContext(order_Q, arrived_Q, slot_Q, valid_S, order_S, weights_TK, num_tokens, block, load)
        return x_SD, recv_RL.sum(0), ctx

    def combine(self, y_SD: torch.Tensor, ctx) -> torch.Tensor:
        if isinstance(ctx, AllToAllContext):  # the no-grad forward took the uneven path
            return super().combine(y_SD, ctx)
        back_S = inverse_permutation(ctx.order_S)
        ranks, block = self.ep_size, ctx.block_rows
        with self.forward_site:
            out_SD = gather_rows(y_SD, back_S, ctx.valid_S)  # padding slots carry tail rows: no gradient through
            back_SD = AllToAll.apply(out_SD, [block] * ranks, [block] * ranks, self.group, self.backward_site)
        y_QD = gather_rows(back_SD, ctx.slot_Q, ctx.arrived_Q)
        return unpermute(y_QD, ctx.order_Q, ctx.weights_TK, ctx.num_tokens, ctx.arrived_Q)

    def _note_overflow(self, counts_RE: torch.Tensor, num_routes: int, block: int) -> None:
        """Keep the largest block any source of the group needed where it exceeded B, as a share of Q / R (0 where
        every block fit; the same on every rank of the group: counts_RE is)."""
        ranks = self.ep_size
        needed = counts_RE.view(ranks, ranks, self.num_local).sum(2).max()
        share = torch.where(needed > block, needed.double() * ranks / max(num_routes, 1), 0.0)
        self.overflow_share = share if self.overflow_share is None else torch.maximum(self.overflow_share, share)

    def take_overflow_share(self) -> torch.Tensor | None:
        """The largest overflowing block's share since the last call (device; None: no static forward), and reset."""
        out, self.overflow_share = self.overflow_share, None
        return out


def send_layout(send_R: torch.Tensor, kept_Q: torch.Tensor, block: int):
    """(slot_Q, arrived_Q, source_S, sent_S): where each sorted row goes and which slot each row fills.

    Sorted row q (kept rows first, by global expert, so by destination rank) goes to rank r = the block its
    position falls in, slot r·B + (q − start_r); it arrives when kept and q − start_r < B. Slot (r, p) takes row
    start_r + p when p < send_R[r] (and p < B, by construction); other slots are padding (row 0, no gradient)."""
    num_routes, ranks = kept_Q.shape[0], send_R.shape[0]
    end_R = torch.cumsum(send_R, 0)
    start_R = end_R - send_R
    q_Q = torch.arange(num_routes, device=send_R.device)
    dest_Q = torch.searchsorted(end_R, q_Q, right=True).clamp(max=ranks - 1)
    offset_Q = q_Q - start_R.index_select(0, dest_Q)
    arrived_Q = kept_Q & (offset_Q < block)
    slot_Q = torch.where(arrived_Q, dest_Q * block + offset_Q, 0)
    p_B = torch.arange(block, device=send_R.device)
    sent_RB = p_B < send_R[:, None]
    source_RB = torch.where(sent_RB, start_R[:, None] + p_B, 0)
    return slot_Q, arrived_Q, source_RB.reshape(-1), sent_RB.reshape(-1)


def regroup_blocks(recv_RL: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid_S, order_S): which received slots hold a row, and the slots sorted by (local expert, source, position)
    with the padding last: the uneven path's `regroup_by_local_expert` order on the valid slots."""
    num_local = recv_RL.shape[1]
    ends_RL = torch.cumsum(recv_RL, 1)
    p_B = torch.arange(block, device=recv_RL.device)
    expert_RB = torch.searchsorted(ends_RL, p_B.expand(recv_RL.shape[0], block).contiguous(), right=True)
    valid_RB = p_B < ends_RL[:, -1:]
    keys_S = torch.where(valid_RB, expert_RB, num_local).reshape(-1)
    return valid_RB.reshape(-1), torch.sort(keys_S, stable=True).indices


def arrived_rows(recv_RL: torch.Tensor, block: int) -> torch.Tensor:
    """recv_RL capped by the block: source r's first B rows (in local-expert order) arrive, the rest do not
    (all of them unless the step overflowed)."""
    ends_RL = torch.cumsum(recv_RL, 1).clamp(max=block)
    return torch.diff(ends_RL, dim=1, prepend=ends_RL.new_zeros(ends_RL.shape[0], 1))

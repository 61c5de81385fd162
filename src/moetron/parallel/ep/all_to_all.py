"""Expert parallelism: the all-to-all token dispatcher that plugs into the MoE layer's dispatcher seam.

Each of the `ep` ranks of an expert-parallel group holds `L = E / ep` consecutive experts (rank r: global
ids r·L … r·L + L − 1). One layer's forward, on every rank of the group:

    x_QD, counts_E, order_Q, _ = permute(x_TD, …)     rows sorted by GLOBAL expert ⇒ grouped by owner rank
    counts_RL  ─all_to_all─▶  recv_RL                  how many rows each peer sends to each of my experts
    x_QD[:N]   ─all_to_all─▶  x_MD (uneven splits)     the N kept rows, received grouped by source rank, then expert
    x_MD[local_order_M]  → experts(·, recv_RL.sum(0))  regrouped by local expert for the grouped GEMM
    … and the reverse on combine (inverse regroup, all-to-all with swapped splits, unpermute).

Only the counts travel with equal splits; the rows travel with uneven splits, so dropless routing needs no
padding. Capacity mode takes the same path: the router applies capacity to the LOCAL tokens (DeepSpeed's
semantics), so a capacity-limited layer simply sends fewer rows. With `--disable-moe-token-dropping`
DeepSpeed MAX-all-reduces the capacity over the EP group so that its equal-split `[E, C, M]` buffers line
up; nothing is dropped in that mode, so the all-reduce changes no value, and uneven splits make it
unnecessary here. The one host sync per layer and step is the `.tolist()` of the exchanged counts (the
split sizes must be host integers); `static_all_to_all.py` (`--moe-ep-dispatch static`) removes it with fixed-size
blocks per peer, and `overlap.py` (`--moe-ep-overlap-chunks`) overlaps the exchange with expert compute.

The counts travel as an all-gather (every rank gets every rank's `counts_E`: [R, E]), not an all-to-all, so
that every rank also knows how many rows each EP rank's experts receive: the EP load (`moe_ep_load_routed`,
rows per rank by owner, max/mean) rides on the context as a device tensor, and `--moe-expert-replicas`
(`replicas.py`) plans its copies of hot experts from the same matrix with no further exchange.

Shape legend: T local tokens, D hidden size, E global experts, R ranks in the EP group, L local experts
(E = R·L), Q = T·K routes (permute's rows: kept first), N rows this rank sends (its kept routes), M rows it
receives (routes for its own experts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moetron.model.moe.dispatch import inverse_permutation, permute, unpermute
from moetron.model.moe.experts.grouped import GroupedExperts
from moetron.model.moe.layer import MoELayer
from moetron.model.moe.routing.router import Routing
from moetron.parallel.diagnosis import NO_SITE, Site
from moetron.parallel.ep.replica_plan import max_over_mean, owner_load


class AllToAll(torch.autograd.Function):
    """`all_to_all_single` with uneven splits; the backward sends the gradient back along the same routes."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group, backward_site=NO_SITE) -> torch.Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group, ctx.site = out_splits, in_splits, group, backward_site
        return all_to_all_rows(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        with ctx.site:  # the failure diagnosis's label (no collective, no sync)
            return all_to_all_rows(grad_out, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None, None


def all_to_all_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Send `in_splits[r]` leading-dim rows of x to rank r; receive `out_splits[r]` rows from each rank r."""
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    return out


@dataclass
class AllToAllContext:
    order_N: torch.Tensor  # flat route index (t·K + k) of each row sent, sorted by global expert
    weights_TK: torch.Tensor
    num_tokens: int
    send_splits: list[int]  # rows sent to each rank of the group
    recv_splits: list[int]  # rows received from each rank
    local_order_M: torch.Tensor  # received row of each expert-sorted row
    ep_load: torch.Tensor  # fp32 [2]: rows per EP rank max/mean, routed (by owner) and computed (after replicas)


class AllToAllDispatcher:
    """Token dispatcher for a layer whose experts are spread over the ranks of `group` (the EP group)."""

    def __init__(self, num_experts: int, group, ep_size: int, ep_rank: int, layer_index: int | None = None):
        if num_experts % ep_size:
            raise ValueError(f"{num_experts} experts cannot be split over {ep_size} expert-parallel ranks")
        self.num_experts, self.group = num_experts, group
        self.ep_size, self.ep_rank = ep_size, ep_rank
        self.num_local = num_experts // ep_size
        layer = "a MoE layer" if layer_index is None else f"MoE layer {layer_index}"
        # what a rank was doing when a timeout or a dead peer stops it (`parallel/diagnosis.py`)
        self.forward_site = Site(f"the all-to-all of {layer} (forward)", group, "expert-parallel")
        self.backward_site = Site(f"the all-to-all of {layer} (backward)", group, "expert-parallel")

    def __repr__(self) -> str:
        first = self.ep_rank * self.num_local
        return (
            f"AllToAllDispatcher(experts {first}..{first + self.num_local - 1} of {self.num_experts}, "
            f"ep_rank={self.ep_rank}/{self.ep_size})"
        )

    def gather_counts(self, counts_E: torch.Tensor) -> torch.Tensor:
        """counts_RE: the routes every rank of the group sends to every global expert (an all-gather)."""
        counts_RE = counts_E.new_empty(self.ep_size * self.num_experts)  # flat: gloo's all-gather wants 1-D
        dist.all_gather_single(counts_RE, counts_E.contiguous(), group=self.group)
        return counts_RE.view(self.ep_size, self.num_experts)

    def my_experts(self, x_RE: torch.Tensor) -> torch.Tensor:
        """The columns of this rank's own experts."""
        first = self.ep_rank * self.num_local
        return x_RE[:, first : first + self.num_local]

    def exchange_counts(self, counts_E: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int], torch.Tensor]:
        """(recv_RL, send_splits, recv_splits, counts_RE): recv_RL[r, l] = rows peer r sends to my local expert l."""
        counts_RE = self.gather_counts(counts_E)
        recv_RL = self.my_experts(counts_RE)
        counts_RL = counts_E.view(self.ep_size, self.num_local)
        # one host transfer for both split lists: the only sync this dispatcher adds
        sizes = torch.cat([counts_RL.sum(1), recv_RL.sum(1)]).tolist()
        return recv_RL, sizes[: self.ep_size], sizes[self.ep_size :], counts_RE

    def dispatch(self, x_TD: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, AllToAllContext]:
        """(x_MD, counts_L, ctx): the rows for this rank's experts from every peer, sorted by local expert."""
        x_QD, counts_E, order_Q, _ = permute(x_TD, routing.expert_ids_TK, routing.kept_TK, self.num_experts)
        with self.forward_site:
            recv_RL, send_splits, recv_splits, counts_RE = self.exchange_counts(counts_E)
            num_sent = sum(send_splits)  # the kept routes; the dropped ones (the tail) stay here
            x_MD = AllToAll.apply(x_QD[:num_sent], recv_splits, send_splits, self.group, self.backward_site)
        local_order_M = regroup_by_local_expert(recv_RL, sum(recv_splits))
        order_N = order_Q[:num_sent]
        load = max_over_mean(owner_load(counts_RE))
        ctx = AllToAllContext(
            order_N, routing.weights_TK, x_TD.shape[0], send_splits, recv_splits, local_order_M, load.repeat(2)
        )
        return x_MD.index_select(0, local_order_M), recv_RL.sum(0), ctx

    def combine(self, y_MD: torch.Tensor, ctx: AllToAllContext) -> torch.Tensor:
        """y_TD: expert outputs sent back to the ranks that own the tokens, weighted and summed over routes."""
        back_M = inverse_permutation(ctx.local_order_M)
        with self.forward_site:
            y_ND = AllToAll.apply(
                y_MD.index_select(0, back_M), ctx.send_splits, ctx.recv_splits, self.group, self.backward_site
            )
        return unpermute(y_ND, ctx.order_N, ctx.weights_TK, ctx.num_tokens)


def regroup_by_local_expert(recv_RL: torch.Tensor, num_received: int) -> torch.Tensor:
    """local_order_M: received rows (grouped by source rank, then local expert) reordered to be grouped by
    local expert, then source rank: a stable sort on each row's local expert id (all on device).
    `num_received` = M = recv_RL.sum(), known on the host from the split sizes: given as the repeat's
    output size, so that the device is not asked for it."""
    num_ranks, num_local = recv_RL.shape
    expert_of_block = torch.arange(num_local, device=recv_RL.device).repeat(num_ranks)
    expert_M = torch.repeat_interleave(expert_of_block, recv_RL.reshape(-1), output_size=num_received)
    return torch.sort(expert_M, stable=True).indices


# ---------------------------------------------------------------- applying expert parallelism to a model
def shard_layer_experts(moe: MoELayer, ep_rank: int, ep_size: int) -> None:
    """Keep experts `ep_rank·L … ep_rank·L + L − 1` of the layer (L = E / ep_size). On the meta device this
    allocates nothing; on a built layer the kept slices are copied and the rest freed."""
    old = moe.experts
    local = old.num_global_experts // ep_size
    offset = ep_rank * local
    device = old.w1_EDF.device
    with torch.device("meta"):  # an uninitialised shell: no draw, no memory
        new = GroupedExperts(
            local,
            old.hidden,
            old.ffn,
            old.swiglu,
            old.b1_EF is not None,
            activation=old.activation,
            backend=old.backend,
            expert_offset=offset,
            num_global_experts=old.num_global_experts,
        )
    if device.type != "meta":
        new.to_empty(device=device)
        start = offset - old.expert_offset
        with torch.no_grad():
            for name, param in new.named_parameters():
                param.copy_(getattr(old, name)[start : start + local])
    moe.experts = new

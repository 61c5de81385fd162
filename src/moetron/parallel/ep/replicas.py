"""`--moe-expert-replicas K`: copies of hot experts on under-loaded EP ranks, exact by construction.

The all-to-all dispatcher (`all_to_all.py`) with K replica slots per rank. One layer's forward, every rank:

    counts_RE = all-gather(counts_E)                      every rank's routes per global expert (as without replicas)
    plan = plan_replicas(counts_RE, K)                    the same plan on every rank, on device (`replica_plan.py`)
    rows: each sent row's destination slot (the owner's expert, or replica slot j), sorted by (rank, slot)
    one .tolist(): the row and weight split sizes          the dispatcher's one host read, as without replicas
    x ─all_to_all─▶ rows grouped by source, then slot  →  regrouped by slot: own experts' rows, then replica rows
    replica weights ─all_to_all─▶ [K, …] from their owners (autograd: the backward sends their gradients back)
    combine: own experts' output (the layer's experts) + replica slots' output (the same module's math on the
             received weights), back along the same routes, unpermuted.

Exact: an expert's output for a row does not depend on which rank computes it, and the replica's weight gradient
returns to the owner through the weight all-to-all's backward, where autograd adds it to the owner's own (the
owner's parameter is a leaf used twice: its AccumulateGrad runs once, after both contributions, so the
data-parallel gradient hooks see the sum). Only the summation order changes. Capacity is untouched: the router
decides which routes are kept before anything here runs; replication moves where kept rows are computed.

Every rank takes part in both all-to-alls and their backwards whatever its plan (an unused slot still receives
its own first expert, with no rows; `KeepInGraph` makes its gradient path exist), so no rank waits alone.

Where the weights are read: in a forward pre-hook of the layer's experts, not in `dispatch`. Under ZeRO 2–3
(FSDP2) the experts' own pre-forward hook runs first (FSDP2 prepends it): it has gathered the whole weights, and
it has put `RegisterPostBackwardFunction` on the experts' inputs, whose backward starts the reduce-scatter of
their gradients. Autograd runs ready nodes newest first (AccumulateGrad before anything), so the weight
all-to-all's backward and the read's, created after that function, run before it: the replicas' gradients are in
the owner's gradient when FSDP2 reduce-scatters it. Read in `dispatch` (before the experts' forward), the weights
would still be shards, and their gradients would arrive after the reduce-scatter. Under DDP the place changes
nothing (DDP reduces a parameter once its gradient is complete).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FSDPModule
from torch.func import functional_call

from moetron.model.moe.dispatch import inverse_permutation, permute, unpermute
from moetron.model.moe.experts.grouped import GroupedExperts
from moetron.model.moe.layer import MoELayer
from moetron.model.moe.routing.router import Routing
from moetron.parallel.ep.all_to_all import AllToAll, AllToAllDispatcher, regroup_by_local_expert
from moetron.parallel.ep.replica_plan import ReplicaPlan, max_over_mean, plan_replicas

WEIGHT_NAMES = ("w1_EDF", "w3_EDF", "w2_EFD", "b1_EF", "b2_ED")


class KeepInGraph(torch.autograd.Function):
    """y unchanged; the backward also gives `tied` a zero gradient, so that the collective behind `tied` runs its
    backward even when y used none of it (a rank whose replica slots got no rows)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, tied: torch.Tensor) -> torch.Tensor:
        ctx.tied_shape, ctx.tied_dtype = tied.shape, tied.dtype
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        return grad_y, grad_y.new_zeros(ctx.tied_shape, dtype=ctx.tied_dtype)


@dataclass
class Splits:
    """The host sizes of one forward, from the dispatcher's one `.tolist()`."""

    send: list[int]  # rows sent to each rank
    recv: list[int]  # rows received from each rank
    weight_send: list[int]  # replica weights sent to each rank
    weight_recv: list[int]  # replica weights received from each rank
    own_rows: int  # rows received for this rank's own experts (they come first after the regroup)


@dataclass
class ReplicaContext:
    order_N: torch.Tensor
    send_order_N: torch.Tensor  # sent row of each route-sorted row (rows sorted by destination slot)
    weights_TK: torch.Tensor
    num_tokens: int
    splits: Splits
    local_order_M: torch.Tensor
    x_replica_rows: torch.Tensor  # rows for the replica slots, grouped by slot
    counts_K: torch.Tensor  # rows per replica slot
    ep_load: torch.Tensor  # fp32 [2]: routed and computed rows per rank, max/mean
    plan: ReplicaPlan
    # filled by the experts' forward pre-hook (`ReplicatingDispatcher.send_weights`)
    replica_weights: dict[str, torch.Tensor] | None = None  # [K, …] per weight, received from the owners
    flat_weights: torch.Tensor | None = None  # the received [K, ·] buffer they are views of (kept in the graph)


class ReplicatingDispatcher(AllToAllDispatcher):
    """The all-to-all dispatcher of one MoE layer plus `slots` replica slots per rank (see the module docstring)."""

    def __init__(self, moe: MoELayer, group, ep_size: int, ep_rank: int, slots: int):
        super().__init__(moe.num_experts, group, ep_size, ep_rank, moe.layer_index)
        self.slots = slots
        self._layer = weakref.ref(moe)  # the layer owns this dispatcher: no reference cycle
        self._shell: GroupedExperts | None = None
        self._pending: ReplicaContext | None = None  # set by `dispatch`, its weights filled by `send_weights`
        self._hooked: weakref.ref | None = None  # the experts module `send_weights` is a pre-hook of

    def _hook_experts(self) -> None:
        """`send_weights` as a forward pre-hook of the layer's experts module, registered on the module the layer
        holds now (expert TP replaces it after expert parallelism is applied). Registered before `fully_shard` or
        after, FSDP2's own pre-forward hook runs first: it prepends it."""
        experts = self.experts()
        if self._hooked is not None and self._hooked() is experts:
            return
        dispatcher = weakref.ref(self)

        def before_experts(module, args) -> None:
            if (live := dispatcher()) is not None:  # a replaced dispatcher has nothing pending: no-op
                live.send_weights()

        experts.register_forward_pre_hook(before_experts)
        self._hooked = weakref.ref(experts)

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", replica slots={self.slots})"

    def experts(self) -> GroupedExperts:
        return self._layer().experts

    def replica_shell(self) -> GroupedExperts:
        """A weightless `GroupedExperts` of K experts (meta device) that runs the layer's expert math on the
        received weights (`functional_call`), so replicas compute exactly what the owner computes: of the owner's
        class (under expert TP `FfnShardedExperts`, whose output bias is added on one TP rank and its gradient
        summed over TP), not FSDP2's subclass of it."""
        if self._shell is None:
            own = self.experts()
            with torch.device("meta"):
                shell = GroupedExperts(
                    self.slots, own.hidden, own.ffn, own.swiglu, own.b1_EF is not None, own.activation, own.backend
                )
            shell.__class__ = next(c for c in type(own).__mro__ if not issubclass(c, FSDPModule))
            for name in ("tp_mesh", "tp_rank"):  # `FfnShardedExperts`' TP coordinates
                if hasattr(own, name):
                    setattr(shell, name, getattr(own, name))
            self._shell = shell
        return self._shell

    # ------------------------------------------------------------ dispatch
    def dispatch(self, x_TD: torch.Tensor, routing: Routing):
        self._hook_experts()
        x_QD, counts_E, order_Q, _ = permute(x_TD, routing.expert_ids_TK, routing.kept_TK, self.num_experts)
        with self.forward_site:
            counts_RE = self.gather_counts(counts_E)
        plan = plan_replicas(counts_RE, self.slots)
        recv_RS, dest_key_of_row, sizes = self._routes(plan, counts_RE)
        splits = Splits(*(sizes[i * self.ep_size : (i + 1) * self.ep_size] for i in range(4)), sizes[-1])
        num_sent, num_received = sum(splits.send), sum(splits.recv)
        key_N = dest_key_of_row(num_sent)
        send_order_N = torch.sort(key_N, stable=True).indices
        with self.forward_site:
            x_MD = AllToAll.apply(
                x_QD[:num_sent].index_select(0, send_order_N), splits.recv, splits.send, self.group, self.backward_site
            )
        local_order_M = regroup_by_local_expert(recv_RS, num_received)
        x_sorted = x_MD.index_select(0, local_order_M)
        own, load = (
            splits.own_rows,
            torch.stack([max_over_mean(plan.load_routed_R), max_over_mean(plan.load_computed_R)]),
        )
        ctx = ReplicaContext(
            order_Q[:num_sent],
            send_order_N,
            routing.weights_TK,
            x_TD.shape[0],
            splits,
            local_order_M,
            x_sorted[own:],
            recv_RS[:, self.num_local :].sum(0),
            load,
            plan,
        )
        self._pending = ctx
        return x_sorted[:own], recv_RS[:, : self.num_local].sum(0), ctx

    def _routes(self, plan: ReplicaPlan, counts_RE: torch.Tensor):
        """(recv_RS, dest_key_of_row, sizes): rows each source sends to each of my slots (own experts, then
        replica slots); a function giving each of my sent rows its destination key rank·(L + K) + slot; and the
        host sizes (send, recv, weight send, weight recv per rank, own rows), read in one `.tolist()`."""
        ranks, local, slots, me = self.ep_size, self.num_local, self.slots, self.ep_rank
        owner_RE, replica_RJ = plan.rows_by_destination(counts_RE)
        recv_RS = torch.cat([self.my_experts(owner_RE), replica_RJ[:, me * slots : (me + 1) * slots]], 1)
        send_R = owner_RE[me].view(ranks, local).sum(1) + replica_RJ[me].view(ranks, slots).sum(1)
        owner_J = plan.slot_expert_J // local
        weight_send_R = (owner_J == me).view(ranks, slots).sum(1)
        my_slot_owners = owner_J[me * slots : (me + 1) * slots]
        weight_recv_R = (my_slot_owners[:, None] == torch.arange(ranks, device=owner_J.device)).sum(0)
        own_rows = recv_RS[:, :local].sum().reshape(1)
        sizes = torch.cat([send_R, recv_RS.sum(1), weight_send_R, weight_recv_R, own_rows]).tolist()

        def dest_key_of_row(num_sent: int) -> torch.Tensor:
            counts_E = counts_RE[me]
            experts_E = torch.arange(self.num_experts, device=counts_E.device)
            expert_N = torch.repeat_interleave(experts_E, counts_E, output_size=num_sent)
            first_in_block_E = torch.cumsum(counts_E, 0) - counts_E
            source_start_E = (torch.cumsum(counts_RE, 0) - counts_RE)[me]
            position_N = torch.arange(num_sent, device=counts_E.device) - first_in_block_E[expert_N]
            position_N = position_N + source_start_E[expert_N]  # the row's place in its expert's global order
            owner_key_N = (expert_N // local) * (local + slots) + expert_N % local
            in_slot_NJ = (plan.slot_expert_J == expert_N[:, None]) & (plan.slot_start_J <= position_N[:, None])
            in_slot_NJ &= position_N[:, None] < plan.slot_end_J
            slot_N = torch.argmax(in_slot_NJ.int(), 1)
            replica_key_N = (slot_N // slots) * (local + slots) + local + slot_N % slots
            return torch.where(position_N < plan.owner_keep_E[expert_N], owner_key_N, replica_key_N)

        return recv_RS, dest_key_of_row, sizes

    @torch.compiler.disable  # under `--compile` a collective with host split sizes, like dispatch and combine
    def send_weights(self) -> None:
        """The experts' forward pre-hook: the weight all-to-all of the pending forward (see the module docstring)."""
        ctx, self._pending = self._pending, None
        if ctx is None:
            return
        with self.forward_site:
            ctx.flat_weights, ctx.replica_weights = self._receive_weights(ctx.plan, ctx.splits)

    def _receive_weights(self, plan: ReplicaPlan, splits: Splits) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The K replica experts' weights of this rank's slots, sent by their owners (differentiable)."""
        experts, local, me = self.experts(), self.num_local, self.ep_rank
        slots_total = plan.slot_expert_J.numel()
        owner_J = plan.slot_expert_J // local
        # the slots I own, in slot order (= grouped by destination rank): first in this stable sort
        mine_first_J = torch.sort(
            (owner_J != me).long() * slots_total + torch.arange(slots_total, device=owner_J.device)
        )
        sent_slots = mine_first_J.indices[: sum(splits.weight_send)]
        local_ids = plan.slot_expert_J[sent_slots] % local
        params = [(name, getattr(experts, name)) for name in WEIGHT_NAMES if getattr(experts, name) is not None]
        flat = torch.cat([p.index_select(0, local_ids).reshape(local_ids.numel(), p[0].numel()) for _, p in params], 1)
        received = AllToAll.apply(flat, splits.weight_recv, splits.weight_send, self.group, self.backward_site)
        # received grouped by owner rank (then slot): back to slot order
        my_owners = owner_J[me * self.slots : (me + 1) * self.slots]
        by_owner = torch.sort(my_owners, stable=True).indices
        flat_K = received.index_select(0, inverse_permutation(by_owner))
        weights, start = {}, 0
        for name, p in params:
            width = p[0].numel()
            weights[name] = flat_K[:, start : start + width].reshape(self.slots, *p.shape[1:])
            start += width
        return flat_K, weights

    # ------------------------------------------------------------ combine
    def combine(self, y_MD: torch.Tensor, ctx: ReplicaContext) -> torch.Tensor:
        """The replica slots' outputs after the own experts', then back along the routes they came by."""
        y_replica = functional_call(self.replica_shell(), ctx.replica_weights, (ctx.x_replica_rows, ctx.counts_K))
        y_sorted = KeepInGraph.apply(torch.cat([y_MD, y_replica.to(y_MD.dtype)]), ctx.flat_weights)
        back_M = inverse_permutation(ctx.local_order_M)
        with self.forward_site:
            y_sent = AllToAll.apply(
                y_sorted.index_select(0, back_M), ctx.splits.send, ctx.splits.recv, self.group, self.backward_site
            )
        y_ND = y_sent.index_select(0, inverse_permutation(ctx.send_order_N))
        return unpermute(y_ND, ctx.order_N, ctx.weights_TK, ctx.num_tokens)

"""`--moe-ep-overlap-chunks N`: the expert-parallel all-to-alls overlapped with expert compute (forward).

The plain dispatcher runs dispatch → experts → combine one after the other, so the all-to-all's time adds to the
layer's. Here the routed rows are split into N chunks by LOCAL expert (chunk j: local experts
[j·L/N, (j+1)·L/N) of every rank; a chunk is the tokens routed to those experts), and each chunk's dispatch is an
asynchronous all-to-all (`async_op=True`, NCCL and gloo alike):

    launch dispatch(0);  shared expert (while dispatch 0 is in flight)
    for j:  launch dispatch(j+1);  wait dispatch(j);  experts of chunk j;  launch combine(j)
    wait every combine;  unpermute

so chunk j+1's rows travel while chunk j computes, and chunk j's results travel back while j+1 computes
(Megatron-Core's `--overlap-moe-expert-parallel-comm` overlaps the same two collectives across micro-batches).

Exact: chunking by expert (not by token) keeps every expert's rows together, so each expert's GEMMs see the rows
the plain path gives them in the same order: outputs and gradients are bit-identical to the plain dispatcher
(tests/distributed/test_ep_static_overlap.py). The experts of chunk j run on `split` views of the layer's
weights (`functional_call` on a weightless shell), so the backward concatenates the chunks' weight gradients
instead of adding N full-size zeros. The backward runs the all-to-alls synchronously (autograd's order).

The split sizes of every chunk come from ONE host read per layer (as the plain dispatcher's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.func import functional_call

from moetron.model.moe.dispatch import permute, unpermute
from moetron.model.moe.experts.grouped import GroupedExperts
from moetron.model.moe.routing.router import Routing
from moetron.parallel.diagnosis import NO_SITE
from moetron.parallel.ep.all_to_all import AllToAllDispatcher, all_to_all_rows, regroup_by_local_expert
from moetron.parallel.ep.replica_plan import max_over_mean, owner_load


class InFlight:
    """One asynchronous all-to-all: its output buffer fills once `work` is waited on."""

    def __init__(self):
        self.work = None
        self.keep_alive: torch.Tensor | None = None  # the send buffer, which must outlive the transfer


class LaunchAllToAll(torch.autograd.Function):
    """Start `all_to_all_single` (uneven splits) and return its output buffer (valid after `WaitAllToAll`); the
    backward sends the gradient back along the same routes (synchronously)."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group, flight: InFlight, site=NO_SITE):
        ctx.out_splits, ctx.in_splits, ctx.group, ctx.site = out_splits, in_splits, group, site
        x = x.contiguous()
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        flight.work = dist.all_to_all_single(out, x, out_splits, in_splits, group=group, async_op=True)
        flight.keep_alive = x
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        with ctx.site:
            return all_to_all_rows(grad_out, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None, None, None


class WaitAllToAll(torch.autograd.Function):
    """Identity that first waits for the all-to-all writing `out`."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, flight: InFlight) -> torch.Tensor:
        flight.work.wait()
        flight.keep_alive = None
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


@dataclass
class Chunk:
    first: int  # first local expert of the chunk
    end: int  # one past its last
    send_R: list[int]  # rows this rank sends each rank for the chunk's experts
    recv_R: list[int]  # rows it receives from each rank
    send_rows: list[tuple[int, int]]  # (start, end) of the chunk's rows for each rank in permute's order


@dataclass
class OverlapContext:
    ep_load: torch.Tensor  # fp32 [2]: rows per EP rank max/mean, routed and computed (the same: no replicas)


class OverlappedAllToAllDispatcher(AllToAllDispatcher):
    """The all-to-all dispatcher that computes the experts itself, chunk by chunk between the collectives."""

    def __init__(self, num_experts: int, group, ep_size: int, ep_rank: int, layer_index=None, chunks: int = 2):
        super().__init__(num_experts, group, ep_size, ep_rank, layer_index)
        if not 1 <= chunks <= self.num_local:
            raise ValueError(f"{chunks} overlap chunks need 1..{self.num_local} local experts per chunk")
        self.chunks = chunks
        self._shells: dict[int, GroupedExperts] = {}

    def __repr__(self) -> str:
        text = super().__repr__().replace("AllToAllDispatcher(", "OverlappedAllToAllDispatcher(", 1)
        return text[:-1] + f", chunks={self.chunks})"

    def dispatch_compute_combine(self, x_TD: torch.Tensor, routing: Routing, experts: GroupedExperts, beside=None):
        """(y_TD, ctx, beside_out): the routed experts' output on this rank's tokens, and `beside(x_TD)` (the shared
        expert) computed while the first chunk's rows travel."""
        x_QD, counts_E, order_Q, _ = permute(x_TD, routing.expert_ids_TK, routing.kept_TK, self.num_experts)
        with self.forward_site:
            counts_RE = self.gather_counts(counts_E)
        recv_RL = self.my_experts(counts_RE)
        chunks = self._chunks(counts_E, recv_RL)
        pieces = self._weight_pieces(experts)
        launch = self._launch_dispatch
        flights = [launch(x_QD, chunks[0])]
        beside_out = beside(x_TD) if beside is not None else None
        back = []
        for j, chunk in enumerate(chunks):
            if j + 1 < len(chunks):
                flights.append(launch(x_QD, chunks[j + 1]))
            recv_MD = WaitAllToAll.apply(*flights[j])
            y_MD = self._chunk_experts(experts, pieces[j], recv_MD, recv_RL[:, chunk.first : chunk.end], chunk)
            back.append(self._launch(y_MD, chunk.send_R, chunk.recv_R))
        y_by_chunk = [WaitAllToAll.apply(*f).split(chunk.send_R) for f, chunk in zip(back, chunks, strict=True)]
        y_ND = torch.cat([y_by_chunk[j][r] for r in range(self.ep_size) for j in range(len(chunks))])
        num_sent = sum(sum(chunk.send_R) for chunk in chunks)
        y_TD = unpermute(y_ND, order_Q[:num_sent], routing.weights_TK, x_TD.shape[0])
        return y_TD, OverlapContext(max_over_mean(owner_load(counts_RE)).repeat(2)), beside_out

    # ------------------------------------------------------------ pieces
    def _chunks(self, counts_E: torch.Tensor, recv_RL: torch.Tensor) -> list[Chunk]:
        """Every chunk's split sizes, from one host read of the [R, L] send and receive counts."""
        ranks, local = self.ep_size, self.num_local
        sizes = torch.cat([counts_E, recv_RL.reshape(-1)]).tolist()  # the one host read of the layer
        send_RL = [sizes[r * local : (r + 1) * local] for r in range(ranks)]
        recv = [sizes[ranks * local + r * local : ranks * local + (r + 1) * local] for r in range(ranks)]
        starts, total = [], 0
        for r in range(ranks):
            starts.append(total)
            total += sum(send_RL[r])
        out = []
        for j in range(self.chunks):
            first, end = j * local // self.chunks, (j + 1) * local // self.chunks
            rows = [(starts[r] + sum(send_RL[r][:first]), starts[r] + sum(send_RL[r][:end])) for r in range(ranks)]
            send = [b - a for a, b in rows]
            out.append(Chunk(first, end, send, [sum(recv[r][first:end]) for r in range(ranks)], rows))
        return out

    def _launch(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> tuple[torch.Tensor, InFlight]:
        flight = InFlight()
        with self.forward_site:
            out = LaunchAllToAll.apply(x, out_splits, in_splits, self.group, flight, self.backward_site)
        return out, flight

    def _launch_dispatch(self, x_QD: torch.Tensor, chunk: Chunk) -> tuple[torch.Tensor, InFlight]:
        rows = torch.cat([x_QD[a:b] for a, b in chunk.send_rows])
        return self._launch(rows, chunk.recv_R, chunk.send_R)

    def _weight_pieces(self, experts: GroupedExperts) -> list[dict[str, torch.Tensor]]:
        """Each chunk's slice of every expert parameter (`split`: its backward concatenates, adds nothing)."""
        local, n = self.num_local, self.chunks
        sizes = [(j + 1) * local // n - j * local // n for j in range(n)]
        by_name = {name: param.split(sizes) for name, param in experts.named_parameters(recurse=False)}
        return [{name: parts[j] for name, parts in by_name.items()} for j in range(self.chunks)]

    def _chunk_experts(self, experts, weights, recv_MD, recv_RL, chunk: Chunk) -> torch.Tensor:
        """The chunk's experts on its received rows (regrouped by local expert), returned in received order."""
        order_M = regroup_by_local_expert(recv_RL, recv_MD.shape[0])
        rows = (recv_MD.index_select(0, order_M), recv_RL.sum(0))
        y_sorted = functional_call(self._shell(experts, chunk), weights, rows)
        back_M = torch.empty_like(order_M)
        back_M[order_M] = torch.arange(order_M.numel(), device=order_M.device)
        return y_sorted.index_select(0, back_M)

    def _shell(self, experts: GroupedExperts, chunk: Chunk) -> GroupedExperts:
        """A weightless `GroupedExperts` of the chunk's experts (meta device): the layer's expert math."""
        size = chunk.end - chunk.first
        if size not in self._shells:
            with torch.device("meta"):
                self._shells[size] = GroupedExperts(
                    size, experts.hidden, experts.ffn, experts.swiglu, experts.b1_EF is not None,
                    experts.activation, experts.backend,
                )  # fmt: skip
        return self._shells[size]

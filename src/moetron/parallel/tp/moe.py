"""MoE layers under tensor parallelism: each token reaches its experts once, and routing is the one-process routing.

Tensor-parallel peers hold the same tokens (the MoE layer's input is replicated over TP; under sequence
parallelism it is gathered first, see apply_tp.py) and route them identically: the router runs in fp32
on all T tokens with the same weights and the same random streams (keyed by sample and layer), so capacity, the
aux loss and random token selection are computed over exactly the tokens of the one-process run. Two layouts:

  --expert-tensor-parallel-size 1 (Megatron-Core's MoE parallel folding, the default)
      Experts are whole; expert parallelism may span the TP ranks. `TokenShareDispatcher`: TP rank r dispatches
      only its contiguous 1/tp of the tokens (the routing rows of those tokens, as decided over all of them) through
      the expert-parallel dispatcher, and the outputs are all-gathered over TP — DeepSpeed drops the TP peers'
      duplicate tokens before its all-to-all for the same reason. Under DTensor: Replicate → Shard(0) on the way
      in (a local slice; its backward all-gathers the gradients, so the router and the replicated activations
      get the full gradient on every rank) and Shard(0) → Replicate on the way out.
  --expert-tensor-parallel-size = TP (DeepSpeed's expert tensor parallelism)
      Every expert's ffn channels are split like the dense MLP (`FfnShardedExperts`: w1/w3 by columns, w2 by
      rows); expert parallelism is drawn from the data-parallel ranks. Every TP rank dispatches all its tokens
      (to the EP peers that hold the same channel slice), computes a partial output, and
      `ExpertTensorParallelDispatcher` sums the partial outputs over TP after the combine (Partial → Replicate);
      the inputs and routing weights enter through Replicate → Partial-gradient views, so their gradients are
      summed over TP in backward (Megatron's f / g operators).

What DTensor cannot express here: the grouped expert GEMMs (`torch._grouped_mm`, the padded bmm, the CPU
expert-by-expert kernel) take raw row groups, not DTensors, so the expert weights stay plain local shards; every
collective is still DTensor's, applied to the activations around them.

Gradient reduction of the experts (parallel/dp/replicate.py) is unchanged: under folding the expert-data-
parallel group contains the TP peers, whose token shares are disjoint, so its sum over edp divided by dp is the
one-process gradient; under expert TP each rank's channel slice sees all its tokens, replicated over edp = dp / ep.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from moetron.model.gpt import GPTModel
from moetron.model.init import TensorSlice
from moetron.model.moe.dispatch import TokenDispatcher
from moetron.model.moe.experts.grouped import GroupedExperts
from moetron.model.moe.routing.router import Routing
from moetron.parallel.mesh import ParallelMesh
from moetron.parallel.tp.sizes import shard_range


# ---------------------------------------------------------------- DTensor conversions of activations
def share_of(t: torch.Tensor, mesh) -> torch.Tensor:
    """This TP rank's contiguous share of dim 0 of a replicated tensor; the backward all-gathers the gradient."""
    return DTensor.from_local(t, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(0)]).to_local()


def gather_shares(t: torch.Tensor, mesh, shape: torch.Size) -> torch.Tensor:
    """The shares of every TP rank concatenated along dim 0 (the inverse of `share_of`)."""
    stride = torch.empty(shape, device="meta").stride()
    shard = DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)
    return shard.redistribute(mesh, [Replicate()]).to_local()


def summed_gradient(t: torch.Tensor, mesh) -> torch.Tensor:
    """`t` (replicated over TP) whose gradient is summed over TP in backward: each rank's use of it is partial."""
    return DTensor.from_local(t, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def summed(t: torch.Tensor, mesh) -> torch.Tensor:
    """The sum over TP of each rank's partial `t`; the backward passes the gradient through."""
    return DTensor.from_local(t, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()


# ---------------------------------------------------------------- dispatchers
class TokenShareDispatcher:
    """Folding (etp = 1): dispatch this TP rank's share of the tokens through `inner`; gather all shares after."""

    def __init__(self, inner: TokenDispatcher, mesh, tp_rank: int, tp_size: int):
        self.inner, self.mesh, self.tp_rank, self.tp_size = inner, mesh, tp_rank, tp_size

    def __repr__(self) -> str:
        return f"TokenShareDispatcher(share {self.tp_rank}/{self.tp_size} of the tokens, {self.inner!r})"

    def dispatch(self, x_TD: torch.Tensor, routing: Routing):
        share = dataclasses.replace(
            routing,
            expert_ids_TK=share_of(routing.expert_ids_TK, self.mesh),
            kept_TK=share_of(routing.kept_TK, self.mesh),
            weights_TK=share_of(routing.weights_TK, self.mesh),
        )
        x_ND, counts, ctx = self.inner.dispatch(share_of(x_TD, self.mesh), share)
        return x_ND, counts, (ctx, x_TD.shape)

    def combine(self, y_ND: torch.Tensor, ctx) -> torch.Tensor:
        inner_ctx, shape = ctx
        return gather_shares(self.inner.combine(y_ND, inner_ctx), self.mesh, shape)


class ExpertTensorParallelDispatcher:
    """Expert TP (etp = tp): every TP rank dispatches all tokens to its channel slice; partial outputs are summed."""

    def __init__(self, inner: TokenDispatcher, mesh):
        self.inner, self.mesh = inner, mesh

    def __repr__(self) -> str:
        return f"ExpertTensorParallelDispatcher({self.inner!r})"

    def dispatch(self, x_TD: torch.Tensor, routing: Routing):
        weights_TK = summed_gradient(routing.weights_TK, self.mesh)
        return self.inner.dispatch(
            summed_gradient(x_TD, self.mesh), dataclasses.replace(routing, weights_TK=weights_TK)
        )

    def combine(self, y_ND: torch.Tensor, ctx) -> torch.Tensor:
        return summed(self.inner.combine(y_ND, ctx), self.mesh)


# ---------------------------------------------------------------- experts split along their ffn channels
class FfnShardedExperts(GroupedExperts):
    """GroupedExperts holding ffn channels `F·r/tp … F·(r+1)/tp` of every expert (w1/w3 columns, w2 rows, b1).
    Their outputs are partial sums, so the output bias b2 is added by TP rank 0 only; its gradient is summed over
    TP in backward, so every rank's replica of b2 gets the full gradient."""

    tp_mesh: object
    tp_rank: int

    def output_bias(self, dtype: torch.dtype) -> torch.Tensor:
        b2_ED = summed_gradient(self.b2_ED.to(dtype), self.tp_mesh)
        return b2_ED if self.tp_rank == 0 else b2_ED * 0


def split_expert_ffn(old: GroupedExperts, mesh, tp_rank: int, tp_size: int) -> FfnShardedExperts:
    """`old`'s experts with only this rank's ffn channels; on the meta device nothing is allocated, a built module's
    slices are copied."""
    ffn = old.ffn // tp_size
    with torch.device("meta"):
        new = GroupedExperts(
            old.num_experts,
            old.hidden,
            ffn,
            old.swiglu,
            old.b1_EF is not None,
            activation=old.activation,
            backend=old.backend,
            expert_offset=old.expert_offset,
            num_global_experts=old.num_global_experts,
        )
    new.__class__ = FfnShardedExperts
    new.tp_mesh, new.tp_rank = mesh, tp_rank
    channels = shard_range(old.ffn, tp_size, tp_rank)
    every = slice(None)
    dims = {"w1_EDF": 2, "w3_EDF": 2, "w2_EFD": 1, "b1_EF": 1}
    new.param_slices, new.tp_shard_dims = {}, {}
    for name, dim in dims.items():
        full = getattr(old, name)
        if full is None:
            continue
        index = tuple(channels if d == dim else every for d in range(full.dim()))
        new.param_slices[name] = TensorSlice(tuple(full.shape), index)
        new.tp_shard_dims[name] = dim
    device = old.w1_EDF.device
    if device.type != "meta":
        new.to_empty(device=device)
        with torch.no_grad():
            for name, param in new.named_parameters():
                part = new.param_slices.get(name)
                param.copy_(getattr(old, name)[part.index] if part else getattr(old, name))
    return new


def apply_moe_tp(model: GPTModel, mesh: ParallelMesh) -> None:
    """After expert parallelism: wrap every MoE layer's dispatcher for TP and, with expert TP, split its experts'
    ffn channels. No-op when tp == 1."""
    tp = mesh.size("tp")
    if tp == 1:
        return
    tp_mesh, rank = mesh.submesh("tp"), mesh.coords.tp
    for moe in model.moe_layers():
        if mesh.size("etp") == 1:
            moe.dispatcher = TokenShareDispatcher(moe.dispatcher, tp_mesh, rank, tp)
            continue
        if not isinstance(moe.experts, FfnShardedExperts):
            moe.experts = split_expert_ffn(moe.experts, tp_mesh, rank, tp)
        moe.dispatcher = ExpertTensorParallelDispatcher(moe.dispatcher, tp_mesh)

"""ZeRO stages 2 and 3 on FSDP2 (`fully_shard`): gradients reduce-scattered, and at stage 3 weights gathered per layer.

One FSDP2 group per unit, bottom-up (each group is all-gathered and reduce-scattered in one collective):

    experts of a MoE layer   over the expert-data-parallel mesh `edp` (only where it is not the dp group: with
                             ep > 1, or under TP folding, where edp spans the TP peers' disjoint token shares;
                             else they are ordinary members of their block's group), gradients summed over edp
                             and divided by the FULL dp (× cp): the all-to-all already brought every expert-parallel
                             peer's tokens into them (the same rule as `ExpertGradReducer`; `expert_reduction`
                             says who divides)
    router of a MoE layer    its own group with an fp32 policy under bf16/fp16, so routing never sees rounded
                             weights (the router upcasts its input itself)
    transformer block        over the data-parallel mesh `dp_cp` (dp, or dp × cp under context parallelism:
                             CP peers hold other tokens of the same samples, so they are gradient replicas too,
                             Megatron-Core's distributed optimizer over dp × cp)
    the root (embeddings, final norm, output layer)   over `dp_cp`, fp32 (see below)

`reshard_after_forward`: True at stage 3 (a block's weights exist whole only while it runs forward or
backward: DeepSpeed's ZeRO-3), False at stage 2 (gathered once per step, kept until the backward is done:
ZeRO-2's whole weights during the step, with sharded gradients and optimizer state). The root is never resharded
after forward (the head is the first thing the backward needs). Gradients are reduce-scattered after every
micro-batch's backward, so accumulation adds into the shards (no whole gradient ever lives across micro-batches).

Mixed precision: the sharded weights (the optimizer's) stay fp32 — the master copy; blocks and experts gather in
the compute dtype (half the traffic and the gathered memory) and reduce gradients in fp32. `cast_forward_inputs`
is off and the executor's autocast still decides each op's dtype, so the residual stream, norms, softmax and loss
stay fp32 as at stage 0; the root gathers fp32 for the same reason (the embedding output is the residual stream).

Parameters become DTensors `Shard(d)` over their group's 1-D mesh (d = 0, or for expert stacks with fewer local
experts than edp ranks the first dimension edp divides, so every rank holds a share). Names do not change.
`materialize_sharded` builds a meta-device model into this form one unit at a time: a rank never holds more than
its shards plus one block's whole weights, however large the model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from moetron.model.gpt import GPTModel, TransformerLayer
from moetron.model.init import init_tree, output_std
from moetron.model.mtp import mtp_transformer_layers
from moetron.parallel.dp.base import DataParallel
from moetron.parallel.dp.zero_spec import ZeroSpec
from moetron.parallel.mesh import ParallelMesh


def policies(spec: ZeroSpec):
    """(blocks and experts, fp32 units) mixed-precision policies."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    fp32 = MixedPrecisionPolicy(cast_forward_inputs=False)
    if spec.compute_dtype == torch.float32:
        return fp32, fp32
    return MixedPrecisionPolicy(spec.compute_dtype, torch.float32, cast_forward_inputs=False), fp32


def expert_placement(parts: int, experts: set[int]) -> Callable:
    """FSDP2's `shard_placement_fn`: expert stacks `[E_local, …]` split on dim 0 when `parts` divides E_local,
    else on the first dimension it divides (so no rank is left without a share); everything else the default."""
    from torch.distributed.tensor import Shard

    def place(param: nn.Parameter):
        if id(param) not in experts or param.shape[0] % parts == 0:
            return None
        dim = next((d for d in range(1, param.ndim) if param.shape[d] % parts == 0), 0)
        return Shard(dim)

    return place


@dataclass(frozen=True)
class ExpertReduction:
    """How a MoE layer's expert gradients become the sum over edp divided by dp (see `expert_reduction`)."""

    divide_factor: float | None  # FSDP2's `set_gradient_divide_factor` (None: leave FSDP2's default)
    force_sum: bool  # FSDP2's `set_force_sum_reduction_for_comms`: sum in the collective, divide after it
    divide_after: int  # `ShardedDataParallel.finish_gradients` divides the reduced gradients by this (1: no)


def expert_reduction(backend: str, edp: int, dp: int) -> ExpertReduction:
    """The expert group's reduction settings on `backend` ("gloo", "nccl", …) for an edp group of `edp` ranks.

    edp > 1: FSDP2 divides by dp. NCCL folds the 1/dp into the reduce-scatter (PREMUL_SUM); gloo has no
    PREMUL_SUM, so there FSDP2 sums, then divides. edp = 1: no collective runs, and what FSDP2 does with a divide
    factor in its place has changed between torch versions (2.13 divides its copy of the gradient by it, and under
    sum-then-divide once more after: gradients / dp², the halved expert gradients of dp = 2). So FSDP2 is left at
    its default there — a plain copy on a 1-rank group, on every backend — and the division happens after the
    backward."""
    if edp == 1:
        return ExpertReduction(divide_factor=None, force_sum=False, divide_after=dp)
    return ExpertReduction(divide_factor=float(dp), force_sum=backend == "gloo", divide_after=1)


def mesh_expert_reduction(mesh: ParallelMesh) -> ExpertReduction:
    return expert_reduction(dist.get_backend(mesh.group("edp")), mesh.size("edp"), mesh.size("dp_cp"))


def experts_have_own_group(mesh: ParallelMesh) -> bool:
    """Whether routed experts are reduced over another group than the dense parameters: with expert parallelism,
    and under tensor parallelism with folding (etp < tp: the TP peers dispatch disjoint token shares, so the edp
    group spans them). Else (ep = 1, etp = tp) the edp group is the dp group."""
    return mesh.size("ep") > 1 or mesh.size("etp") != mesh.size("tp")


def shard_block(layer: TransformerLayer, mesh: ParallelMesh, spec: ZeroSpec) -> None:
    """One transformer block's FSDP2 groups: its experts (edp, when `experts_have_own_group`), its router (fp32),
    then the rest."""
    from torch.distributed.fsdp import fully_shard

    blocks, fp32 = policies(spec)
    reshard = spec.reshard_after_forward
    expert_ids: set[int] = set()
    if layer.is_moe:
        moe = layer.mlp
        expert_ids = {id(p) for p in moe.experts.parameters()}
        if experts_have_own_group(mesh):
            edp = mesh.submesh("edp")
            placement = expert_placement(mesh.size("edp"), expert_ids)
            fully_shard(
                moe.experts, mesh=edp, reshard_after_forward=reshard, mp_policy=blocks, shard_placement_fn=placement
            )
            reduction = mesh_expert_reduction(mesh)
            if reduction.divide_factor is not None:
                moe.experts.set_gradient_divide_factor(reduction.divide_factor)
            if reduction.force_sum:
                moe.experts.set_force_sum_reduction_for_comms(True)
        if spec.compute_dtype != torch.float32:
            fully_shard(moe.router, mesh=mesh.submesh("dp_cp"), reshard_after_forward=reshard, mp_policy=fp32)
    placement = expert_placement(mesh.size("dp_cp"), expert_ids)
    fully_shard(
        layer, mesh=mesh.submesh("dp_cp"), reshard_after_forward=reshard, mp_policy=blocks, shard_placement_fn=placement
    )


def shard_root(model: GPTModel, mesh: ParallelMesh, spec: ZeroSpec) -> None:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=mesh.submesh("dp_cp"), reshard_after_forward=False, mp_policy=policies(spec)[1])


def fully_shard_model(model: GPTModel, mesh: ParallelMesh, spec: ZeroSpec) -> None:
    """Every FSDP2 group of a materialised model (each rank briefly holds the whole model: prefer building it with
    `materialize_sharded`)."""
    # the MTP modules' layers are FSDP2 blocks like the main layers', so a MoE MTP layer's experts get their own edp
    # group too (under expert parallelism each rank holds other experts than its dp peers: reduced over dp, their
    # gradients would mix)
    for layer in [layer for _, layer in model.layer_items()] + mtp_transformer_layers(model):
        shard_block(layer, mesh, spec)
    shard_root(model, mesh, spec)


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def materialize_in_units(model: GPTModel, device: torch.device | str, seed: int, shard: Callable[[nn.Module], None]):
    """Materialise and initialise a meta-device model block by block, calling `shard(block)` after each block and
    `shard(model)` after the root's own modules: the values are those of `model.init_weights(seed)` (every
    parameter is drawn from its own name's generator), but only one unit is ever whole."""
    std = model.cfg.init_method_std
    out_std = output_std(std, model.cfg.num_layers)
    for index, layer in model.layer_items():
        layer.to_empty(device=device)
        init_tree(layer, seed, std, out_std, prefix=f"layers.{index}")
        shard(layer)
    for name, child in model.named_children():
        if name != "layers":
            child.to_empty(device=device)
            init_tree(child, seed, std, out_std, prefix=name)
    model.to_empty(device=device, recurse=False)
    shard(model)


def materialize_sharded(model: GPTModel, mesh: ParallelMesh, spec: ZeroSpec, device: torch.device | str, seed: int):
    """`model.to_empty(device); model.init_weights(seed)` for a meta-device model, sharded unit by unit."""

    def shard(unit: nn.Module) -> None:
        if unit is not model:
            shard_block(unit, mesh, spec)
            return
        for layer in mtp_transformer_layers(model):  # materialised with the root's own modules
            shard_block(layer, mesh, spec)
        if not spec.pipelined:  # under pipelining each stage module is a root of its own (`shard_stage`)
            shard_root(model, mesh, spec)

    materialize_in_units(model, device, seed, shard)


class ShardedDataParallel(DataParallel):
    """What FSDP2 installed: the forward runs through the model itself; gradients are reduce-scattered by the
    backward (every micro-batch, into the shards) and waited for at its end. What is left: dividing the
    `divided_after` parameters' gradients (experts over a 1-rank edp group, see `expert_reduction`) by their
    divisor — once, after the last micro-batch, since FSDP2 accumulated the micro-batches into the shards."""

    def __init__(self, model: nn.Module, divided_after: tuple[list[nn.Parameter], int] | None = None):
        super().__init__(model, model, None)
        # the sharded DTensors, captured now: after a forward without backward (evaluation) at stage 2 the module
        # holds its gathered weights instead, until the next backward or state_dict() reshards it
        self._sharded = super().optimizer_parameters()
        self._divided_after = divided_after

    def optimizer_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self._sharded)

    def micro_batch(self, last: bool):
        return contextlib.nullcontext()

    def finish_gradients(self) -> None:
        if self._divided_after is None:
            return
        params, divisor = self._divided_after
        grads = [p.grad.to_local() for p in params if p.grad is not None]
        if grads:
            torch._foreach_div_(grads, float(divisor))


def shard_stage(stage: nn.Module, mesh: ParallelMesh, spec: ZeroSpec) -> None:
    """A pipeline stage module (`pp/split.py`'s `StageModule`: its `layers`, and the embeddings or the final norm
    and head it runs) as torchtitan shards one: its blocks' groups, then the stage itself as the FSDP2 root over
    `dp` (fp32, never resharded after forward), so torch's `PipelineStage` finds an `FSDPModule` and syncs the
    gradients once, after the step's last micro-batch."""
    from torch.distributed.fsdp import fully_shard

    for layer in list(stage.layers.values()) + mtp_transformer_layers(stage):
        if not is_sharded(layer):
            shard_block(layer, mesh, spec)
    fully_shard(stage, mesh=mesh.submesh("dp_cp"), reshard_after_forward=False, mp_policy=policies(spec)[1])


def apply_fsdp(module: nn.Module, mesh: ParallelMesh, spec: ZeroSpec) -> ShardedDataParallel:
    """ZeRO stage 2 or 3 on the whole model (it may already be sharded by `materialize_sharded`) or on one
    pipeline stage module (`shard_stage`)."""
    if isinstance(module, GPTModel):
        if not is_sharded(module):
            fully_shard_model(module, mesh, spec)
    else:
        shard_stage(module, mesh, spec)
    divided_after = None
    if experts_have_own_group(mesh) and (divisor := mesh_expert_reduction(mesh).divide_after) > 1:
        layers = list(module.layers.values()) + mtp_transformer_layers(module)
        experts = [p for layer in layers if layer.is_moe for p in layer.mlp.experts.parameters()]
        divided_after = (experts, divisor)
    return ShardedDataParallel(module, divided_after)

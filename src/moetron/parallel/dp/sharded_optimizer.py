"""ZeRO stage 1 (Megatron's `--use-distributed-optimizer`): optimizer state sharded, gradients and weights whole.

Gradients are reduced exactly as at stage 0 (DDP over `dp_cp` for dense parameters, the expert reducer over `edp`),
so every rank holds the whole reduced gradient. Each rank then owns one slice of every parameter (of the tensor
it holds: under tensor parallelism its TP shard, under pipelining its stage's parameters) — dense
ones split over the data-parallel group (dp × cp under context parallelism), routed experts over their
expert-data-parallel group — and the
optimizer steps only that slice, keeping Adam's moments for it alone (1/dp of dense and 1/edp of expert state).
After the step one flat all-gather per group and bucket brings every rank's updated slices back into the whole
weights.

The slices are `DTensor`s `Shard(d)` over the group's 1-D mesh whose local tensors are VIEWS of the parameter's
own rows and of its gradient's rows: no master copy (the weights are already fp32), no gradient copy, and a
checkpoint load into the parameters updates the slices with them. `d` is the parameter's first dimension longer
than 1 (0 but for a stack of ONE local expert `[1, D, F]`, split on D): slicing there is still one contiguous
block, so views stay views, and a rank holding one expert shares it with its edp peers. Because they are
DTensors exactly like FSDP2's (stages 2–3), the gradient norm (`grad_norm.py` sums a DTensor's squared norm over
its sharded mesh dimension), the checkpoint (`GlobalView`) and resharding between stages are one code path.

Why not `torch.distributed.optim.ZeroRedundancyOptimizer`: it gives each rank whole parameters (the embedding
alone can be a rank's share, so state is not ~1/dp), keeps one process group (experts need edp, dense dp), and
holds each parameter's state on one rank only, which is no DTensor a layout-free checkpoint can describe. Why not
FSDP2 without resharding: FSDP2 always reduce-scatters gradients, which is stage 2.
Why a hand-written all-gather: DTensor's `redistribute` issues one collective per parameter; one flat
`all_gather_single` per bucket is what FSDP2 does internally, and it needs no host sync.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

BUCKET_ELEMENTS = 1 << 25  # 128 MiB of fp32 gathered at a time: bounds the transient buffer after the step


def chunk_rows(rows: int, parts: int) -> int:
    """Rows per slice when `rows` are split in `parts` (torch.chunk's and DTensor's `Shard` rule: ceil)."""
    return max(math.ceil(rows / parts), 1) if rows else 0


def shard_dim(shape: torch.Size) -> int:
    """The first dimension longer than 1: the slices along it are contiguous (every dimension before is 1)."""
    if not shape:
        raise ValueError("ZeRO stage 1 cannot shard a 0-dimensional parameter")
    return next((d for d, size in enumerate(shape) if size > 1), 0)


def row_slice(rows: int, parts: int, index: int) -> slice:
    """The rows slice `index` of `parts` holds (empty past the end, as DTensor's uneven `Shard(0)`)."""
    size = chunk_rows(rows, parts)
    start = min(index * size, rows)
    return slice(start, min(start + size, rows))


@dataclass
class ShardedParam:
    name: str
    param: nn.Parameter  # the model's whole parameter (replicated)
    shard: nn.Parameter  # DTensor Shard(dim) over `mesh`, local = a view of this rank's rows of `param`
    mesh: object  # the 1-D DeviceMesh of its group (dp or edp)
    dim: int
    rows: slice  # along `dim`

    def as_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (the parameter's shape) as [rows along dim, rest]: a view (every dimension before is 1)."""
        return tensor.view(tensor.shape[self.dim], -1)


def _view_as_shard(tensor: torch.Tensor, mesh, dim: int, rows: slice) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Shard

    local = tensor.detach().narrow(dim, rows.start, rows.stop - rows.start)
    return DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=tensor.shape, stride=tensor.stride())


class OptimizerShards:
    """This rank's slice of every trainable parameter, for the optimizer; gradients and weights stay whole."""

    def __init__(self, groups: list[tuple[object, list[tuple[str, nn.Parameter]]]]):
        """`groups`: (1-D DeviceMesh, named parameters sharded over it), e.g. dense over dp, experts over edp."""
        self.entries: list[ShardedParam] = []
        self.groups: list[tuple[object, list[ShardedParam]]] = []
        for mesh, named in groups:
            size, rank = mesh.size(), mesh.get_local_rank()
            entries = []
            for name, param in named:
                if not param.requires_grad:
                    continue
                dim = shard_dim(param.shape)
                rows = row_slice(param.shape[dim], size, rank)
                shard = nn.Parameter(_view_as_shard(param, mesh, dim, rows))
                entries.append(ShardedParam(name, param, shard, mesh, dim, rows))
            self.entries += entries
            self.groups.append((mesh, entries))

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(e.name, e.shard) for e in self.entries]

    def shard_gradients(self) -> None:
        """After the reduction: each slice's gradient is a view of its rows of the whole gradient. The whole
        gradient leaves the parameter (the next backward starts from None) and lives until the optimizer's
        `zero_grad` drops the slices."""
        for e in self.entries:
            grad = e.param.grad
            e.shard.grad = None if grad is None else _view_as_shard(grad, e.mesh, e.dim, e.rows)
            e.param.grad = None

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Gather the updated slices into the whole weights after every optimizer step."""
        optimizer.register_step_post_hook(lambda *_: self.gather_parameters())

    @torch.no_grad()
    def gather_parameters(self) -> None:
        for mesh, entries in self.groups:
            if mesh.size() == 1:
                continue  # the slice is the whole parameter: updated in place already
            for bucket in _buckets(entries, mesh.size()):
                _all_gather_bucket(bucket, mesh)


def _padded_numel(e: ShardedParam, parts: int) -> int:
    rows_RN = e.as_rows(e.param)
    return chunk_rows(rows_RN.shape[0], parts) * rows_RN.shape[1]


def _buckets(entries: list[ShardedParam], parts: int) -> list[list[ShardedParam]]:
    """Consecutive entries of one dtype whose gathered size stays under BUCKET_ELEMENTS (at least one each)."""
    buckets: list[list[ShardedParam]] = []
    size = 0
    for e in entries:
        numel = _padded_numel(e, parts) * parts
        fits = buckets and size + numel <= BUCKET_ELEMENTS and buckets[-1][0].param.dtype == e.param.dtype
        if not fits:
            buckets.append([])
            size = 0
        buckets[-1].append(e)
        size += numel
    return buckets


def _all_gather_bucket(bucket: list[ShardedParam], mesh) -> None:
    """Every rank's slices of the bucket's parameters, padded to equal size, in one all-gather; then each
    parameter is rebuilt from the rows of every rank (its own rows are rewritten with the same values)."""
    parts = mesh.size()
    sizes = [_padded_numel(e, parts) for e in bucket]
    first = bucket[0].param
    send = first.new_zeros(sum(sizes))
    offset = 0
    for e, size in zip(bucket, sizes, strict=True):
        local = e.shard.to_local().reshape(-1)
        send[offset : offset + local.numel()].copy_(local)
        offset += size
    recv = first.new_empty(parts * send.numel())
    dist.all_gather_single(recv, send, group=mesh.get_group())
    recv_PS = recv.view(parts, -1)
    offset = 0
    for e, size in zip(bucket, sizes, strict=True):
        param_RN = e.as_rows(e.param)
        rows, row_numel = param_RN.shape
        whole = recv_PS[:, offset : offset + size].reshape(parts * chunk_rows(rows, parts), row_numel)
        param_RN.copy_(whole[:rows])
        offset += size

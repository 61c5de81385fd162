"""What Muon's orthogonalisation needs: each hidden matrix whole, however this rank holds it, and this rank's part back.

Newton–Schulz orthogonalises a whole matrix (the result's singular vectors are the whole update's), so a rank that
holds part of one gathers the update, orthogonalises it and keeps its own part. Every rank of the group computes the
same orthogonalisation of the same whole matrix (duplicated compute, as Megatron-Core's `duplicated` TP mode):

    how this rank holds the parameter          gather                                  per step and matrix
    plain tensor (DP replica; EP: its experts) none: it is whole                       —
    DTensor `Shard(d)`: ZeRO-1's optimizer     `full_tensor()`: an all-gather over     one all-gather of the matrix
      shards, FSDP2's parameters (ZeRO 2-3)      dp (edp for experts), then this       (fp32, its full size): ZeRO-3's
                                                 rank's `Shard(d)` block of the result   weight gather once more
    an expert stack `[E_local, m, n]` sharded  none: each rank holds whole experts     —
      on dim 0 (ZeRO over edp)
    TP shard (registry `tp_dim`), mode         an all-gather over tp (etp for          one all-gather of the matrix
      `duplicated`                               experts), concatenated on `tp_dim`,
                                                 then this rank's block
    TP shard, mode `blockwise`                 none: each shard is orthogonalised      —
                                                 alone (Megatron-Core's default)
    ZeRO shard of a TP shard, `duplicated`     the ZeRO gather (the rank's TP shard),  both all-gathers
                                                 then the TP gather

The gathered copy is transient (one matrix at a time: peak memory grows by the largest matrix, not by the model).
Row and column order do not matter: orthogonalisation commutes with permuting them, so concatenating the shards in
rank order is enough even where a shard's rows are not one contiguous block of the global matrix (fused QKV).
Why a collective here and not in the optimizer: collectives live in `parallel/`, through the mesh's groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moetron.parallel.mesh import ParallelMesh
from moetron.parallel.params import ParamRegistry

TP_MODES = ("duplicated", "blockwise")


class WholeAlready:
    """This rank holds the whole matrix (or, blockwise, orthogonalises its own block)."""

    def whole(self, local: torch.Tensor) -> torch.Tensor:
        return local

    def mine(self, whole: torch.Tensor) -> torch.Tensor:
        return whole


@dataclass
class ShardedRows:
    """A DTensor parameter (ZeRO 1–3): gather the update over its mesh, keep this rank's block."""

    mesh: object  # the parameter's DeviceMesh
    placements: tuple
    shape: torch.Size  # global
    stride: tuple[int, ...]

    def whole(self, local: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        spread = DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )
        return spread.full_tensor()

    def mine(self, whole: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        sizes, offsets = compute_local_shape_and_global_offset(self.shape, self.mesh, self.placements)
        for dim, (size, offset) in enumerate(zip(sizes, offsets, strict=True)):
            whole = whole.narrow(dim, offset, size)
        return whole


@dataclass
class TensorParallelBlock:
    """A tensor-parallel shard split on `dim`: all-gather the blocks over the TP group, keep this rank's."""

    group: object
    size: int
    rank: int
    dim: int

    def whole(self, local: torch.Tensor) -> torch.Tensor:
        blocks = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(blocks, local.contiguous(), group=self.group)
        return torch.cat(blocks, dim=self.dim)

    def mine(self, whole: torch.Tensor) -> torch.Tensor:
        block = whole.shape[self.dim] // self.size
        return whole.narrow(self.dim, self.rank * block, block)


@dataclass
class ShardedTensorParallelBlock:
    """A ZeRO shard of a TP shard: its DTensor's global tensor is the rank's TP shard, so gather that first, then
    the TP blocks; back the other way. (Gathering only over ZeRO's mesh would orthogonalise each TP block alone.)"""

    zero: ShardedRows
    tp: TensorParallelBlock

    def whole(self, local: torch.Tensor) -> torch.Tensor:
        return self.tp.whole(self.zero.whole(local))

    def mine(self, whole: torch.Tensor) -> torch.Tensor:
        return self.zero.mine(self.tp.mine(whole))


def matrix_part(name: str, param: torch.Tensor, registry: ParamRegistry, mesh: ParallelMesh | None, tp_mode: str):
    """How parameter `name` (as the optimizer steps it: `param`) becomes whole for orthogonalisation and back."""
    from torch.distributed.tensor import DTensor, Shard

    info = registry[name]
    tp = None
    if info.tp_dim is not None and mesh is not None and tp_mode == "duplicated":
        dim_name = "etp" if info.is_expert else "tp"
        if mesh.size(dim_name) > 1:
            sub = mesh.submesh(dim_name)
            tp = TensorParallelBlock(sub.get_group(), mesh.size(dim_name), sub.get_local_rank(), info.tp_dim)
    zero = None
    if isinstance(param, DTensor):
        placements = tuple(param.placements)
        # whole experts on every rank (a stack sharded on its expert dimension): each orthogonalised where it lives
        if not (info.is_expert and all(p == Shard(0) for p in placements)):
            zero = ShardedRows(param.device_mesh, placements, param.shape, param.stride())
    if zero is not None and tp is not None:
        return ShardedTensorParallelBlock(zero, tp)
    return zero or tp or WholeAlready()

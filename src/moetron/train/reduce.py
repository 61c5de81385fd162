"""Reductions of metrics over one parallel dimension of the mesh (identity where that dimension has size 1)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from moetron.parallel.mesh import ParallelMesh


def mean_over(mesh: ParallelMesh, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function averaging a tensor over the ranks of dimension `name` (e.g. the data-parallel replicas, whose
    losses are different samples; tensor-parallel peers hold the same values and are not averaged)."""
    size = mesh.size(name)

    def reduce(tensor: torch.Tensor) -> torch.Tensor:
        if size == 1:
            return tensor
        out = tensor.clone()
        dist.all_reduce(out, group=mesh.group(name))
        return out / size

    return reduce

"""The process's place in the parallel layout: coordinates, and DeviceMeshes / process groups by purpose.

    mesh = ParallelMesh.build(dims, env)      # every rank calls it (collective in a multi-process run)
    mesh.coords.dp, mesh.size("ep")            # this rank's data-parallel index, the EP degree
    mesh.group("edp")                          # the process group that reduces expert gradients
    mesh.group("dp_cp")                        # the dense gradients' replicas: data- and context-parallel peers
    mesh.submesh("edp", "ep")                  # a DeviceMesh over some dimensions (for DTensor, DCP, FSDP2)

Two DeviceMeshes cover the same ranks: the dense one `(pp, dp, cp, tp)` (with `dp_cp`, its dp and cp dimensions
flattened into one, when cp > 1) and the expert one `(pp, edp, ep, etp)` (layout rules in `dims.py`). In a
single process there is no mesh: every coordinate is 0, every size 1, and `group` returns None, so
single-process code never touches `torch.distributed`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from moetron.parallel.diagnosis import set_group_timeouts
from moetron.parallel.dims import DENSE_DIMS, EXPERT_DIMS, FLATTENED_DIMS, Coordinates, ParallelDims
from moetron.parallel.env import DistEnv


@dataclass
class ParallelMesh:
    dims: ParallelDims
    coords: Coordinates
    dense: object | None = None  # DeviceMesh (pp, dp, tp); None in one process
    experts: object | None = None  # DeviceMesh (pp, edp, ep, etp); None in one process
    flattened: dict = field(default_factory=dict)  # name → 1-D DeviceMesh of flattened dense dims ("dp_cp", cp > 1)

    @classmethod
    def build(cls, dims: ParallelDims, env: DistEnv) -> ParallelMesh:
        coords = dims.coordinates(env.rank)
        if dims.world_size == 1:
            return cls(dims, coords)
        from torch.distributed.device_mesh import DeviceMesh

        ranks = torch.arange(dims.world_size)
        device_type = env.device.type
        dense = DeviceMesh(device_type, ranks.view(dims.mesh_shape(DENSE_DIMS)), mesh_dim_names=DENSE_DIMS)
        experts = DeviceMesh(device_type, ranks.view(dims.mesh_shape(EXPERT_DIMS)), mesh_dim_names=EXPERT_DIMS)
        flattened = {}
        if dims.cp > 1:  # the dense gradients' replicas: data- and context-parallel peers as one group
            flattened["dp_cp"] = dense[FLATTENED_DIMS["dp_cp"]]._flatten("dp_cp")
        mesh = cls(dims, coords, dense, experts, flattened)
        set_group_timeouts(dense, experts, *flattened.values())  # --distributed-timeout-minutes for every group
        for name in DENSE_DIMS + EXPERT_DIMS:  # the mesh and the arithmetic must agree on every coordinate
            assert mesh.submesh(name).get_local_rank() == getattr(coords, name), f"mesh disagrees on {name}"
        return mesh

    @property
    def distributed(self) -> bool:
        return self.dense is not None

    def size(self, name: str) -> int:
        return self.dims.sizes[name]

    def submesh(self, *names: str):
        """The DeviceMesh over `names` (all dense or all expert dimensions); None in one process."""
        if not self.distributed:
            return None
        if names == ("dp_cp",):  # without context parallelism the same ranks as dp: no group of its own
            return self.flattened["dp_cp"] if self.dims.cp > 1 else self.dense["dp"]
        if "dp_cp" in names and self.dims.cp == 1:
            names = tuple("dp" if n == "dp_cp" else n for n in names)
        elif "dp_cp" in names:  # e.g. (dp_cp, tp): a ZeRO shard of a TP shard as its global tensor (checkpoint)
            with warnings.catch_warnings():  # torch 2.13 still slices a flattened dim from the root, and warns
                warnings.filterwarnings("ignore", message="Slicing a flattened dim", category=UserWarning)
                return self.dense[names]
        root = self.dense if set(names) <= set(DENSE_DIMS) else self.experts
        return root[names[0]] if len(names) == 1 else root[names]

    def group(self, name: str):
        """The process group of dimension `name` for this rank; None in one process."""
        sub = self.submesh(name)
        return None if sub is None else sub.get_group()

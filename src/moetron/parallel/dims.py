"""Parallel degrees: checked before any process group exists, then turned into one named `DeviceMesh`.

`world_size = dp · tp · pp`. Expert parallelism does not multiply the world: like DeepSpeed it is drawn from
the data-parallel ranks (`dp % ep == 0`), which then split into `ep` expert shards × `dp // ep` expert-data-
parallel replicas. Today TP = PP = 1 and EP = 1; the expert-parallel work extends `problems()` and the mesh.
"""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED = {"tp": 1, "pp": 1, "ep": 1}  # the largest degree each dimension supports today


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    dp: int
    tp: int = 1
    pp: int = 1
    ep: int = 1

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: replicas of each expert shard."""
        return self.dp // self.ep if self.ep else 0

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    def problems(self) -> list[str]:
        p: list[str] = []
        for name, value, flag in [
            ("tp", self.tp, "--tensor-model-parallel-size"),
            ("pp", self.pp, "--pipeline-model-parallel-size"),
            ("ep", self.ep, "--moe-expert-parallel-size"),
        ]:
            if value < 1:
                p.append(f"{flag} must be >= 1, got {value}")
            elif value > SUPPORTED[name]:
                p.append(f"{flag} {value} is not supported yet (at most {SUPPORTED[name]}); use {SUPPORTED[name]}")
        if self.tp >= 1 and self.pp >= 1 and self.world_size % (self.tp * self.pp):
            p.append(
                f"world size {self.world_size} is not divisible by --tensor-model-parallel-size {self.tp} × "
                f"--pipeline-model-parallel-size {self.pp}; change the process count or the degrees"
            )
        if self.ep >= 1 and self.dp >= 1 and self.dp % self.ep:
            p.append(
                f"data-parallel size {self.dp} is not divisible by --moe-expert-parallel-size {self.ep}; "
                f"experts are sharded over data-parallel ranks, so use a divisor of {self.dp}"
            )
        return p

    def build_mesh(self, device_type: str):
        """A `DeviceMesh` with a named "dp" dimension (None in a single process, where nothing is sharded)."""
        if self.world_size == 1:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.dp,), mesh_dim_names=("dp",))

"""Parallel degrees: checked before any process group exists, then turned into one named `DeviceMesh`.

`world_size = dp · tp · pp`. Expert parallelism does not multiply the world: like DeepSpeed it is drawn from
the data-parallel ranks (`dp % ep == 0`), which then split into `ep` expert shards × `edp = dp // ep` expert-
data-parallel replicas. The mesh is `(edp, ep)` in row-major rank order, which is DeepSpeed's default "E+D"
layout: expert-parallel groups are contiguous blocks of `ep` ranks ([0, 1], [2, 3], … for ep = 2) and
expert-data-parallel groups are strided ({0, 2, 4, …}, {1, 3, 5, …}); "dp" is the two flattened together.

Designed for TP and PP (not implemented yet, so both must be 1 today): the full mesh will be
`(pp, edp, ep, tp)`, which reproduces DeepSpeed's expert-TP layout (world 16, tp 2, ep 4 → EP [0, 2, 4, 6],
EDP [0, 8]) while the `ep`, `edp` and `dp` names keep their meaning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SUPPORTED = {"tp": 1, "pp": 1}  # the largest degree each dimension supports today (ep: any divisor of dp)


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

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    def ep_rank(self, rank: int) -> int:
        """Position of global `rank` inside its expert-parallel group (tp = pp = 1: contiguous blocks)."""
        return rank % self.ep

    def edp_rank(self, rank: int) -> int:
        """Position of global `rank` inside its expert-data-parallel group."""
        return rank // self.ep

    def problems(self, experts_per_layer: Sequence[int] = ()) -> list[str]:
        """Every problem with the degrees (and the MoE layers' expert counts), each with its fix."""
        p: list[str] = []
        for name, value, flag in [
            ("tp", self.tp, "--tensor-model-parallel-size"),
            ("pp", self.pp, "--pipeline-model-parallel-size"),
            ("ep", self.ep, "--moe-expert-parallel-size"),
        ]:
            if value < 1:
                p.append(f"{flag} must be >= 1, got {value}")
            elif value > SUPPORTED.get(name, value):
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
        bad = sorted({e for e in experts_per_layer if e > 1 and self.ep >= 1 and e % self.ep})
        if bad:
            p.append(
                f"--moe-expert-parallel-size {self.ep} does not divide the expert count(s) {bad} of the MoE layers; "
                f"every MoE layer's --num-experts must be a multiple of the expert-parallel size"
            )
        return p

    def build_mesh(self, device_type: str) -> dict | None:
        """1-D `DeviceMesh`es by purpose — "ep", "edp" and "dp" (their flattening) — cut from one `(edp, ep)`
        mesh; None in a single process, where nothing is sharded."""
        if self.world_size == 1:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, (self.edp, self.ep), mesh_dim_names=("edp", "ep"))
        return {"edp": mesh["edp"], "ep": mesh["ep"], "dp": mesh._flatten("dp")}

"""Parallel degrees and every rank's coordinates: checked before any process group exists, then one mesh.

`world = pp · dp · cp · tp`. Ranks are laid out as Megatron does: tensor-parallel peers are neighbours, then
context parallelism, then data parallelism, then pipeline stages (the dense mesh `(pp, dp, cp, tp)` in row-major
order; Megatron-LM's world 16, tp 2, pp 4 gives TP [0, 1], [2, 3], …; PP [0, 4, 8, 12], …; DP [0, 2], [1, 3],
[4, 6], …). Context-parallel peers hold different parts of the same sequences and identical weights, so for the
gradients they are data-parallel replicas too: dense gradients are averaged over `dp_cp` (the dp × cp ranks of one
TP index, Megatron's "data-parallel group with context parallelism"), and experts fold over dp × cp.

Experts are laid out over the same ranks of each pipeline stage as the expert mesh `(pp, edp, ep, etp)`, with
`edp · ep · etp = dp · cp · tp` (below, dp stands for dp · cp when context parallelism is on):
  etp = tp   experts split by tensor parallelism like the dense MLP; expert parallelism is drawn from the
             data-parallel ranks (`dp % ep == 0`), DeepSpeed's layout: world 16, tp 2, ep 4 → EP [0, 2, 4, 6],
             EDP [0, 8]; with tp = 1 it is DeepSpeed's default "E+D" (EP [0, 1], [2, 3], …; EDP {0, 2, 4, …}).
  etp = 1    Megatron-Core's MoE parallel folding: experts are not split by TP and expert parallelism may span
             the tensor-parallel ranks (`(dp · tp) % ep == 0`), so two GPUs can run TP = 2 for attention while the
             experts run EP = 2 (EP [0, 1] = the TP group).
With tp = 1 both are the same layout. `ParallelDims` is pure arithmetic (`groups`, `coordinates` need no
process group); `ParallelMesh.build` (parallel/mesh.py) turns it into DeviceMeshes, and is the only source of a rank's
coordinates and groups: the loader's data-parallel rank, metric reductions, expert placement and the
checkpoint all read them from there, never from the global rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

DENSE_DIMS = ("pp", "dp", "cp", "tp")
# Flattened dimensions: the ranks that are replicas for the dense gradients (data- and context-parallel peers)
FLATTENED_DIMS = {"dp_cp": ("dp", "cp")}
EXPERT_DIMS = ("pp", "edp", "ep", "etp")


@dataclass(frozen=True)
class Coordinates:
    """One rank's position along every dimension (all 0 in a single process)."""

    pp: int = 0
    dp: int = 0
    tp: int = 0
    edp: int = 0
    ep: int = 0
    etp: int = 0
    cp: int = 0


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    dp: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1  # expert tensor parallelism: 1 (folding) or tp
    sequence_parallel: bool = False  # norms and dropout on sequence shards between the TP regions (needs tp > 1)
    cp: int = 1  # context parallelism: each rank holds 1/cp of every sequence (two zigzag chunks)

    @property
    def sp(self) -> bool:
        """Sequence parallelism is on (Megatron ignores --sequence-parallel without tensor parallelism)."""
        return self.sequence_parallel and self.tp > 1

    @property
    def dense_replicas(self) -> int:
        """Ranks of one pipeline stage and TP index that hold the same dense weights and average their gradients:
        dp × cp (context-parallel peers hold other tokens of the same samples), the `dp_cp` group."""
        return self.dp * self.cp

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: replicas of each expert shard within a pipeline stage."""
        return (self.dp * self.cp * self.tp) // (self.ep * self.etp) if self.ep * self.etp else 0

    @property
    def sizes(self) -> dict[str, int]:
        return {"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp, "edp": self.edp, "ep": self.ep,
                "etp": self.etp, "dp_cp": self.dp * self.cp}  # fmt: skip

    # ---------------------------------------------------------------- validation
    def problems(self, experts_per_layer: Sequence[int] | None = None) -> list[str]:
        """Every problem with the degrees (and, given the experts of every layer, with the MoE layers), each with
        its fix."""
        p: list[str] = []
        flags = {
            "tp": "--tensor-model-parallel-size",
            "pp": "--pipeline-model-parallel-size",
            "ep": "--moe-expert-parallel-size",
            "etp": "--expert-tensor-parallel-size",
            "cp": "--context-parallel-size",
        }
        for name, flag in flags.items():
            value = getattr(self, name)
            if value < 1:
                p.append(f"{flag} must be >= 1, got {value}")
        if min(self.tp, self.pp, self.ep, self.etp, self.cp) < 1:
            return p
        if self.world_size % (self.tp * self.pp * self.cp):
            cp = f" × --context-parallel-size {self.cp}" if self.cp > 1 else ""
            p.append(
                f"world size {self.world_size} is not divisible by --tensor-model-parallel-size {self.tp} × "
                f"--pipeline-model-parallel-size {self.pp}{cp}; change the process count or the degrees"
            )
        if experts_per_layer is not None and not any(e > 1 for e in experts_per_layer):
            return p + self._no_moe_problems()
        return p + self._expert_layout_problems(experts_per_layer or ())

    def _no_moe_problems(self) -> list[str]:
        """Expert degrees on a model without MoE layers would split nothing: refused rather than ignored."""
        p = []
        for flag, value in (("--moe-expert-parallel-size", self.ep), ("--expert-tensor-parallel-size", self.etp)):
            if value > 1:
                p.append(
                    f"{flag} {value} has no effect: no layer is MoE (every layer has 1 expert); drop {flag}, or "
                    f"make layers MoE with --num-experts N (N >= 2) and --expert-interval"
                )
        return p

    def _expert_layout_problems(self, experts_per_layer: Sequence[int]) -> list[str]:
        p = []
        if self.etp not in (1, self.tp):
            p.append(
                f"--expert-tensor-parallel-size {self.etp} must be 1 (experts not split by TP) or equal "
                f"--tensor-model-parallel-size {self.tp}"
            )
        elif self.etp == self.tp and self.tp > 1 and (self.dp * self.cp) % self.ep:
            replicas = self.dp * self.cp
            p.append(
                f"data-parallel size {replicas} is not divisible by --moe-expert-parallel-size {self.ep}; with "
                f"--expert-tensor-parallel-size {self.etp} experts are sharded over data-parallel ranks, so use a "
                f"divisor of {replicas} (or --expert-tensor-parallel-size 1 to let EP span TP ranks)"
            )
        elif (self.dp * self.cp * self.tp) % (self.ep * self.etp):
            span = "data-parallel" if self.cp == 1 else "data- × context-parallel"
            span = span if self.tp == 1 else span.replace("-parallel", "-") + " × tensor-parallel"
            size = self.dp * self.cp * self.tp
            # the easy fix named as a flag: the largest EP that divides these ranks and every layer's experts
            fits = math.gcd(size, *(e for e in experts_per_layer if e > 1))
            stages = f" (world size {self.world_size} over {self.pp} pipeline stages)" if self.pp > 1 else ""
            p.append(
                f"{span} size {size}{stages} is not divisible by --moe-expert-parallel-size {self.ep}; experts "
                f"are sharded over those ranks: pass --moe-expert-parallel-size {fits}"
                + (" (every rank holds all experts)" if fits == 1 else f" (a divisor of {size})")
            )
        bad = sorted({e for e in experts_per_layer if e > 1 and e % self.ep})
        if bad:
            p.append(
                f"--moe-expert-parallel-size {self.ep} does not divide the expert count(s) {bad} of the MoE layers; "
                f"every MoE layer's --num-experts must be a multiple of the expert-parallel size"
            )
        return p

    # ---------------------------------------------------------------- coordinates (pure arithmetic)
    def coordinates(self, rank: int) -> Coordinates:
        stage_size = self.dp * self.cp * self.tp
        pp, in_stage = divmod(rank, stage_size)
        dp, in_replica = divmod(in_stage, self.cp * self.tp)
        cp, tp = divmod(in_replica, self.tp)
        edp, rest = divmod(in_stage, self.ep * self.etp)
        ep, etp = divmod(rest, self.etp)
        return Coordinates(pp=pp, dp=dp, tp=tp, edp=edp, ep=ep, etp=etp, cp=cp)

    def rank_of(self, **coords: int) -> int:
        """The global rank at the given dense (pp, dp, cp, tp) or expert (pp, edp, ep, etp) coordinates."""
        if set(coords) <= set(DENSE_DIMS):
            c = {d: coords.get(d, 0) for d in DENSE_DIMS}
            return ((c["pp"] * self.dp + c["dp"]) * self.cp + c["cp"]) * self.tp + c["tp"]
        c = {d: coords.get(d, 0) for d in EXPERT_DIMS}
        return c["pp"] * self.dp * self.cp * self.tp + (c["edp"] * self.ep + c["ep"]) * self.etp + c["etp"]

    def groups(self, name: str) -> list[list[int]]:
        """Every group of dimension `name` ("pp", "dp", "cp", "tp", "edp", "ep", "etp", or "dp_cp": the dp × cp
        ranks of one pipeline stage and TP index), as sorted rank lists."""
        spans = FLATTENED_DIMS.get(name, (name,))
        dims = DENSE_DIMS if set(spans) <= set(DENSE_DIMS) else EXPERT_DIMS
        if not set(spans) <= set(dims):
            raise ValueError(f"unknown parallel dimension {name!r}; one of {DENSE_DIMS + EXPERT_DIMS}")
        out: dict[tuple, list[int]] = {}
        for rank in range(self.world_size):
            c = self.coordinates(rank)
            key = tuple(getattr(c, d) for d in dims if d not in spans)
            out.setdefault(key, []).append(rank)
        return sorted(out.values())

    def mesh_shape(self, dims: tuple[str, ...]) -> tuple[int, ...]:
        return tuple(self.sizes[d] for d in dims)


def runnable_expert_parallel(ep: int, replicas: int, expert_counts: Sequence[int]) -> int:
    """`ep` where it divides `replicas` (the data- × context-parallel ranks the experts fold over) and every MoE
    layer's expert count; else the largest size that does, at most `ep` (a recipe's EP 64 on 2 GPUs runs EP 2)."""
    if ep < 1 or (replicas % ep == 0 and all(e % ep == 0 for e in expert_counts)):
        return ep
    limit = math.gcd(replicas, *expert_counts)
    return max(d for d in range(1, min(ep, limit) + 1) if limit % d == 0)

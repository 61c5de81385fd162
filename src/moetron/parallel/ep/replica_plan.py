"""Which hot experts to copy onto which expert-parallel ranks this step, and which rows each copy computes.

    plan = plan_replicas(counts_RE, slots_per_rank=1)   # counts_RE: routes each rank sends to each global expert
    plan.load_routed_R, plan.load_computed_R           # rows each rank computes without / with the replicas
    owner_RE, replica_RJ = plan.rows_by_destination(counts_RE)

Every value is a device tensor derived from `counts_RE` alone, which every rank of the EP group holds after the
dispatcher's all-gather of the counts: every rank computes the same plan with no host read and no further
collective. The greedy loop (a fixed R·K iterations of small device ops) moves, each time, part of the hottest
rank's hottest own expert to the least loaded rank that still has a free replica slot: as many rows as bring
either rank to the mean load (water-filling: never past it), or all of that expert's remaining rows if fewer.
Ties go to the lowest index (`argmax` / `argmin` return the first extreme), so the decision is deterministic.

Rows of expert e are ordered by source rank (source 0's rows, then source 1's, ...). The owner computes the first
`owner_keep_E[e]` of them; replica slot j (of expert `slot_expert_J[j]`) the range [slot_start_J, slot_end_J)
after those. An unused slot holds its own rank's first expert with an empty range (its weights still travel: the
weight exchange has static shapes).

Shape legend: R ranks of the EP group, E global experts, L = E / R local experts, K replica slots per rank,
J = R·K replica slots (rank-major: slot j lives on rank j // K).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ReplicaPlan:
    slots_per_rank: int
    owner_keep_E: torch.Tensor  # int64 [E]: rows of expert e its owner computes
    slot_expert_J: torch.Tensor  # int64 [J]: the global expert replica slot j holds
    slot_start_J: torch.Tensor  # int64 [J]: first row (in expert order) the slot computes
    slot_end_J: torch.Tensor  # int64 [J]: one past its last row
    load_routed_R: torch.Tensor  # int64 [R]: rows routed to each rank's own experts
    load_computed_R: torch.Tensor  # int64 [R]: rows each rank computes, replicas included

    def rows_by_destination(self, counts_RE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(owner_RE, replica_RJ): rows source rank s sends to the owner of expert e, and to replica slot j."""
        start_RE = torch.cumsum(counts_RE, 0) - counts_RE  # where source s's rows begin in expert e's order
        end_RE = start_RE + counts_RE
        owner_RE = (torch.minimum(end_RE, self.owner_keep_E) - start_RE).clamp_min(0)
        start_RJ, end_RJ = start_RE[:, self.slot_expert_J], end_RE[:, self.slot_expert_J]
        overlap_RJ = torch.minimum(end_RJ, self.slot_end_J) - torch.maximum(start_RJ, self.slot_start_J)
        return owner_RE, overlap_RJ.clamp_min(0)


def plan_replicas(counts_RE: torch.Tensor, slots_per_rank: int) -> ReplicaPlan:
    """The replica plan for one layer and one forward (see the module docstring); all on `counts_RE`'s device."""
    num_ranks, num_experts = counts_RE.shape
    num_local, device = num_experts // num_ranks, counts_RE.device
    num_slots = num_ranks * slots_per_rank
    keep_E = counts_RE.sum(0)
    routed_R = owner_load(counts_RE)
    load_R = routed_R.clone()
    mean = routed_R.sum() // num_ranks
    owner_E = torch.arange(num_experts, device=device) // num_local
    ranks_R = torch.arange(num_ranks, device=device)
    slot_expert_J = (torch.arange(num_slots, device=device) // slots_per_rank) * num_local
    slot_rows_J = torch.zeros(num_slots, dtype=torch.int64, device=device)
    used_R = torch.zeros(num_ranks, dtype=torch.int64, device=device)
    unreachable = torch.iinfo(torch.int64).max
    for _ in range(num_slots):
        hot = torch.argmax(load_R)
        expert = torch.argmax(torch.where(owner_E == hot, keep_E, -1))
        free_R = (used_R < slots_per_rank) & (ranks_R != hot)
        target = torch.argmin(torch.where(free_R, load_R, unreachable))
        # water-filling: neither rank crosses the mean, so later slots still find work above it
        room = torch.minimum(load_R[hot] - mean, mean - load_R[target])
        moved = torch.where(free_R.any(), torch.minimum(keep_E[expert], room), 0).clamp_min(0)
        slot = target * slots_per_rank + used_R[target].clamp_max(slots_per_rank - 1)
        taken = moved > 0
        slot_expert_J.index_put_((slot,), torch.where(taken, expert, slot_expert_J[slot]))
        slot_rows_J.index_put_((slot,), torch.where(taken, moved, slot_rows_J[slot]))
        keep_E.index_put_((expert,), -moved, accumulate=True)
        load_R.index_put_((hot,), -moved, accumulate=True)
        load_R.index_put_((target,), moved, accumulate=True)
        used_R.index_put_((target,), taken.long(), accumulate=True)
    # slot j's range starts after the owner's rows and the earlier slots of the same expert
    # [J, E] (a comparison, not one_hot: CUDA's one_hot reads the ids' range back to the host)
    same_J = (slot_expert_J[:, None] == torch.arange(num_experts, device=device)) * slot_rows_J[:, None]
    before_J = (torch.cumsum(same_J, 0) - same_J).gather(1, slot_expert_J[:, None]).squeeze(1)
    start_J = keep_E[slot_expert_J] + before_J
    return ReplicaPlan(slots_per_rank, keep_E, slot_expert_J, start_J, start_J + slot_rows_J, routed_R, load_R)


def owner_load(counts_RE: torch.Tensor) -> torch.Tensor:
    """load_R: rows routed to each rank's own experts (what it computes when nothing is replicated)."""
    return counts_RE.sum(0).view(counts_RE.shape[0], -1).sum(1)


def max_over_mean(load_R: torch.Tensor) -> torch.Tensor:
    """The busiest rank's rows over the mean (fp32, on device; 0 when nothing was routed)."""
    load_R = load_R.float()
    return load_R.max() / load_R.mean().clamp_min(1e-9)

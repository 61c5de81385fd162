"""Routing statistics of MoE layers as one device tensor read by name: what the metrics log every interval.

    stats = MoEStats.measure(tokens_per_expert_E, dropped_routes, routes, aux_loss, z_loss, ep_load)  # one layer: [6]
    stack = MoEStats.stack([layer_a, layer_b])       # [L_moe, 6]
    stack.load_max_over_mean, stack.dropped_fraction  # [L_moe] each, still on device

    record = MoEStepRecord.attached_to(model.moe_layers())  # the executor's: training forwards report into it
    record.reset()                                    # a step starts
    ... the step's forwards and backwards ...
    record.step_stats(model.moe_layers())             # MoEStats [L_moe]: each layer's mean over the step's forwards
    record.routing_2E[layer_index]                    # routes per expert, mean router probabilities: summed

The values stay ONE fp32 tensor (not four scalars or a dict) so that summing over forwards, the mean over a step
and the pipeline's all-reduce are single device ops with no host sync; the names replace the positions
(`stats[:, 2]`) that the layer, the metrics and the pipeline executor used to share.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

FIELDS = ("load_max_over_mean", "dropped_fraction", "aux_loss", "z_loss", "ep_load_routed", "ep_load_computed")


def load_max_over_mean(load_E: torch.Tensor) -> torch.Tensor:
    """The most loaded expert's load over the mean load (1.0 = perfectly balanced; 0 when nothing was routed).
    A device tensor of `load_E`'s floating dtype (pass `.float()` or `.double()` counts)."""
    return load_E.max() / load_E.mean().clamp_min(1e-9)


class MoEStats:
    """`values` [..., 6] (fp32, on device): per layer the expert load max/mean (routes before dropping), the
    dropped fraction of all routes, the aux loss and the z-loss (without their coefficients), and the rows per
    expert-parallel rank max/mean: routed (by the experts' owners) and computed (after `--moe-expert-replicas`;
    both 1.0 without expert parallelism, where one rank computes everything)."""

    WIDTH = len(FIELDS)
    __slots__ = ("values",)

    def __init__(self, values: torch.Tensor):
        if values.shape[-1] != self.WIDTH:
            raise ValueError(
                f"MoE statistics have {self.WIDTH} values per layer ({', '.join(FIELDS)}), not {values.shape[-1]}"
            )
        self.values = values

    @classmethod
    def measure(
        cls,
        tokens_per_expert_E: torch.Tensor,
        dropped_routes: torch.Tensor,
        routes: int,
        aux_loss: torch.Tensor,
        z_loss: torch.Tensor,
        ep_load: torch.Tensor | None = None,
    ) -> MoEStats:
        """One layer's statistics of one forward (detached); `routes` = T·K, the routes before dropping;
        `ep_load` [2] the routed and computed EP load (None: no expert parallelism, 1.0 each)."""
        load = load_max_over_mean(tokens_per_expert_E.float())
        dropped = dropped_routes.float() / max(routes, 1)
        if ep_load is None:
            ep_load = torch.ones(2, device=load.device)
        losses = [aux_loss.detach().float(), z_loss.detach().float()]
        return cls(torch.cat([torch.stack([load, dropped, *losses]), ep_load.detach().float()]).detach())

    @classmethod
    def zeros(cls, device: torch.device | str, dtype: torch.dtype = torch.float32) -> MoEStats:
        """One layer's statistics when it ran no training forward."""
        return cls(torch.zeros(cls.WIDTH, dtype=dtype, device=device))

    @classmethod
    def stack(cls, rows: list[MoEStats]) -> MoEStats:
        """[L_moe, 6] from one row per layer, in layer order."""
        return cls(torch.stack([row.values for row in rows]))

    @classmethod
    def from_flat(cls, flat: torch.Tensor) -> MoEStats:
        """The stack back from `values.flatten()` (e.g. after an all-reduce of several layers' rows)."""
        return cls(flat.view(-1, cls.WIDTH))

    def rows(self) -> list[MoEStats]:
        """One `MoEStats` per layer of a stack."""
        return [MoEStats(row) for row in self.values]

    def __add__(self, other: MoEStats) -> MoEStats:
        return MoEStats(self.values + other.values)

    def __truediv__(self, count: float) -> MoEStats:
        return MoEStats(self.values / count)

    def to(self, dtype: torch.dtype) -> MoEStats:
        return MoEStats(self.values.to(dtype))

    @property
    def load_max_over_mean(self) -> torch.Tensor:
        return self.values[..., 0]

    @property
    def dropped_fraction(self) -> torch.Tensor:
        return self.values[..., 1]

    @property
    def aux_loss(self) -> torch.Tensor:
        return self.values[..., 2]

    @property
    def z_loss(self) -> torch.Tensor:
        return self.values[..., 3]

    @property
    def ep_load_routed(self) -> torch.Tensor:
        return self.values[..., 4]

    @property
    def ep_load_computed(self) -> torch.Tensor:
        return self.values[..., 5]

    def moe_loss(self, moe_loss_coeff: float, z_coeff: float) -> torch.Tensor:
        """Σ over layers of moe_loss_coeff · aux loss + z_coeff · z-loss (fp64 scalar, on device)."""
        return (moe_loss_coeff * self.aux_loss + z_coeff * self.z_loss).double().sum()


class MoEStepRecord:
    """What the MoE layers report of one optimizer step's training forwards, summed per layer (by `layer_index`)
    on device: no host sync. The executor owns it; a layer given it (`MoELayer.step_record`) adds one report per
    training forward, none when activation checkpointing recomputes the forward and none in evaluation."""

    def __init__(self) -> None:
        self.stats: dict[int, MoEStats] = {}  # Σ over the step's forwards
        self.forwards: dict[int, int] = {}
        self.routing_2E: dict[int, torch.Tensor] = {}  # Σ: routes per expert (before dropping), mean router probs

    @classmethod
    def attached_to(cls, moe_layers: Sequence[nn.Module]) -> MoEStepRecord:
        record = cls()
        for layer in moe_layers:
            layer.step_record = record
        return record

    def reset(self) -> None:
        """Forget the reports so far (a step starts, or an attempt of it is discarded)."""
        self.stats.clear()
        self.forwards.clear()
        self.routing_2E.clear()

    def add(self, layer_index: int, stats: MoEStats, routing_2E: torch.Tensor) -> None:
        if layer_index in self.stats:
            stats, routing_2E = self.stats[layer_index] + stats, self.routing_2E[layer_index] + routing_2E
        self.stats[layer_index], self.routing_2E[layer_index] = stats, routing_2E
        self.forwards[layer_index] = self.forwards.get(layer_index, 0) + 1

    def layer_report(self, layer_index: int) -> tuple | None:
        """What layer `layer_index` has reported so far this step (to put back with `restore_layer_report`)."""
        if layer_index not in self.stats:
            return None
        return self.stats[layer_index], self.forwards[layer_index], self.routing_2E[layer_index]

    def restore_layer_report(self, layer_index: int, report: tuple | None) -> None:
        """Layer `layer_index`'s reports as `layer_report` returned them: later ones (a recompute's) dropped."""
        if report is None:
            for reports in (self.stats, self.forwards, self.routing_2E):
                reports.pop(layer_index, None)
            return
        self.stats[layer_index], self.forwards[layer_index], self.routing_2E[layer_index] = report

    def step_stats(self, moe_layers: Sequence[nn.Module]) -> MoEStats | None:
        """[L_moe] each layer's mean `MoEStats` over the step's training forwards (zeros for a layer that ran none),
        still on device; None without MoE layers."""
        rows = []
        for moe in moe_layers:
            count = self.forwards.get(moe.layer_index, 0)
            rows.append(self.stats[moe.layer_index] / count if count else MoEStats.zeros(moe.router.weight.device))
        return MoEStats.stack(rows) if rows else None

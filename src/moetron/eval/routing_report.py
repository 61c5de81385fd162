"""The routing report: how a checkpoint's MoE layers spread tokens over their experts on evaluation data.

    recorder = RoutingRecorder(model)          # wraps the model; pass it wherever the model would go
    evaluate(recorder, loader, iters)           # every forward pass's MoEAux is accumulated
    report = recorder.report()                  # one LayerReport per MoE layer
    print(format_table(report))

Per MoE layer, summed over every evaluated micro-batch: routes per expert (before capacity dropping; they
add up to T·k, every token's k choices), routes kept per expert, and from those the load max/mean and
coefficient of variation (std/mean; 0 = perfectly even), the fraction of routes dropped by capacity, the
mean router entropy per token (nats; log E = a uniform router), the dead experts (no route at all) and the
mean aux (load-balancing) loss, before moe_loss_coeff; and, for the run's expert-parallel size, the rows per EP
rank max/mean of each evaluated micro-batch (mean over them): routed (by the experts' owners) and computed (after
the run's `--moe-expert-replicas`, planned as in training from the kept routes per expert; 1.0 without EP).

Shape legend: E experts of a layer.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from moetron.model.moe.stats import load_max_over_mean
from moetron.parallel.ep.replica_plan import max_over_mean, owner_load, plan_replicas


@dataclass
class LayerReport:
    layer: int  # 0-based transformer layer index
    num_experts: int
    topk: int
    tokens: int  # tokens routed (T over all micro-batches)
    tokens_per_expert: list[int]  # routes per expert before dropping; sums to tokens · topk
    kept_per_expert: list[int]  # routes per expert the experts computed
    load_max_over_mean: float
    load_cv: float
    dropped_fraction: float
    entropy: float  # mean per token, nats
    max_entropy: float  # log E
    dead_experts: list[int]
    aux_loss: float  # mean over micro-batches, before moe_loss_coeff
    ep_load_routed: float = 1.0  # rows per EP rank max/mean by owner (mean over micro-batches)
    ep_load_computed: float = 1.0  # the same after the run's --moe-expert-replicas

    def to_dict(self) -> dict:
        return asdict(self)


class _LayerSums:
    """Running sums of one MoE layer (device tensors; read once at the end)."""

    def __init__(self, layer: int, num_experts: int, ep: int = 1, replicas: int = 0):
        self.layer, self.num_experts = layer, num_experts
        self.ep = ep if ep > 1 and num_experts % ep == 0 else 1
        self.replicas = replicas
        self.ep_load_sum = [0.0, 0.0]  # routed, computed
        self.routes_E = torch.zeros(num_experts, dtype=torch.int64)
        self.kept_E = torch.zeros(num_experts, dtype=torch.int64)
        self.tokens = 0
        self.topk = 0
        self.entropy_sum = 0.0  # over tokens
        self.aux_sum = 0.0
        self.passes = 0

    def add(self, aux) -> None:
        routing = aux.routing
        stats = routing.stats()
        self.routes_E += routing.tokens_per_expert_E.detach().cpu().long()
        self.kept_E += routing.kept_tokens_per_expert().cpu()
        self.tokens += routing.num_tokens
        self.topk = routing.topk
        if "entropy" in stats:
            self.entropy_sum += float(stats["entropy"]) * routing.num_tokens
        self.aux_sum += float(aux.aux_loss)
        self.passes += 1
        routed, computed = self.ep_loads(routing.kept_tokens_per_expert().cpu())
        self.ep_load_sum = [self.ep_load_sum[0] + routed, self.ep_load_sum[1] + computed]

    def ep_loads(self, kept_E: torch.Tensor) -> tuple[float, float]:
        """(routed, computed) rows per EP rank max/mean of one forward's kept routes (1.0 each without EP)."""
        if self.ep == 1:
            return 1.0, 1.0
        counts_RE = torch.zeros(self.ep, self.num_experts, dtype=torch.int64)
        counts_RE[0] = kept_E.long()  # the loads depend on each expert's total only, not on which rank sent it
        routed = float(max_over_mean(owner_load(counts_RE)))
        if not self.replicas:
            return routed, routed
        return routed, float(max_over_mean(plan_replicas(counts_RE, self.replicas).load_computed_R))

    def report(self) -> LayerReport:
        load_E = self.routes_E.double()
        mean = float(load_E.mean())
        routes = max(self.tokens * self.topk, 1)
        return LayerReport(
            layer=self.layer,
            num_experts=self.num_experts,
            topk=self.topk,
            tokens=self.tokens,
            tokens_per_expert=self.routes_E.tolist(),
            kept_per_expert=self.kept_E.tolist(),
            load_max_over_mean=float(load_max_over_mean(load_E)),
            load_cv=float(load_E.std(unbiased=False)) / mean if mean else 0.0,
            dropped_fraction=1.0 - float(self.kept_E.sum()) / routes,
            entropy=self.entropy_sum / max(self.tokens, 1),
            max_entropy=math.log(self.num_experts),
            dead_experts=[e for e, n in enumerate(self.routes_E.tolist()) if n == 0],
            aux_loss=self.aux_sum / max(self.passes, 1),
            ep_load_routed=self.ep_load_sum[0] / self.passes if self.passes else 1.0,
            ep_load_computed=self.ep_load_sum[1] / self.passes if self.passes else 1.0,
        )


class RoutingRecorder(nn.Module):
    """The model, plus a record of every forward pass's routing (it owns the model as a submodule, so
    `.eval()`, `.parameters()` and the like reach it unchanged). `ep` and `replicas`: the run's expert-parallel
    size and `--moe-expert-replicas`, for the EP load columns."""

    def __init__(self, model: nn.Module, ep: int = 1, replicas: int = 0):
        super().__init__()
        self.model = model
        layers = [(i, layer.mlp.num_experts) for i, layer in model.layer_items() if layer.is_moe]
        self.sums = [_LayerSums(i, e, ep, replicas) for i, e in layers]

    def forward(self, *args, **kwargs):
        out = self.model(*args, **kwargs)
        for sums, aux in zip(self.sums, out.moe_aux, strict=True):
            sums.add(aux)
        return out

    def report(self) -> list[LayerReport]:
        return [s.report() for s in self.sums]


def format_table(report: list[LayerReport]) -> str:
    """The report as a console table, one row per MoE layer, a line on reading CV, entropy and the aux loss each,
    then the tokens per expert of each layer."""
    if not report:
        return "routing report: the model has no MoE layer"
    header = (
        f"{'layer':>5} {'experts':>7} {'routes':>9} {'max/mean':>8} {'CV':>6} {'dropped':>8} "
        f"{'entropy':>14} {'dead':>5} {'aux loss':>9} {'EP load routed→computed':>24}"
    )
    lines = ["routing report (evaluation data)", header]
    for r in report:
        entropy = f"{r.entropy:.3f}/{r.max_entropy:.3f}"
        lines.append(
            f"{r.layer:>5} {r.num_experts:>7} {r.tokens * r.topk:>9} {r.load_max_over_mean:>8.3f} {r.load_cv:>6.3f} "
            f"{r.dropped_fraction:>8.2%} {entropy:>14} {len(r.dead_experts):>5} {r.aux_loss:>9.4f} "
            f"{f'{r.ep_load_routed:.3f}→{r.ep_load_computed:.3f}':>24}"
        )
    lines += legend(report)
    lines.append("routes per expert (before dropping):")
    for r in report:
        dead = f"  dead: {r.dead_experts}" if r.dead_experts else ""
        lines.append(f"  layer {r.layer}: {' '.join(str(n) for n in r.tokens_per_expert)}{dead}")
    return "\n".join(lines)


def legend(report: list[LayerReport]) -> list[str]:
    """One line each for the three columns a newcomer cannot read off the numbers: what 0 / 1 / the maximum mean."""
    experts = "/".join(str(e) for e in sorted({r.num_experts for r in report}))
    spread = "/".join(f"{math.sqrt(e - 1):.2f}" for e in sorted({r.num_experts for r in report}))
    return [
        f"  CV        std/mean of the routes per expert: 0 = perfectly even, {spread} = all on one of the {experts}",
        "  entropy   of the router's probabilities per token, nats, / its most, log E (a uniform router): near "
        "log E = no preference yet; low = confident (whether the choices spread: max/mean, CV)",
        "  aux loss  the load-balancing loss before --moe-loss-coeff, E·Σ mean probability × route fraction: 1.0 = "
        "balanced, E = one expert takes everything",
    ]

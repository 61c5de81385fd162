"""`moetron plan --routing-from RUN_DIR`: size the hottest expert-parallel rank with a run's measured routing.

    routing = read_routing(run_dir)                    # the run's routes per expert of each MoE layer
    plan, used = hottest_rank_plan(plan, routing)      # the plan with the hottest EP rank's memory and step time
    print(used.line())                                 # which run, which iteration, what imbalance

Without it the plan assumes balanced routing: every EP rank's experts compute T·k rows per micro-batch. A real
router is not balanced, above all early in training, and the rank owning the hot experts computes more rows, holds
more expert activations and all-to-all receive rows, and is the one every other rank waits for. The trainer writes
the last log interval's routes per expert of each MoE layer to `routing_counts.json` in its run directory
(train/routing_health.py; whenever a routing-health alarm is on, as by default). From those counts, for the
*planned* expert-parallel size and `--moe-expert-replicas` (which may differ from the run's), the rows per EP rank
are computed as training computes them (parallel/ep/replica_plan.py: by the experts' owners, then after the replica
plan), and each MoE layer's factor f = busiest rank's rows / mean rows scales that layer's routed rows:

- memory (dropless routing): the hot rank's expert activations of the layer grow by (f - 1) × its balanced routed
  rows × the bytes one routed row saves, and its all-to-all buffers receive f × the rows it sends. With capacity
  routing (`--moe-token-dropping`) and EP > 1 the plan already holds every rank at the capacity bound (E ×
  capacity rows), which no routing exceeds: the memory is unchanged and the plan says so.
- time: the step waits for the hottest rank, so the routed experts' share s of the FLOPs per token takes f times
  as long: step time × (1 + s × (f̄ - 1)), f̄ the mean factor over the MoE layers (capped by the capacity bound).

Shape legend: E experts of a layer, R ranks of the EP group.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from moetron.config import RunConfig
from moetron.errors import UserError
from moetron.model.flops import count_parameters
from moetron.parallel.ep.replica_plan import max_over_mean, owner_load, plan_replicas
from moetron.parallel.tp.memory import activation_split
from moetron.plan.estimate import Plan
from moetron.plan.memory_terms import (
    assemble,
    compute_bytes,
    expert_activation_bytes,
    layer_bytes,
    local_parameters,
    rank_view,
    routed_rows,
)
from moetron.train.routing_health import ROUTING_COUNTS_FILE

COUNT_SCALE = 1000  # the saved counts are means over ranks (floats); the replica plan works on integer rows


@dataclass
class MeasuredRouting:
    run_dir: str
    iteration: int
    run_ep: int
    run_replicas: int
    routes_per_layer: list[list[float]]  # per MoE layer: routes per expert (before dropping)


@dataclass
class HotRank:
    """What the plan used: the run, and per MoE layer the busiest EP rank's rows over the mean."""

    run_dir: str
    iteration: int
    ep: int
    replicas: int
    routed: list[float]  # by the experts' owners
    computed: list[float]  # after the planned replicas (= routed without them)
    capacity_bound: bool  # capacity routing: the memory is already planned at the bound
    balanced_peak: int
    balanced_step_s: float

    def line(self) -> str:
        computed = f", {max(self.computed):.3f} computed with --moe-expert-replicas {self.replicas}"
        memory = (
            "memory already at the capacity bound (--moe-token-dropping)"
            if self.capacity_bound
            else f"balanced routing would need {self.balanced_peak / 2**30:.2f} GiB"
        )
        return (
            f"routing from {self.run_dir} (iteration {self.iteration}): hottest EP rank of {self.ep} computes "
            f"{max(self.routed):.3f}× the mean rows routed{computed if self.replicas else ''} (max over MoE "
            f"layers); the plan below is that rank's ({memory}; step {self.balanced_step_s:.3g} s balanced)"
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def read_routing(run_dir: str) -> MeasuredRouting:
    """The routes per expert a run saved (`routing_counts.json`); UserError, one line, when it has none."""
    path = Path(run_dir) / ROUTING_COUNTS_FILE
    if not path.is_file():
        where = "is not a directory" if not Path(run_dir).is_dir() else f"has no {ROUTING_COUNTS_FILE}"
        raise UserError(
            f"--routing-from {run_dir} {where}: pass the run directory of a MoE training run that logged at least "
            f"one interval with a routing-health alarm on (the default --moe-dead-expert-steps 100 is)"
        )
    try:
        record = json.loads(path.read_text())
        layers = [[float(v) for v in layer["routes_per_expert"]] for layer in record["layers"]]
        return MeasuredRouting(
            run_dir, int(record["iteration"]), int(record["expert_parallel_size"]),
            int(record["expert_replicas"]), layers,
        )  # fmt: skip
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"--routing-from {run_dir}: {path} is not a routing-counts file ({e}); rerun training") from e


def rank_load_factors(routes_E: list[float], ep: int, replicas: int) -> tuple[float, float]:
    """(routed, computed): the busiest of `ep` ranks' rows over the mean, by the experts' owners and after the
    replica plan training would make (`replicas` slots per rank) for these counts."""
    if ep <= 1:
        return 1.0, 1.0
    counts_RE = torch.zeros(ep, len(routes_E), dtype=torch.int64)
    counts_RE[0] = torch.tensor([round(v * COUNT_SCALE) for v in routes_E])  # the loads depend on the totals only
    routed = float(max_over_mean(owner_load(counts_RE)))
    if not replicas:
        return routed, routed
    return routed, float(max_over_mean(plan_replicas(counts_RE, replicas).load_computed_R))


def routing_problems(cfg: RunConfig, routing: MeasuredRouting, pp: int) -> list[str]:
    """Why the measured routing cannot size this plan (a different MoE model, a pipelined layout)."""
    planned = [e for e in cfg.model.experts_per_layer() if e > 1]
    measured = [len(r) for r in routing.routes_per_layer]
    flag = f"--routing-from {routing.run_dir}"
    if planned != measured:
        return [
            f"{flag}: the run's MoE layers have {measured or 'no'} experts, the planned config's {planned or 'no'}; "
            f"plan the run's model (its config.yaml)"
        ]
    if pp > 1:
        return [f"{flag} is not supported with --pipeline-model-parallel-size {pp} yet; plan without one of them"]
    return []


def hottest_rank_plan(plan: Plan, routing: MeasuredRouting) -> tuple[Plan, HotRank]:
    """`plan` re-sized for its hottest EP rank under the measured routing (see the module docstring)."""
    cfg, dims = plan.cfg, plan.dims
    problems = routing_problems(cfg, routing, dims.pp)
    if problems:
        raise UserError(problems[0])
    replicas = cfg.parallel.moe_expert_replicas
    factors = [rank_load_factors(r, dims.ep, replicas) for r in routing.routes_per_layer]
    computed = [c for _, c in factors]
    local = rank_view(cfg, dims)
    model, c, split = local.model, compute_bytes(cfg), activation_split(dims)
    tokens = cfg.train.micro_batch_size * model.seq_length
    capacity_bound = model.moe_token_dropping and dims.ep > 1
    moe = [e for e in model.experts_per_layer() if e > 1]
    memory = plan.memory
    if not capacity_bound and moe:
        extra = [
            round((f - 1) * routed_rows(model, e, tokens, dims.ep) * split.routes * row_bytes(model, e, tokens, c))
            for e, f in zip(moe, computed, strict=True)
        ]
        activations = memory.activations + activation_growth(local, dims, plan.device.kind, extra)
        a2a = max(
            round((1 + f) * routed_rows(model, e, tokens, dims.ep) * split.routes * model.hidden_size * c)
            for e, f in zip(moe, computed, strict=True)
        ) if dims.ep > 1 else memory.all_to_all  # fmt: skip
        memory = assemble(cfg, dims, local_parameters(cfg.model, dims), activations, memory.logits, a2a)
    time_factor = [min(f, capacity_ratio(model, e, tokens, dims.ep)) for e, f in zip(moe, computed, strict=True)]
    mean_factor = sum(time_factor) / len(time_factor) if time_factor else 1.0
    seconds = plan.step_time_s * (1 + expert_flops_share(plan) * (mean_factor - 1))
    used = HotRank(
        routing.run_dir, routing.iteration, dims.ep, replicas, [f for f, _ in factors], computed, capacity_bound,
        plan.needed_bytes, plan.step_time_s,
    )  # fmt: skip
    return dataclasses.replace(plan, memory=memory, step_time_s=seconds), used


def row_bytes(model, num_experts: int, tokens: int, c: int) -> float:
    """Bytes one routed row saves for backward in a MoE layer: the difference one more route per token makes to
    `expert_activation_bytes` (dropless, whole tensors), divided by the tokens — the planner's own formula."""
    dropless = dataclasses.replace(model, moe_token_dropping=False)
    more = dataclasses.replace(dropless, topk=model.topk + 1)
    diff = expert_activation_bytes(more, num_experts, tokens, c, 1) - expert_activation_bytes(
        dropless, num_experts, tokens, c, 1
    )
    return diff / tokens


def activation_growth(local: RunConfig, dims, device_kind: str, extra: list[int]) -> int:
    """How much the saved activations grow when MoE layer l saves `extra[l]` more bytes: all of it, or with
    activation checkpointing the growth of the largest recomputed layer (only one layer's are held at once)."""
    model = local.model
    if not model.checkpoint_activations:
        return sum(extra)
    seq, c, split = model.seq_length, compute_bytes(local), activation_split(dims)
    tokens = local.train.micro_batch_size * seq
    sizes = [layer_bytes(model, e, tokens, seq, c, device_kind, dims.ep, split) for e in model.experts_per_layer()]
    moe_index = [i for i, e in enumerate(model.experts_per_layer()) if e > 1]
    grown = list(sizes)
    for i, more in zip(moe_index, extra, strict=True):
        grown[i] += more
    return max(grown) - max(sizes)


def capacity_ratio(model, num_experts: int, tokens: int, ep: int) -> float:
    """The most a rank can compute over the balanced rows: unbounded dropless, E × capacity / (T·k) dropping."""
    if not model.moe_token_dropping:
        return math.inf
    return routed_rows(model, num_experts, tokens, max(ep, 2)) / (tokens * model.topk)


def expert_flops_share(plan: Plan) -> float:
    """The routed experts' share of the FLOPs per token: 6 × their active parameters over the total."""
    p = count_parameters(plan.cfg.model)
    active_experts = p.active - p.embedding - p.dense
    return min(max(6 * active_experts / plan.flops_per_token, 0.0), 1.0) if plan.flops_per_token else 0.0

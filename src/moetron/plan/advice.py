"""What would make a run fit: re-plan the config under candidate changes and keep the ones that fit.

Candidates, each a change a user can make with flags (the whole memory model is re-run on it):
  expert parallelism         every EP that divides each expert count and the data-parallel size
  tensor parallelism         TP 2, 4, 8 (with sequence parallelism) where it divides the GPUs and the model
                             (heads, ffn, vocabulary: parallel/tp/memory.py models what it saves)
  micro batch                halving down to 1, the global batch kept (more accumulation steps)
  activation checkpointing   when off
  bf16                       when training in fp32 (fp16 costs the same memory in moetron)
  ZeRO                       each stage above the current one (parallel/dp/memory.py)
  more GPUs                  ×2, ×4, ×8 with EP grown to match (data parallelism alone replicates everything)
  pipeline parallelism       every PP that divides the GPUs and the layers (batch kept; plan/stages.py)
If no single change fits, the strongest change of each kind is stacked in that order, and the first stack
that fits is offered.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass

from moetron.config import RunConfig
from moetron.errors import ConfigError
from moetron.parallel.dp.memory import stages_to_try
from moetron.plan.cost_model import network, priced
from moetron.plan.estimate import Plan, make_plan

GPU_FACTORS = (2, 4, 8)

Edit = Callable[[RunConfig], None]


@dataclass(frozen=True)
class Change:
    kind: str  # changes of one kind replace each other when stacked
    words: str  # in words, for the table
    flags: str  # what to add to the command line
    gpus: int  # the GPU count it plans for
    edit: Edit  # applied to a copy of the config


@dataclass
class Suggestion:
    change: str
    flags: str
    plan: Plan


def _set(section: str, name: str, value) -> Edit:
    def edit(cfg: RunConfig) -> None:
        setattr(getattr(cfg, section), name, value)

    return edit


def _chain(edits: list[Edit]) -> Edit:
    def edit(cfg: RunConfig) -> None:
        for one in edits:
            one(cfg)

    return edit


def larger_expert_parallel_sizes(cfg: RunConfig, dp: int) -> list[int]:
    """EP sizes above the current one that divide every expert count and the data-parallel size."""
    counts = [e for e in cfg.model.num_experts if e > 1]
    if not counts:
        return []
    limit = math.gcd(*counts, dp)
    return [ep for ep in range(cfg.parallel.moe_expert_parallel_size + 1, limit + 1) if limit % ep == 0]


def expert_parallel_changes(cfg: RunConfig, gpus: int) -> list[Change]:
    changes = []
    for ep in larger_expert_parallel_sizes(cfg, cfg.dims(gpus).dp):
        edit = _set("parallel", "moe_expert_parallel_size", ep)
        changes.append(Change("ep", f"expert parallel {ep}", f"--moe-expert-parallel-size {ep}", gpus, edit))
    return changes


def tensor_parallel_changes(cfg: RunConfig, gpus: int) -> list[Change]:
    """Larger TP sizes with sequence parallelism, the global batch kept (fewer data-parallel ranks accumulate more);
    a size the model cannot split is dropped by `_try` (its ConfigError)."""
    gbs, changes = cfg.global_batch(cfg.dims(gpus).dp), []
    for tp in (2, 4, 8):
        if tp <= cfg.parallel.tensor_model_parallel_size or gpus % tp:
            continue
        edits = [_set("parallel", "tensor_model_parallel_size", tp), _set("parallel", "sequence_parallel", True)]
        edit = _chain([*edits, _set("train", "global_batch_size", gbs)])
        flags = f"--tensor-model-parallel-size {tp} --sequence-parallel --global-batch-size {gbs}"
        changes.append(Change("tp", f"tensor parallel {tp} + sequence parallel (within a node)", flags, gpus, edit))
    return changes


def micro_batch_changes(cfg: RunConfig, gpus: int) -> list[Change]:
    gbs = cfg.global_batch(cfg.dims(gpus).dp)
    changes, mbs = [], cfg.train.micro_batch_size // 2
    while mbs >= 1:
        edit = _chain([_set("train", "micro_batch_size", mbs), _set("train", "global_batch_size", gbs)])
        changes.append(
            Change("mbs", f"micro batch {mbs}", f"--micro-batch-size {mbs} --global-batch-size {gbs}", gpus, edit)
        )
        mbs //= 2
    return changes


def switch_changes(cfg: RunConfig, gpus: int) -> list[Change]:
    changes = []
    if not cfg.model.checkpoint_activations:
        edit = _set("model", "checkpoint_activations", True)
        changes.append(Change("ckpt", "activation checkpointing", "--checkpoint-activations", gpus, edit))
    if not (cfg.train.fp16 or cfg.train.bf16):
        changes.append(Change("bf16", "bf16 mixed precision", "--bf16", gpus, _set("train", "bf16", True)))
    return changes


def zero_changes(cfg: RunConfig, gpus: int) -> list[Change]:
    return [
        Change("zero", f"ZeRO stage {s}", f"--zero-stage {s}", gpus, _set("parallel", "zero_stage", s))
        for s in stages_to_try(cfg)
    ]


def pipeline_changes(cfg: RunConfig, gpus: int) -> list[Change]:
    """Larger pipeline sizes on the same GPUs: each rank holds 1/pp of the layers (fewer data-parallel ranks)."""
    gbs, changes = cfg.global_batch(cfg.dims(gpus).dp), []
    for pp in range(cfg.parallel.pipeline_model_parallel_size + 1, gpus + 1):
        if gpus % pp or cfg.model.num_layers % pp:
            continue
        edit = _chain([_set("parallel", "pipeline_model_parallel_size", pp), _set("train", "global_batch_size", gbs)])
        flags = f"--pipeline-model-parallel-size {pp} --global-batch-size {gbs}"
        changes.append(Change("pp", f"pipeline parallel {pp}", flags, gpus, edit))
    return changes


def more_gpu_changes(cfg: RunConfig, gpus: int) -> list[Change]:
    changes = []
    for more in (gpus * factor for factor in GPU_FACTORS):
        eps = larger_expert_parallel_sizes(cfg, cfg.dims(more).dp)
        ep = eps[-1] if eps else cfg.parallel.moe_expert_parallel_size
        flags = f"--gpus {more}" + (f" --moe-expert-parallel-size {ep}" if eps else "")
        edit = _set("parallel", "moe_expert_parallel_size", ep)
        changes.append(Change("gpus", f"{more} GPUs, expert parallel {ep}", flags, more, edit))
    return changes


def single_changes(cfg: RunConfig, gpus: int) -> list[Change]:
    """Every candidate, weakest first within each kind."""
    kinds = (
        expert_parallel_changes,
        tensor_parallel_changes,
        micro_batch_changes,
        switch_changes,
        zero_changes,
        pipeline_changes,
        more_gpu_changes,
    )
    return [change for kind in kinds for change in kind(cfg, gpus)]


def _try(plan: Plan, change: Change) -> Suggestion | None:
    cfg = copy.deepcopy(plan.cfg)
    change.edit(cfg)
    try:
        candidate = make_plan(cfg, change.gpus, plan.device, plan.mfu)
    except ConfigError:
        return None  # e.g. a global batch the new layout cannot divide
    if plan.cost is not None:  # priced as the plan itself is (its GPUs' default links)
        candidate = priced(candidate, network(change.gpus, None, plan.device.name), plan.efficiency)
    return Suggestion(change.words, change.flags, candidate)


def _stack(changes: list[Change]) -> Change:
    return Change(
        "stack",
        " + ".join(c.words for c in changes),
        " ".join(c.flags for c in changes),
        max(c.gpus for c in changes),
        _chain([c.edit for c in changes]),
    )


def _stacked(plan: Plan, changes: list[Change]) -> list[Suggestion]:
    """The strongest change of each kind, one kind at a time; GPUs last and fewest first, until the run fits."""
    strongest = {c.kind: c for c in changes if c.kind != "gpus"}  # later = stronger within a kind
    steps = [[*list(strongest.values())[: i + 1]] for i in range(len(strongest))]
    steps += [[*strongest.values(), c] for c in changes if c.kind == "gpus"]
    for applied in steps:
        found = _try(plan, _stack(applied))
        if found is not None and found.plan.fits:
            return [found]
    return []


def suggestions(plan: Plan) -> list[Suggestion]:
    """Changes that make `plan` fit, fastest step first; [] when it already fits or nothing does."""
    if plan.fits:
        return []
    changes = single_changes(plan.cfg, plan.gpus)
    fitting = [s for s in (_try(plan, c) for c in changes) if s is not None and s.plan.fits]
    if not fitting:
        fitting = _stacked(plan, changes)
    return sorted(fitting, key=lambda s: (s.plan.step_time_s, s.plan.gpus))


def largest_micro_batch(plan: Plan, limit: int = 1024) -> Suggestion | None:
    """For a plan that fits: the largest micro batch (doubling, global batch kept) that still fits."""
    best, mbs = None, plan.cfg.train.micro_batch_size * 2
    gbs = plan.cfg.global_batch(plan.dims.dp)
    while plan.fits and mbs <= limit:
        edit = _chain([_set("train", "micro_batch_size", mbs), _set("train", "global_batch_size", gbs)])
        flags = f"--micro-batch-size {mbs} --global-batch-size {gbs}"
        found = _try(plan, Change("mbs", f"micro batch {mbs}", flags, plan.gpus, edit))
        if found is None or not found.plan.fits:
            break
        best, mbs = found, mbs * 2
    return best

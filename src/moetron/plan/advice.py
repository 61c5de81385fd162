"""What would make a run fit: re-plan the config under candidate changes and keep the ones that fit.

Candidates, each a change a user can make with flags (the planner re-runs the whole memory model on it):
  more expert parallelism    every EP that divides each expert count and the data-parallel size
  smaller micro batch        halving down to 1, the global batch kept (more accumulation steps)
  activation checkpointing   when off
  bf16                       when training in fp32 (fp16 costs the same memory in moetron)
  more GPUs                  ×2, ×4, ×8 with EP grown to match (data parallelism alone replicates everything)
If no single change fits, the changes are stacked in that order and the first stack that fits is offered.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass

from moetron.config import RunConfig
from moetron.errors import ConfigError
from moetron.plan.estimate import Plan, make_plan

GPU_FACTORS = (2, 4, 8)


@dataclass
class Suggestion:
    change: str  # in words
    flags: str  # what to add to the command line
    plan: Plan


Change = tuple[str, str, int, Callable[[RunConfig], None]]  # (words, flags, gpus, edit of a config copy)


def _moe_counts(cfg: RunConfig) -> list[int]:
    return [e for e in cfg.model.num_experts if e > 1]


def _valid_eps(cfg: RunConfig, dp: int) -> list[int]:
    """Expert-parallel sizes above the current one that divide every expert count and the DP size."""
    counts = _moe_counts(cfg)
    if not counts:
        return []
    limit = math.gcd(*counts, dp)
    current = cfg.parallel.moe_expert_parallel_size
    return [ep for ep in range(current + 1, limit + 1) if limit % ep == 0]


def _set(section: str, name: str, value) -> Callable[[RunConfig], None]:
    def edit(cfg: RunConfig) -> None:
        setattr(getattr(cfg, section), name, value)

    return edit


def single_changes(cfg: RunConfig, gpus: int) -> list[Change]:
    dims = cfg.dims(gpus)
    t, m = cfg.train, cfg.model
    changes: list[Change] = []
    for ep in _valid_eps(cfg, dims.dp):
        changes.append(
            (
                f"expert parallel {ep}",
                f"--moe-expert-parallel-size {ep}",
                gpus,
                _set("parallel", "moe_expert_parallel_size", ep),
            )
        )
    gbs = cfg.global_batch(dims.dp)
    mbs = t.micro_batch_size // 2
    while mbs >= 1:
        edit = _stack([_set("train", "micro_batch_size", mbs), _set("train", "global_batch_size", gbs)])
        changes.append((f"micro batch {mbs}", f"--micro-batch-size {mbs} --global-batch-size {gbs}", gpus, edit))
        mbs //= 2
    if not m.checkpoint_activations:
        changes.append(
            (
                "activation checkpointing",
                "--checkpoint-activations",
                gpus,
                _set("model", "checkpoint_activations", True),
            )
        )
    if not (t.fp16 or t.bf16):
        changes.append(("bf16 mixed precision", "--bf16", gpus, _set("train", "bf16", True)))
    for factor in GPU_FACTORS:
        more = gpus * factor
        eps = _valid_eps(cfg, cfg.dims(more).dp)
        ep = eps[-1] if eps else cfg.parallel.moe_expert_parallel_size
        flags = f"--gpus {more}" + (f" --moe-expert-parallel-size {ep}" if eps else "")
        changes.append(
            (f"{more} GPUs, expert parallel {ep}", flags, more, _set("parallel", "moe_expert_parallel_size", ep))
        )
    return changes


def _stack(edits: list[Callable[[RunConfig], None]]) -> Callable[[RunConfig], None]:
    def edit(cfg: RunConfig) -> None:
        for one in edits:
            one(cfg)

    return edit


def _try(plan: Plan, change: Change) -> Suggestion | None:
    words, flags, gpus, edit = change
    cfg = copy.deepcopy(plan.cfg)
    edit(cfg)
    try:
        candidate = make_plan(cfg, gpus, plan.device, plan.mfu)
    except ConfigError:
        return None  # e.g. a global batch the new layout cannot divide
    return Suggestion(words, flags, candidate)


def suggestions(plan: Plan) -> list[Suggestion]:
    """Changes that make `plan` fit, cheapest step time first; [] when it already fits or nothing does."""
    if plan.fits:
        return []
    changes = single_changes(plan.cfg, plan.gpus)
    tried = [s for s in (_try(plan, c) for c in changes) if s is not None]
    fitting = [s for s in tried if s.plan.fits]
    if not fitting:
        fitting = _stacked(plan, changes)
    return sorted(fitting, key=lambda s: (s.plan.step_time_s, s.plan.gpus))


def _stacked(plan: Plan, changes: list[Change]) -> list[Suggestion]:
    """Apply the changes of each kind cumulatively (strongest of each kind) until the run fits."""
    by_kind: dict[str, Change] = {}
    for change in changes:  # later entries of a kind are stronger (bigger EP, smaller batch, more GPUs)
        by_kind[change[0].split(" ")[0] if change[2] == plan.gpus else "gpus"] = change
    words, flags, edits, gpus = [], [], [], plan.gpus
    for kind in [k for k in by_kind if k != "gpus"] + ["gpus"] * ("gpus" in by_kind):
        w, f, g, edit = by_kind[kind]
        words, flags, edits, gpus = words + [w], flags + [f], edits + [edit], max(gpus, g)
        found = _try(plan, (" + ".join(words), " ".join(flags), gpus, _stack(edits)))
        if found is not None and found.plan.fits:
            return [found]
    return []

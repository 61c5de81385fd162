"""One parallel dimension as `validate()` and `plan/` see it: its problems, its memory hooks and its cost.

    DIMENSION = Dimension(
        name="cp",                               # the ParallelDims field, and the plan's step-time part
        split_problems=context_parallel_problems,  # what the split needs of the model and the sequence
        rank_view=per_rank_sequence,             # the run as one rank's per-token memory terms see it
        saved_bytes=gathered_kv_bytes,           # activations it keeps beyond the per-token terms
        step_seconds=cp_seconds,                 # its communication per optimizer step
    )

Every folder `parallel/<dim>/` defines its `DIMENSION` in `dimension.py`; `parallel/dimensions.py` lists them once
(`DIMENSIONS`), and `validate.py` and `plan/` iterate over that tuple instead of naming the dimensions, so adding a
dimension touches its folder and one registration line. The memory terms every layout shares (the tensor-parallel
`Split` of the activations, ZeRO's sharding of the state, EP's all-to-all row) are rows of the memory model itself
(`plan/memory_terms.py`), written by their dimensions' `memory.py` and called by name. Nothing here imports `plan/`:
the cost hook reads the plan and the network through `StepContext`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moetron.config import RunConfig
from moetron.parallel.dims import ParallelDims
from moetron.parallel.terms.rank import LocalParams

Problems = Callable[[RunConfig, ParallelDims], list[str]]


@dataclass(frozen=True)
class StepContext:
    """What a dimension's cost hook prices one optimizer step of the slowest GPU from."""

    plan: Any  # plan.estimate.Plan: cfg, dims, stages, accumulation_steps, device, memory, tp_comm_bytes
    local: RunConfig  # `plan.cfg` as one rank's per-token terms see it (every dimension's `rank_view`)
    net: Any  # plan.cost_model.Network: seconds(sent_bytes, collectives, extent) of a group of `extent` ranks
    compute: float  # seconds of compute (the slowest pipeline stage's)
    efficiency: float  # share of the peak the matmuls reach
    layers: list[int]  # expert counts of the layers the slowest GPU holds
    params: LocalParams  # what the GPU with the largest gradient reduction holds


def no_problems(cfg: RunConfig, dims: ParallelDims) -> list[str]:
    return []


def whole_run(cfg: RunConfig, dims: ParallelDims) -> RunConfig:
    return cfg


def nothing_saved(cfg: RunConfig, dims: ParallelDims, compute_bytes: int, layers: int, micro_batches: float) -> int:
    return 0


def no_seconds(step: StepContext) -> float:
    return 0.0


@dataclass(frozen=True)
class Dimension:
    name: str  # the ParallelDims field ("dp", "tp", ...) and the cost model's part of a step
    # What the split needs of the model and the sequence (heads, lengths): reported right after the model's own
    # problems, and checked once per layout by `plan --search`.
    split_problems: Problems = no_problems
    # What is wrong with the dimension's own flags (ZeRO stage, pipeline schedule, dispatchers): reported after the
    # run's other sections.
    flag_problems: Problems = no_problems
    # `plan --search` varies these flags and the micro batch never changes their problems: a layout they refuse is
    # refused once, for every micro batch.
    searched_flags: bool = False
    # The run as one rank's per-token memory terms see it (context parallelism: seq / cp tokens).
    rank_view: Callable[[RunConfig, ParallelDims], RunConfig] = whole_run
    # Activation bytes it keeps beyond the per-token terms, for `layers` layers and `micro_batches` in flight.
    saved_bytes: Callable[[RunConfig, ParallelDims, int, int, float], float] = nothing_saved
    # Seconds of its communication per optimizer step, not hidden behind compute.
    step_seconds: Callable[[StepContext], float] = no_seconds

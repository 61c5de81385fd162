"""`estimate_memory`: the peak bytes of one rank, of the heaviest pipeline rank with pp > 1.

The terms (parameters, gradients, optimizer state, activations, logits, all-to-all buffers; the model is
described there) are in `memory_terms.py`, which `stages.py` also prices each stage with; this module
sits on top of both, so neither imports the other's caller. The terms' names stay importable from here.
"""

from __future__ import annotations

from moetron.config import RunConfig
from moetron.parallel.dims import ParallelDims
from moetron.plan.memory_terms import (
    LocalParams,
    MemoryEstimate,
    activation_bytes,
    all_to_all_bytes,
    assemble,
    compute_bytes,
    layer_bytes,
    local_parameters,
    logits_bytes,
    rank_view,
    routed_rows,
    saved_by_dimensions,
)
from moetron.plan.stages import plan_stages

__all__ = ["LocalParams", "MemoryEstimate", "assemble", "compute_bytes", "estimate_memory", "layer_bytes"]
__all__ += ["local_parameters", "planned_peak_bytes", "routed_rows"]


def estimate_memory(cfg: RunConfig, dims: ParallelDims, device_kind: str = "cuda") -> MemoryEstimate:
    """Peak bytes per rank for `cfg` under the layout `dims` on a `device_kind` ("cuda" or "cpu") device
    (with pipeline parallelism: of the heaviest pipeline rank, see `plan/stages.py`)."""
    if dims.pp > 1:
        return max((s.memory for s in plan_stages(cfg, dims, device_kind)), key=lambda m: m.peak)
    local = rank_view(cfg, dims)  # the tokens of every sequence this rank holds
    saved = saved_by_dimensions(cfg, dims, compute_bytes(cfg), cfg.model.num_layers)  # what dimensions keep beyond
    activations = activation_bytes(local, dims, device_kind) + saved
    return assemble(cfg, dims, local_parameters(cfg.model, dims), activations, logits_bytes(local, dims, device_kind),
                    all_to_all_bytes(local, dims))  # fmt: skip


def planned_peak_bytes(cfg: RunConfig, world_size: int, device_type: str) -> float | None:
    """`moetron plan`'s peak bytes per device for this run's layout (train's banner and log lines, the dry run's
    comparison, gpu_smoke); None for a layout the planner does not model."""
    try:
        return estimate_memory(cfg, cfg.dims(world_size), "cuda" if device_type == "cuda" else "cpu").peak
    except Exception:  # noqa: BLE001 - a layout the planner does not model yet costs the banner line, not the run
        return None

"""`estimate_memory`: the peak bytes of one rank, of the heaviest pipeline rank with pp > 1.

The terms (parameters, gradients, optimizer state, activations, logits, all-to-all buffers; the model is
described there) are in `memory_terms.py`, which `pipeline_parallel.py` also prices each stage with; this module
sits on top of both, so neither imports the other's caller. The terms' names stay importable from here.
"""

from __future__ import annotations

from moetron.config import RunConfig
from moetron.parallel.dims import ParallelDims
from moetron.plan.context_parallel import gathered_kv_bytes, per_rank_sequence
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
    routed_rows,
)
from moetron.plan.pipeline_parallel import plan_stages

__all__ = ["LocalParams", "MemoryEstimate", "assemble", "compute_bytes", "estimate_memory", "layer_bytes"]
__all__ += ["local_parameters", "planned_peak_bytes", "routed_rows"]


def estimate_memory(cfg: RunConfig, dims: ParallelDims, device_kind: str = "cuda") -> MemoryEstimate:
    """Peak bytes per rank for `cfg` under the layout `dims` on a `device_kind` ("cuda" or "cpu") device
    (with pipeline parallelism: of the heaviest pipeline rank, see `plan/pipeline_parallel.py`)."""
    if dims.pp > 1:
        return max((s.memory for s in plan_stages(cfg, dims, device_kind)), key=lambda m: m.peak)
    local = per_rank_sequence(cfg, dims)  # context parallelism: this rank's seq / cp tokens of every sequence
    activations = activation_bytes(local, dims, device_kind) + gathered_kv_bytes(cfg, dims, compute_bytes(cfg))
    return assemble(cfg, dims, local_parameters(cfg.model, dims), activations, logits_bytes(local, dims, device_kind),
                    all_to_all_bytes(local, dims))  # fmt: skip


def planned_peak_bytes(cfg: RunConfig, world_size: int, device_type: str) -> float | None:
    """`moetron plan`'s peak bytes per device for this run's layout (train's banner and log lines, the dry run's
    comparison, gpu_smoke); None for a layout the planner does not model."""
    try:
        return estimate_memory(cfg, cfg.dims(world_size), "cuda" if device_type == "cuda" else "cpu").peak
    except Exception:  # noqa: BLE001 - a layout the planner does not model yet costs the banner line, not the run
        return None

"""Expert parallelism as one dimension: the problems of its replica and dispatcher flags, and its all-to-alls.

The expert layout itself (EP against the data-parallel ranks and the expert counts) is checked with the other
degrees by `ParallelDims.problems`; the all-to-all buffers are a row of the memory plan (`parallel/ep/memory.py`).
"""

from __future__ import annotations

from moetron.config import RunConfig
from moetron.parallel.dimension import Dimension
from moetron.parallel.dims import ParallelDims
from moetron.parallel.ep.cost import ep_seconds
from moetron.parallel.ep.dispatch_spec import EPDispatchSpec, ep_dispatch_problems
from moetron.parallel.ep.replica_spec import expert_replica_problems


def flag_problems(cfg: RunConfig, dims: ParallelDims) -> list[str]:
    experts = cfg.model.experts_per_layer()
    problems = expert_replica_problems(cfg.parallel.moe_expert_replicas, experts, dims)
    spec = EPDispatchSpec.from_config(cfg.parallel)
    return problems + ep_dispatch_problems(spec, experts, dims, cfg.parallel, cfg.train.compile)


DIMENSION = Dimension(name="ep", flag_problems=flag_problems, step_seconds=ep_seconds)

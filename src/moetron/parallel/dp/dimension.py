"""Data parallelism (with ZeRO) as one dimension: its flags' problems and its gradient traffic."""

from __future__ import annotations

from moetron.config import RunConfig
from moetron.parallel.dimension import Dimension
from moetron.parallel.dims import ParallelDims
from moetron.parallel.dp.cost import dp_seconds
from moetron.parallel.dp.zero_spec import zero_problems


def zero_flag_problems(cfg: RunConfig, dims: ParallelDims) -> list[str]:
    return zero_problems(cfg.parallel.zero_stage, cfg.parallel.use_distributed_optimizer, dims)


DIMENSION = Dimension(name="dp", flag_problems=zero_flag_problems, searched_flags=True, step_seconds=dp_seconds)

"""Tensor (and sequence) parallelism as one dimension: what the model needs of its split, and its collectives."""

from __future__ import annotations

from moetron.config import RunConfig
from moetron.parallel.dimension import Dimension
from moetron.parallel.dims import ParallelDims
from moetron.parallel.tp.cost import tp_seconds
from moetron.parallel.tp.sizes import tensor_parallel_problems


def split_problems(cfg: RunConfig, dims: ParallelDims) -> list[str]:
    return tensor_parallel_problems(cfg.model, dims)


DIMENSION = Dimension(name="tp", split_problems=split_problems, step_seconds=tp_seconds)

"""Pipeline parallelism as one dimension: the problems of its flags, and the activations sent between stages.

Its memory is priced stage by stage (`plan/stages.py`, with `parallel/pp/memory.py`'s micro-batches in flight) and
its bubble is part of the step's compute (`parallel/pp/cost.py`), both read by the plan where it prices a pipeline.
"""

from __future__ import annotations

from moetron.config import RunConfig
from moetron.parallel.dimension import Dimension
from moetron.parallel.dims import ParallelDims
from moetron.parallel.pp.cost import pp_seconds
from moetron.parallel.pp.stage_layout import pipeline_problems


def flag_problems(cfg: RunConfig, dims: ParallelDims) -> list[str]:
    """The pipeline flags' problems at the run's micro-batch count (0 when the batch flags are themselves invalid,
    reported with the training section)."""
    valid_batch = cfg.train.micro_batch_size > 0 and dims.dp > 0
    return pipeline_problems(cfg.model.num_layers, cfg.parallel, cfg.num_micro_batches(dims.dp) if valid_batch else 0)


DIMENSION = Dimension(name="pp", flag_problems=flag_problems, step_seconds=pp_seconds)

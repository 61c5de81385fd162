"""Context parallelism as one dimension: its problems, each rank's share of the sequence, the gathered K/V it
keeps, and its K/V traffic."""

from __future__ import annotations

from moetron.parallel.cp.cost import cp_seconds
from moetron.parallel.cp.memory import gathered_kv_bytes, per_rank_sequence
from moetron.parallel.cp.sizes import context_parallel_problems
from moetron.parallel.dimension import Dimension

DIMENSION = Dimension(
    name="cp",
    split_problems=context_parallel_problems,
    rank_view=per_rank_sequence,
    saved_bytes=gathered_kv_bytes,
    step_seconds=cp_seconds,
)

"""Values for host reads of fake tensors (which have none), chosen so the step takes its ordinary path and every
buffer has the shape it has on a GPU under balanced routing.

    0 / 0.0 / False      by default: no overflow, no stop request, a gradient norm of 0 (finite: the step applies)
    EP split sizes       the default all-to-all dispatcher's (`parallel/ep/all_to_all.py`, `exchange_counts`): a
                         rank sends T·K/EP routes to each peer and receives as many (0 would give empty buffers)
    largest expert load  the batched experts' padding (`PaddedLayout`, dropless): ceil(rows / experts)
    grouped-GEMM probe   `_grouped_mm_runs` checks that the kernel computed 8: it did (its meta checks passed)
    1                    torch's pipeline warm-up vote (`torch/distributed/pipelining/schedules.py`): static shapes,
                         as moetron's fixed-shape stages are (0 makes the stages re-infer shapes outside autocast)

Each rule names the function whose read it answers; a function renamed in moetron falls back to the default, and
the dry-run tests (which check the buffers' sizes through the measured memory) notice.
`note_routes(routes, ep_size)` is called before each exchange (`rank_step.note_ep_routes` installs it).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

_routes = {"routes": 0, "ep_size": 1}


def note_routes(routes: int, ep_size: int) -> None:
    """The routes (T·K) of the micro-batch whose split sizes are about to be read, and the EP group's size."""
    _routes.update(routes=routes, ep_size=ep_size)


def balanced_split(frame) -> int:
    return _routes["routes"] // max(_routes["ep_size"], 1)


def balanced_expert_load(frame) -> int:
    rows, counts = frame.f_locals["num_rows"], frame.f_locals["counts_E"]
    return math.ceil(rows / max(counts.numel(), 1))


RULES: dict[tuple[str, str], Callable] = {  # (file, function) -> the value its read gets
    ("moetron/parallel/ep/all_to_all.py", "exchange_counts"): balanced_split,
    ("moetron/model/moe/experts/backends.py", "__init__"): balanced_expert_load,  # PaddedLayout
    ("moetron/model/moe/experts/backends.py", "_grouped_mm_runs"): lambda frame: 8,
    ("torch/distributed/pipelining/schedules.py", "*"): lambda frame: 1,
}


def _callers(frame):
    while frame is not None:
        yield frame
        frame = frame.f_back


def value_for(tensor: torch.Tensor, frame) -> bool | int | float:
    """The stand-in for reading `tensor`'s value from the code at `frame`."""
    for caller in _callers(frame):
        code = caller.f_code
        for (path, function), rule in RULES.items():
            if code.co_filename.endswith(path) and function in ("*", code.co_name):
                return rule(caller)
    if tensor.dtype == torch.bool:
        return False
    return 0 if not tensor.is_floating_point() else 0.0

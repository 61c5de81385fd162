"""Values for host reads of fake tensors (which have none), chosen so the step takes its ordinary path.

    0 / 0.0 / False      by default: no overflow, no stop request, a gradient norm of 0 (finite: the step applies)
    balanced EP splits   the default all-to-all dispatcher's split sizes (`parallel/ep/all_to_all.py`,
                         `exchange_counts`): a rank sends T·K/EP routes to each peer and receives as many, as under
                         balanced routing, so the expert buffers have the shapes of a real step (0 would give empty
                         buffers and measure nothing)
    1                    torch's pipeline warm-up vote (`torch/distributed/pipelining/schedules.py`): static shapes,
                         as moetron's fixed-shape stages are (0 makes the stages re-infer shapes outside autocast)

`note_routes(routes, ep_size)` is called by the dispatcher's patch before each exchange (`worker` installs it).
"""

from __future__ import annotations

import torch

EXCHANGE_FUNCTION = "exchange_counts"
PIPELINE_FILE = "torch/distributed/pipelining/schedules.py"
_routes = {"routes": 0, "ep_size": 1}


def note_routes(routes: int, ep_size: int) -> None:
    """The routes (T·K) of the micro-batch whose split sizes are about to be read, and the EP group's size."""
    _routes.update(routes=routes, ep_size=ep_size)


def balanced_split() -> int:
    return _routes["routes"] // max(_routes["ep_size"], 1)


def _callers(frame):
    while frame is not None:
        yield frame
        frame = frame.f_back


def value_for(tensor: torch.Tensor, frame) -> bool | int | float:
    """The stand-in for reading `tensor`'s value from the code at `frame`."""
    for caller in _callers(frame):
        code = caller.f_code
        if code.co_name == EXCHANGE_FUNCTION and code.co_filename.endswith("parallel/ep/all_to_all.py"):
            return balanced_split()
        if code.co_filename.endswith(PIPELINE_FILE):
            return 1
    if tensor.dtype == torch.bool:
        return False
    return 0 if not tensor.is_floating_point() else 0.0

"""Values for host reads of fake tensors (which have none), chosen so the step takes its ordinary path and every
buffer has the shape it has on a GPU under balanced routing.

    0 / 0.0 / False      by default: no overflow, no stop request, a gradient norm of 0 (finite: the step applies)
    EP split sizes       the default all-to-all dispatcher's (`parallel/ep/all_to_all.py`, `exchange_counts`): a
                         rank sends T·K/EP routes to each peer and receives as many (0 would give empty buffers);
                         with a run's measured routing (`use_routing`, `--routing-from`) T·K × the share of the
                         routes that peer's experts took, and receives T·K × its own experts' share from each peer
    largest expert load  the batched experts' padding (`PaddedLayout`): ceil(rows / experts), or with measured
                         routing rows × the busiest local expert's share of the local experts' routes
    grouped-GEMM probe   `_grouped_mm_runs` checks that the kernel computed 8: it did (its meta checks passed)
    1                    torch's pipeline warm-up vote (`torch/distributed/pipelining/schedules.py`): static shapes,
                         as moetron's fixed-shape stages are (0 makes the stages re-infer shapes outside autocast)

Each rule names the function whose read it answers; a function renamed in moetron falls back to the default, and
the dry-run tests (which check the buffers' sizes through the measured memory) notice.
`note_routes(routes, ep_size, ep_rank)` is called before each exchange and `note_layer(index)` at each MoE layer's
forward (`rank_step.note_ep_routes` installs both).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

_routes = {"routes": 0, "ep_size": 1, "ep_rank": 0, "layer": -1, "cap": None}
_routing: dict[int, list[float]] = {}  # MoE layer index -> routes per expert (a run's measured loads)


def use_routing(routes_per_layer: dict[int, list[float]]) -> None:
    """Size the splits and loads with a run's routes per expert, by MoE layer index (empty: balanced)."""
    _routing.clear()
    _routing.update(routes_per_layer)


def note_layer(index: int) -> None:
    _routes["layer"] = index


def note_routes(routes: int, ep_size: int, ep_rank: int = 0, cap: int | None = None) -> None:
    """The routes (T·K) of the micro-batch whose split sizes are about to be read, the EP group's size and this
    rank's place in it, and under capacity routing the most rows one rank's tokens may send to one rank's experts
    (local experts × capacity: dropping keeps no more)."""
    _routes.update(routes=routes, ep_size=ep_size, ep_rank=ep_rank, cap=cap)


def rank_shares(routes_E: list[float], ep_size: int) -> list[float]:
    """The fraction of the routes each EP rank's experts (contiguous blocks of E / EP) took."""
    total, local = sum(routes_E) or 1.0, len(routes_E) // ep_size
    return [sum(routes_E[r * local : (r + 1) * local]) / total for r in range(ep_size)]


def split_sizes(
    routes: int, ep_size: int, ep_rank: int, routes_E: list[float] | None, cap: int | None = None
) -> list[int]:
    """[rows sent to each peer] + [rows received from each peer] for a micro-batch of `routes` routes."""
    if not routes_E:
        sizes = [routes // ep_size] * (2 * ep_size)
    else:
        shares = rank_shares(routes_E, ep_size)
        sizes = [int(routes * share) for share in shares] + [int(routes * shares[ep_rank])] * ep_size
    return sizes if cap is None else [min(size, cap) for size in sizes]


def exchange_split(frame, element: int) -> int:
    r = _routes
    sizes = split_sizes(r["routes"], max(r["ep_size"], 1), r["ep_rank"], _routing.get(r["layer"]), r["cap"])
    return sizes[element % len(sizes)]


def largest_expert_load(frame, element: int) -> int:
    rows, local = frame.f_locals["num_rows"], max(frame.f_locals["counts_E"].numel(), 1)
    routes_E = _routing.get(_routes["layer"])
    if not routes_E:
        return math.ceil(rows / local)
    first = _routes["ep_rank"] * local if len(routes_E) > local else 0  # this rank's experts
    mine = routes_E[first : first + local]
    return math.ceil(rows * max(mine) / (sum(mine) or 1.0))


RULES: dict[tuple[str, str], Callable] = {  # (file, function) -> the value its read gets
    ("moetron/parallel/ep/all_to_all.py", "exchange_counts"): exchange_split,
    ("moetron/model/moe/experts/backends.py", "__init__"): largest_expert_load,  # PaddedLayout
    ("moetron/model/moe/experts/backends.py", "_grouped_mm_runs"): lambda frame, element: 8,
    ("torch/distributed/pipelining/schedules.py", "*"): lambda frame, element: 1,
}


def _callers(frame):
    while frame is not None:
        yield frame
        frame = frame.f_back


def value_for(tensor: torch.Tensor, frame, element: int = 0) -> bool | int | float:
    """The stand-in for reading `tensor`'s value (its `element`-th, in a `.tolist()`) from the code at `frame`."""
    for caller in _callers(frame):
        code = caller.f_code
        for (path, function), rule in RULES.items():
            if code.co_filename.endswith(path) and function in ("*", code.co_name):
                return rule(caller, element)
    if tensor.dtype == torch.bool:
        return False
    return 0 if not tensor.is_floating_point() else 0.0

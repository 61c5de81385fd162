"""The GEMM floor of a training step: the step's own matrix products, replayed back to back with nothing else.

    calls = record_gemms(lambda: side.step(batch))     # one real step, its GEMMs captured with their layouts
    seconds = replay_seconds(calls, time.process_time)  # the same GEMMs again, alone: the step's floor

`benchmarks/e2e.py` prints each side's step time as a multiple of this floor. The FLOPs of a step are the same on
both sides of a comparison and almost all of them are GEMMs (86% the LM head on e2e's tiny models), so the floor says
what lead is physically possible: a side at P× the floor can be beaten by 1.5× only by one at P / 1.5× of it.

A recorded call keeps the operator (mm, addmm, addmm_, bmm, baddbmm, _grouped_mm, in-place and `out=` forms
alike) and each tensor argument's shape, strides, offset and dtype; tensors that shared memory in the step share it
in the replay (a weight read by three GEMMs is one buffer, as in cache). Floating-point inputs are replayed on fresh
random values (a GEMM's speed does not depend on them, short of denormals, which N(0, 0.02) has none of); integer
ones (`_grouped_mm`'s group offsets) keep the step's values. Not counted: attention kernels (fused SDPA; at e2e's
64-token blocks they are ~1% of a step), element-wise work, the optimizer — the floor is a lower bound.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
GEMM_OPS = (aten.mm, aten.addmm, aten.addmm_, aten.bmm, aten.baddbmm, aten.addbmm, aten._grouped_mm)


@dataclass(frozen=True)
class TensorSpec:
    """A tensor argument as its layout: which storage (by the step's address), and the view of it."""

    storage: tuple[int, int, torch.dtype]  # (data pointer, bytes, dtype) of the step's storage
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    values: torch.Tensor | None  # integer tensors keep their values (group offsets)


@dataclass(frozen=True)
class GemmCall:
    op: torch._ops.OpOverload
    args: tuple
    kwargs: dict


def _spec(t: torch.Tensor) -> TensorSpec:
    storage = t.untyped_storage()
    values = None if t.is_floating_point() else t.detach().clone()
    return TensorSpec((storage.data_ptr(), storage.nbytes(), t.dtype), t.shape, t.stride(), t.storage_offset(), values)


def _map(value, fn):
    if isinstance(value, (list, tuple)):
        return type(value)(_map(v, fn) for v in value)
    return fn(value)


class _GemmRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: list[GemmCall] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in GEMM_OPS:
            spec = lambda v: _spec(v) if isinstance(v, torch.Tensor) else v  # noqa: E731
            self.calls.append(GemmCall(func, _map(args, spec), {k: _map(v, spec) for k, v in kwargs.items()}))
        return func(*args, **kwargs)


def record_gemms(step: Callable[[], object]) -> list[GemmCall]:
    """The GEMM calls of one run of `step` (forward, backward and anything else it does), in order."""
    recorder = _GemmRecorder()
    with recorder:
        step()
    return recorder.calls


def gemm_flops(calls: list[GemmCall]) -> int:
    """2·m·k·n summed over the calls (batched: × the batch; grouped: the rows' total)."""
    total = 0
    for call in calls:
        # the two factors: the last two floating tensors (addmm: after the bias; _grouped_mm: before the offsets)
        a, b = [v for v in call.args if isinstance(v, TensorSpec) and v.values is None][-2:]
        batch = a.size[0] if len(a.size) == 3 and len(b.size) == 3 else 1
        total += 2 * batch * a.size[-2] * a.size[-1] * b.size[-1]
    return total


def _materialise(calls: list[GemmCall], device: str = "cpu") -> list[tuple]:
    storages: dict[tuple, torch.Tensor] = {}

    def tensor(v):
        if not isinstance(v, TensorSpec):
            return v
        if v.values is not None:
            return v.values
        if v.storage not in storages:
            _, nbytes, dtype = v.storage
            count = max(1, nbytes // torch.empty((), dtype=dtype).element_size())
            storages[v.storage] = torch.empty(count, dtype=dtype, device=device).normal_(0, 0.02)
        return storages[v.storage].as_strided(v.size, v.stride, v.offset)

    return [(c.op, _map(c.args, tensor), {k: _map(v, tensor) for k, v in c.kwargs.items()}) for c in calls]


def replay_seconds(calls: list[GemmCall], clock: Callable[[], float], reps: int = 5) -> float:
    """Median time (by `clock`) of the calls run back to back, after one warm-up pass."""
    replay = _materialise(calls)
    times = []
    with torch.no_grad():
        for rep in range(reps + 1):
            start = clock()
            for op, args, kwargs in replay:
                op(*args, **kwargs)
            if rep:
                times.append(clock() - start)
    return statistics.median(times)

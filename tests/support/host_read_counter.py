"""Host reads: count the reads of tensor values from Python, and run the CUDA code path on a CPU.

    with HostReadCounter() as reads, cuda_code_path():
        y, aux = layer(x)
        (y.sum() + aux.loss(cfg)).backward()
    assert reads.total == 0, reads.by_kind

`HostReadCounter` is a TorchFunctionMode: it sees Python-level calls, so reads made inside a C++ kernel are
invisible to it (CUDA's `bincount`, `nonzero`, boolean-mask indexing and `repeat_interleave` without
`output_size` sync that way); the MoE code avoids those by construction.

`cuda_code_path()`: production picks its CPU-only kernels by the tensors' device (the CPU backend behind the model's
seams, `model/backends.py`; top-1 RTS's keep in `deepspeed_gating._keep_top1`). Within the block CPU tensors go
through ATen's backends, as every other device's do, and the RTS keep's CPU sort is swapped for DeepSpeed's topk
(the same routes), so the CPU runs the branches CUDA runs. It does not change the `auto` expert backend (forced
backends are what a measurement wants) or any value.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

from moetron.model import backends
from moetron.model.moe.routing import deepspeed_gating

# Tensor methods that hand a tensor's value to Python (`.to(...)` counts when it targets the CPU).
READ_METHODS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"})
# Calls that run the backward pass. A mode is off while it handles a call, so the backward's Python code
# (custom autograd Functions, hooks) would go uncounted: during these calls the read methods are wrapped.
BACKWARD_CALLS = frozenset({"backward", "grad"})
_ABSENT = object()


def _topk_rts_keep(ids_T: torch.Tensor, rand_TE: torch.Tensor, capacity: int) -> torch.Tensor:
    """Top-1 RTS's keep as a GPU runs it: DeepSpeed's topk over keys = one-hot mask · U(0, 1), no host read."""
    keys_TE = torch.zeros_like(rand_TE).scatter_(1, ids_T.unsqueeze(1), rand_TE.gather(1, ids_T.unsqueeze(1)))
    return deepspeed_gating.keep_top_keys_top1(ids_T, keys_TE, capacity)


@contextlib.contextmanager
def cuda_code_path() -> Iterator[None]:
    """Within the block, moetron's modules take the branches they take on CUDA, even for CPU tensors."""
    cpu, sort_keep = backends._REGISTERED.pop("cpu", None), deepspeed_gating.keep_top_random_keys_top1
    deepspeed_gating.keep_top_random_keys_top1 = _topk_rts_keep
    try:
        yield
    finally:
        if cpu is not None:
            backends._REGISTERED["cpu"] = cpu
        deepspeed_gating.keep_top_random_keys_top1 = sort_keep


def _targets_cpu(args: tuple, kwargs: dict) -> bool:
    """Whether a `Tensor.to(...)` call names the CPU as its device."""
    candidates = [*args[1:], kwargs.get("device")]
    return any(isinstance(c, (str, torch.device)) and torch.device(c).type == "cpu" for c in candidates)


def _is_read(name: str, args: tuple, kwargs: dict) -> bool:
    return name in READ_METHODS or (name == "to" and _targets_cpu(args, kwargs))


@contextlib.contextmanager
def _read_methods_counted(by_kind: Counter) -> Iterator[None]:
    """Wrap torch.Tensor's read methods so that each call is counted into `by_kind`, then restore them."""
    saved = {name: torch.Tensor.__dict__.get(name, _ABSENT) for name in (*READ_METHODS, "to")}

    def counted(name: str, method):
        def wrapper(*args, **kwargs):
            if _is_read(name, args, kwargs):
                by_kind[name] += 1
            return method(*args, **kwargs)

        return wrapper

    for name in saved:
        setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    try:
        yield
    finally:
        for name, original in saved.items():
            if original is _ABSENT:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)


class HostReadCounter(TorchFunctionMode):
    """Counts host reads of tensor values (see READ_METHODS) made from Python while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.by_kind: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if _is_read(name, args, kwargs):
            self.by_kind[name] += 1
        if name in BACKWARD_CALLS:
            with _read_methods_counted(self.by_kind):
                return func(*args, **kwargs)
        return func(*args, **kwargs)

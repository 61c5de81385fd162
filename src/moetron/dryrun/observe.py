"""What the fake step does that a GPU would pay for: host reads, collectives, fp32 GEMMs, tensors off the device.

`StepObserver` is a TorchDispatchMode entered above FakeTensorMode: it sees every aten op of the step with fake
inputs, after autograd and autocast, before the fake kernels run.

  host reads   `_local_scalar_dense` of a cuda tensor (`.item()`, `.tolist()`, `int()/float()/bool()`, and reads
               inside C++ composites) and ops whose output shape depends on values (`nonzero`, `masked_select`,
               `unique`, `repeat_interleave` without `output_size`, ...): each stops the host until the GPU
               catches up. Counted per Python instruction (a `.tolist()` of n values is one read) with the first
               frame outside torch and this package (`where`). A fake tensor has no value: the read is answered
               with a stand-in (`stand_ins.py`) so the step goes on.
  collectives  every c10d / functional-collective op: op, dtype, bytes of its tensors.
  fp32 GEMMs   mm / addmm / bmm / baddbmm / _grouped_mm on fp32 cuda tensors, with where (under bf16/fp16 the
               router's gate and the loss are the intended ones).
  cpu tensors  an op that mixes a cuda tensor with a CPU tensor of one element or more (a GPU-path defect: the
               run stops, naming the op and where), and ops making CPU tensors inside the model (`cpu_ops`).

An exception raised by an op (a meta kernel's argument check, a device mismatch) is labelled with the op and the
place it was called from (`op_of`, `where_of`), so the worker reports one line instead of torch's traceback.
"""

from __future__ import annotations

import re
import sys
import sysconfig
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from moetron.dryrun import attention_kernels, stand_ins

TORCH_DIR = str(Path(torch.__file__).parent)
DRYRUN_DIR = str(Path(__file__).parent)
MOETRON_ROOT = Path(__file__).parents[1]  # .../moetron
STDLIB_DIR = sysconfig.get_paths()["stdlib"]
SKIPPED_DIRS = (TORCH_DIR, DRYRUN_DIR, STDLIB_DIR, "<")  # "<frozen ...>", "<string>"

PROPAGATING = [0]  # > 0 while DTensor's sharding propagation runs ops on global shapes (patches.py): not the rank's
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_dtensor")
NOT_COLLECTIVES = ("wait_tensor", "wait")
GEMMS = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "addbmm", "mv"}
DEVICE_COPIES = {"_to_copy", "copy_", "copy", "_copy_from", "_copy_from_and_resize"}


def where(frame=None) -> str:
    """The first frame outside torch, the standard library and this package: `moetron/x/y.py:LINE` for moetron's
    files, the path as Python has it for others (a test's helper)."""
    frame = frame or sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(SKIPPED_DIRS):
            return f"{_short(filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _first_outside(frame):
    while frame is not None and frame.f_code.co_filename.startswith(SKIPPED_DIRS):
        frame = frame.f_back
    return frame


def _short(filename: str) -> str:
    path = Path(filename)
    if path.is_relative_to(MOETRON_ROOT):
        return "moetron/" + path.relative_to(MOETRON_ROOT).as_posix()
    return filename


def op_name(func) -> str:
    return f"{func.namespace}.{func.__name__}" if hasattr(func, "namespace") else str(func)


def _tensors(args, kwargs) -> list[torch.Tensor]:
    flat, _ = tree_flatten((args, kwargs or {}))
    return [t for t in flat if isinstance(t, torch.Tensor)]


# the fused attention kernels' forward ops, by the kernel they are (the math kernel is no op of its own:
# `attention_kernels` counts it)
ATTENTION_KERNELS = {
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_efficient_attention": "efficient",
    "_scaled_dot_product_cudnn_attention": "cudnn",
}


class StepObserver(TorchDispatchMode):
    def __init__(
        self,
        in_model: Callable[[], bool] = lambda: False,
        in_moe_layer: Callable[[], bool] = lambda: False,
        module_now: Callable[[], str] = lambda: "",
    ):
        super().__init__()
        # in_model / in_moe_layer: whether a module of the model (a MoE layer) is running; module_now: which one,
        # named where no Python frame is (the backward runs in autograd's device thread)
        self.in_model, self.in_moe_layer, self.module_now = in_model, in_moe_layer, module_now
        self.reads: Counter = Counter()  # where -> host reads
        self.moe_reads = 0  # of them, inside a MoE layer
        self.collectives: Counter = Counter()  # (op, dtype, bytes) -> calls
        self.collective_sites: dict = {}  # (op, dtype, bytes) -> where the first one was called
        self.fp32_gemms: Counter = Counter()  # (op, where) -> calls
        self.cpu_ops: Counter = Counter()  # (op, where) -> calls
        self._last_read: tuple | None = None
        self._element = 0

    def reset(self) -> None:
        """Start a new step's records."""
        self.reads, self.moe_reads = Counter(), 0
        self.collectives, self.fp32_gemms, self.cpu_ops = Counter(), Counter(), Counter()
        self.collective_sites = {}
        self._last_read = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor lower to local ops first; they come back here
        kwargs = kwargs or {}
        if PROPAGATING[0]:
            return func(*args, **kwargs)
        if func.namespace != "prim" and func is not torch.ops.aten._local_scalar_dense.default:
            self._last_read = None  # an op between two reads: they are two reads, even from one instruction
        tensors = _tensors(args, kwargs)
        on_cuda = [t for t in tensors if t.device.type == "cuda"]
        name = func.__name__.split(".")[0]
        if func is torch.ops.aten._local_scalar_dense.default and on_cuda:
            return self._host_read(args[0])
        if on_cuda and reads_values_for_shape(func, args, kwargs):
            self._count_read()
        if func.namespace in COLLECTIVE_NAMESPACES and name not in NOT_COLLECTIVES:
            self._collective(func, tensors)
        elif name in GEMMS and on_cuda and any(t.dtype == torch.float32 for t in on_cuda):
            self.fp32_gemms[(op_name(func), self._where())] += 1
        elif name in ATTENTION_KERNELS and on_cuda:  # however it is reached: SDPA, a causal bias, ring attention
            attention_kernels.CHOICES[ATTENTION_KERNELS[name]] += 1
        if on_cuda and name not in DEVICE_COPIES:
            self._check_devices(func, tensors)
        try:
            out = func(*args, **kwargs)
        except Exception as err:  # label the innermost failing op once, for the worker's one-line report
            if not hasattr(err, "dryrun_op"):
                err.dryrun_op, err.dryrun_where = op_name(func), where()
            raise
        if not on_cuda and self.in_model() and _makes_cpu_tensors(out):
            self.cpu_ops[(op_name(func), self._where())] += 1
        return out

    def _count_read(self) -> int:
        """Count a read (once per instruction); the element's index within it (`.tolist()`: 0, 1, ...)."""
        frame = _first_outside(sys._getframe(1))
        key = (id(frame), frame.f_lasti if frame is not None else -1)
        if key == self._last_read:  # `.tolist()` reads element by element, with no op in between: one read
            self._element += 1
            return self._element
        self._last_read, self._element = key, 0
        self.reads[where(frame) if frame is not None else self._where()] += 1
        if self.in_moe_layer():
            self.moe_reads += 1
        return 0

    def _where(self) -> str:
        at = where(sys._getframe(2))
        if at != "?":
            return at
        node = torch._C._current_autograd_node()  # the backward's step being run, in autograd's own thread
        if node is None:
            return f"backward of {self.module_now() or 'the model'}"
        forward = forward_site(node)
        return (
            f"backward of {forward}" if forward else f"backward ({node.name()}) of {self.module_now() or 'the model'}"
        )

    def _host_read(self, tensor: torch.Tensor):
        element = self._count_read()
        return stand_ins.value_for(tensor, sys._getframe(1), element)

    def _collective(self, func, tensors: list[torch.Tensor]) -> None:
        if not tensors:
            return
        size = max(t.numel() * t.element_size() for t in tensors)  # the larger side: the gathered / sent buffer
        dtype = str(tensors[0].dtype).removeprefix("torch.")
        key = (op_name(func), dtype, size)
        self.collectives[key] += 1
        self.collective_sites.setdefault(key, self._where())

    def _check_devices(self, func, tensors: list[torch.Tensor]) -> None:
        cpu = [t for t in tensors if t.device.type == "cpu" and t.dim() > 0]
        if cpu:
            raise GPUPathDefect(
                f"{op_name(func)} mixes a CPU tensor {list(cpu[0].shape)} ({str(cpu[0].dtype).removeprefix('torch.')})"
                " with cuda tensors",
                op_name(func),
                self._where(),
            )


_FRAME_LINE = re.compile(r'File "([^"]+)", line (\d+)')


def forward_site(node) -> str:
    """Where the forward op of an autograd node was called, from the stack anomaly mode saved with it ("")."""
    stack = node.metadata.get("traceback_") if hasattr(node, "metadata") else None
    for entry in reversed(stack or []):
        match = _FRAME_LINE.search(entry)
        if match and not match.group(1).startswith(SKIPPED_DIRS):
            return f"{_short(match.group(1))}:{match.group(2)}"
    return ""


MASK_INDEXING = {"index", "index_put", "index_put_", "_index_put_impl_"}


def reads_values_for_shape(func, args, kwargs) -> bool:
    """Whether the op must read values on the host to know its output's shape (a sync on a GPU)."""
    name = func.__name__.split(".")[0]
    if name in MASK_INDEXING:  # only boolean masks make indexing data-dependent; integer indices do not
        indices = [i for i in (args[1] if len(args) > 1 else []) if isinstance(i, torch.Tensor)]
        masks = [i for i in indices if i.dtype in (torch.bool, torch.uint8)]
        if not masks:
            return False
        # ATen turns `x[mask] = scalar` with one full-shape mask into masked_fill: no read
        value = args[2] if len(args) > 2 else None
        return not (name != "index" and len(indices) == 1 and isinstance(value, torch.Tensor) and value.numel() == 1)
    if torch.Tag.dynamic_output_shape not in func.tags:
        return False
    return kwargs.get("output_size") is None  # repeat_interleave(..., output_size=n) knows its size


def _makes_cpu_tensors(out) -> bool:
    flat, _ = tree_flatten(out)
    return any(isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel() > 1 for t in flat)


class GPUPathDefect(RuntimeError):
    """A defect only a GPU would show, found on the fake device; one line with the op and where."""

    def __init__(self, message: str, op: str, at: str):
        super().__init__(message)
        self.dryrun_op, self.dryrun_where = op, at

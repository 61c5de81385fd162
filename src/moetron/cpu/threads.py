"""Intra-op threads on CPU: moetron's kernels at every thread, a small model's other ops at one.

Why: with several intra-op threads every ATen op over more than 32k elements, and every MKL GEMM, opens a parallel
region that wakes the sleeping threads (`OMP_WAIT_POLICY=PASSIVE`, `cli.cpu_thread_defaults`). A small model's step
is hundreds of such ops of tens of microseconds each, and the wake-ups cost more than the work they split; MKL
also splits GEMMs below ~100 MFLOP badly (`[768, 128] @ [128, 256]`: 0.57 ms on one thread, 0.64 ms of wall clock
and 0.87 ms of CPU on two; `[768, 8] @ [8, 128]`: 30 µs against 150). The kernels that split whole units of work
over the threads — the fused head's chunks (`csrc/fused_head.cpp`), the experts (`csrc/expert_by_expert_swiglu.cpp`)
— open one region per call and do gain. So `body_threads` runs a training step's other ops at one thread when its
activations are small (the trainer's rule: `step_threads.py`), `all_kernel_threads` gives the kernels every
thread the step was started with, and `fence_on_all_kernel_threads` does the same for a layer whose GEMM is large
enough to split (a dense MLP's 768 × 128 × 512). Two threads, 4 layers 128 wide, 768 tokens: Mixtral-shaped (8
experts) 0.84x the CPU time and 0.79x the wall clock of a step on every thread; dense with its MLPs fenced 0.93x
and 0.97x (benchmarks/RESULTS.md).

Thread counts are the calling thread's (OpenMP's and MKL's settings are per thread) and autograd runs a CPU
backward on the thread that called it, so the kernels' backward passes see the same settings as their forward.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

_kernel_threads: int | None = None  # while `body_threads` runs the ops at fewer: the threads the kernels get


def uses_fewer_threads() -> bool:
    """Whether `body_threads` runs the ops at fewer threads than the kernels get (and torch.compile is not
    tracing)."""
    return _kernel_threads is not None and not torch.compiler.is_compiling()


def kernel_threads() -> int:
    """The intra-op threads moetron's CPU kernels split their work over: all the step's, also inside
    `body_threads`."""
    return _kernel_threads or torch.get_num_threads()


@contextlib.contextmanager
def body_threads(threads: int) -> Iterator[None]:
    """Run the enclosed ops at `threads` intra-op threads (when fewer than now); the kernels inside keep the threads
    there were (`kernel_threads`, `all_kernel_threads`)."""
    global _kernel_threads
    before, outer = torch.get_num_threads(), _kernel_threads
    if threads >= before:
        yield
        return
    _kernel_threads = outer or before
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
        _kernel_threads = outer


@contextlib.contextmanager
def all_kernel_threads() -> Iterator[None]:
    """Inside a kernel that splits whole units of work over the threads: every thread `body_threads` set aside.
    Not while torch.compile traces (a compiled graph bakes its thread count in when it is built)."""
    wanted, now = _kernel_threads, torch.get_num_threads()
    if wanted is None or wanted == now or torch.compiler.is_compiling():
        yield
        return
    torch.set_num_threads(wanted)
    try:
        yield
    finally:
        torch.set_num_threads(now)


def on_all_kernel_threads(fn: Callable) -> Callable:
    """`fn` (a kernel's autograd forward or backward) inside `all_kernel_threads`."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if _kernel_threads is None or torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        with all_kernel_threads():
            return fn(*args, **kwargs)

    return run


def fence_on_all_kernel_threads(module: nn.Module) -> list[RemovableHandle]:
    """Run `module` (one whose GEMM splits well over the threads) forward and backward at every thread while
    `body_threads` runs the ops around it at fewer: hooks set the threads around its forward, and identity autograd
    nodes on its input and output set them around its backward (autograd runs a CPU backward on the calling thread,
    and reaches the output's node just before the module's own nodes and the input's just after). The values are
    the module's own at that thread count. Only a plain tensor input that needs its gradient is fenced for the
    backward: the input's node is what gives the threads back. Returns the hooks' handles."""
    fence: list[tuple[int, bool]] = []  # while the module's forward runs: (the body's threads, input fenced)

    def enter(module: nn.Module, args: tuple) -> tuple | None:
        fence.clear()
        if _kernel_threads is None or torch.compiler.is_compiling() or not args or type(args[0]) is not torch.Tensor:
            return None
        body, fenced_input = torch.get_num_threads(), torch.is_grad_enabled() and args[0].requires_grad
        fence.append((body, fenced_input))
        torch.set_num_threads(_kernel_threads)
        return (_ThreadsInBackward.apply(args[0], body),) + args[1:] if fenced_input else None

    def leave(module: nn.Module, args: tuple, output: object) -> object:
        if not fence:
            return None
        (body, fenced_input), kernel = fence.pop(), torch.get_num_threads()
        torch.set_num_threads(body)
        if not fenced_input or type(output) is not torch.Tensor:
            return None  # nothing would give the threads back after the module's backward
        return _ThreadsInBackward.apply(output, kernel)

    return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]


class _ThreadsInBackward(torch.autograd.Function):
    """Identity; its backward sets `threads` intra-op threads before the gradient flows on."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, threads: int) -> torch.Tensor:
        ctx.threads = threads
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        torch.set_num_threads(ctx.threads)
        return grad, None

"""The CPU experts backend (`CpuExperts`, the model's seam `model/backends.py`): SwiGLU experts run expert by
expert, huge-page hints for their weight gradients, the router's top-1 pick and the combine's row adds in C++.

This backend serves CPU tensors only (registered for the "cpu" device type), where reading the per-expert row
counts as host integers is free. On CUDA the grouped or batched backends run.

Token order (`tokens_N`, dropless top-1 from `LocalDispatcher`): x, y and their gradients are in the tokens' order,
and sorted row r is token tokens_N[r] (a permutation); each expert's rows are gathered before its GEMMs and its outputs
scattered after them, so that no permuted [N, D] copy of x, y or their gradients is made. The same GEMM operands,
so the same values as on rows sorted by expert.

Shape legend: N rows sorted by expert (rows past Σ counts are dropped routes, not computed), E experts,
D hidden size, F ffn size per expert.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import sys
import warnings
from collections.abc import Callable, Iterator

import torch

from moetron.cpu.compiled_kernels import compiled_cpu_kernels, first_max_column, index_add_rows
from moetron.cpu.threads import on_all_kernel_threads
from moetron.model.backends import ExpertsBackend

_HUGE_PAGE = 2 << 20
# Blocks of at least two huge pages (so that one aligned 2 MiB page lies inside) get the hint: glibc serves blocks
# over 32 MiB from a fresh mmap every time, and returns smaller heap blocks to the kernel too whenever a free
# leaves more than its trim threshold (2x the largest block it mmapped, <= 64 MiB) at the top of the heap.
_HINT_BYTES = 2 * _HUGE_PAGE
_MADV_HUGEPAGE = 14


@functools.cache
def _madvise() -> Callable | None:
    """libc's madvise on Linux, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def empty_for_gradient(like: torch.Tensor) -> torch.Tensor:
    """`torch.empty_like(like)`, backed by transparent huge pages when it is a large CPU buffer on Linux.

    An [E, D, F] weight gradient is a fresh mmap every step (zero_grad(set_to_none=True) frees it), and
    faulting it in 4 KiB at a time cost ~25 ms per 64 MiB here — a fifth of the layer's step at E=128.
    With the MADV_HUGEPAGE hint the kernel maps 2 MiB pages: ~6x less. Smaller blocks fault too: at E=8,
    D=512, F=1024 the 16 MiB gradients come from the heap, which glibc trims when zero_grad frees them, and the
    next backward faulted 16-20K pages back in (~50 ms system time of a ~1.3 s step; `benchmarks/RESULTS.md`).
    Only a hint: it changes no value, and anything unexpected leaves the plain allocation. (torch's
    THP_MEM_ALLOC_ENABLE does the same for every allocation, but must be set before torch starts.)
    """
    out = torch.empty_like(like)
    nbytes = out.numel() * out.element_size()
    madvise = _madvise() if out.device.type == "cpu" and nbytes >= _HINT_BYTES else None
    if madvise is not None:
        start = -(-out.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE  # the 2 MiB-aligned interior of the buffer
        end = (out.data_ptr() + nbytes) // _HUGE_PAGE * _HUGE_PAGE
        madvise(start, end - start, _MADV_HUGEPAGE)  # a refused hint (errno) changes nothing
    return out


class PythonLoop:
    """The reference engine of `ExpertByExpertSwiGLU`: its per-expert ATen calls from Python.

    Saves what autograd would (x·w1, x·w3, silu(x·w1) and the product, per expert): recomputing the last two in
    the backward, as this did before, was one silu and one mul per expert more, and measured ~3.5% slower on the
    whole layer at E=64, for two [N, F] activations less (16 MiB there; benchmarks/RESULTS.md, "MoE layer")."""

    def forward(self, x_ND, w1_EDF, w3_EDF, w2_EFD, counts: list[int], tokens_N=None):
        """(y_ND, activations for `backward`, h per expert)."""
        y_ND = x_ND.new_empty(x_ND.shape[0], w2_EFD.shape[-1])
        y_ND[sum(counts) :].zero_()  # rows past the counts (dropped routes) are not computed
        # Per-expert activation tensors, not one [N, F] buffer: allocations past glibc's 32 MiB mmap ceiling
        # get fresh pages every step, and faulting them in cost more system time than the GEMMs they feed.
        a_list, b_list, silu_list, h_list = [], [], [], []
        # Views made in bulk (split/unbind): the per-expert Python work is a visible cost at E = 128.
        for x_e, out_e, w1_DF, w3_DF, w2_FD in zip(  # out_e: the expert's rows of y (a view), or its tokens
            _expert_rows(x_ND, counts, tokens_N),
            _per_expert(y_ND, counts) if tokens_N is None else _per_expert(tokens_N, counts),
            *(w.unbind(0) for w in (w1_EDF, w3_EDF, w2_EFD)),
            strict=True,
        ):
            a_e, b_e = torch.mm(x_e, w1_DF), torch.mm(x_e, w3_DF)
            silu_e = torch.nn.functional.silu(a_e)
            h_e = silu_e * b_e
            if tokens_N is None:
                torch.mm(h_e, w2_FD, out=out_e)
            else:
                y_ND.index_copy_(0, out_e, torch.mm(h_e, w2_FD))
            a_list.append(a_e)
            b_list.append(b_e)
            silu_list.append(silu_e)
            h_list.append(h_e)
        return y_ND, (a_list, b_list, silu_list), h_list

    def backward(
        self, grad_ND, x_ND, w1_EDF, w3_EDF, w2_EFD, counts, activations, h_list, kept, grads, keep, tokens_N=None
    ):
        """Writes `grads` (grad_x, grad_w1, grad_w3, grad_w2; None: not wanted) and returns (da, db) per expert
        when `keep`. `activations` (consumed here: the in-place ops reuse them) or, once they are, `kept`."""
        grad_x, grad_w1, grad_w3, grad_w2 = grads
        if grad_x is not None:
            grad_x[sum(counts) :].zero_()
        num = len(counts)
        a_list, b_list, silu_list = activations if activations is not None else ([None] * num,) * 3
        da_kept, db_kept = [], []
        grad_x_rows = None if grad_x is None else _per_expert(grad_x if tokens_N is None else tokens_N, counts)
        per_expert = zip(
            _expert_rows(grad_ND, counts, tokens_N),
            # x is read for the weight gradients only: in token order no expert's rows are gathered without them
            _expert_rows(x_ND, counts, tokens_N) if grad_w1 is not None else [None] * num,
            a_list,
            b_list,
            silu_list,
            kept[0] if kept is not None else [None] * num,
            kept[1] if kept is not None else [None] * num,
            grad_x_rows if grad_x is not None else [None] * num,
            w1_EDF.transpose(1, 2).unbind(0),
            w3_EDF.transpose(1, 2).unbind(0),
            w2_EFD.transpose(1, 2).unbind(0),
            *((g.unbind(0) if g is not None else [None] * num) for g in (grad_w1, grad_w3, grad_w2)),
            strict=True,
        )
        want_w = grad_w1 is not None
        for e, (g_e, x_e, a_e, b_e, silu_e, da_e, db_e, gx_e, w1_FD, w3_FD, w2_DF, gw1_DF, gw3_DF, gw2_FD) in enumerate(
            per_expert
        ):
            if want_w:  # before the in-place ops below: h is read here only, so nothing else must go first
                torch.mm(h_list[e].t(), g_e, out=gw2_FD)
            if da_e is None:
                dh_e = torch.mm(g_e, w2_DF)
                # The autograd graph's MulBackward and SiluBackward, op for op (same products, so the same bits),
                # in place on the saved silu and on dh: both are dead after this, and fresh [n, F] buffers cost more.
                db_e = silu_e.mul_(dh_e)
                da_e = torch.ops.aten.silu_backward(dh_e.mul_(b_e), a_e)
            if want_w:
                x_DN = x_e.t()
                torch.mm(x_DN, da_e, out=gw1_DF)
                torch.mm(x_DN, db_e, out=gw3_DF)
            if gx_e is not None:  # the expert's rows of grad_x (a view), or its tokens
                if tokens_N is None:
                    torch.mm(da_e, w1_FD, out=gx_e).add_(torch.mm(db_e, w3_FD))
                else:
                    grad_x.index_copy_(0, gx_e, torch.mm(da_e, w1_FD).add_(torch.mm(db_e, w3_FD)))
            if keep:
                da_kept.append(da_e)
                db_kept.append(db_e)
        return (da_kept, db_kept) if keep else None


PYTHON_LOOP = PythonLoop()


def _expert_rows(t_NA: torch.Tensor, counts: list[int], tokens_N: torch.Tensor | None):
    """Each expert's rows of t: views of the sorted rows, or (token order) gathered copies, one expert at a time."""
    if tokens_N is None:
        return _per_expert(t_NA, counts)
    return (t_NA.index_select(0, tokens_e) for tokens_e in _per_expert(tokens_N, counts))


class CompiledLoop:
    """The same engine in C++ (`compiled_kernels.py`): the same values, without the interpreter between the calls
    and with the element-wise passes fused. Saves x·w1, x·w3 and silu's denominator 1 + exp(-x·w1) per expert (h
    is recomputed from them, and the backward needs no exp); a first pass of a split backward keeps (da, db, h)."""

    def __init__(self, module):
        self.module = module

    def forward(self, x_ND, w1_EDF, w3_EDF, w2_EFD, counts: list[int], tokens_N=None):
        y_ND, a_list, b_list, d_list = self.module.swiglu_forward(x_ND, w1_EDF, w3_EDF, w2_EFD, counts, tokens_N)
        return y_ND, (a_list, b_list, d_list), None

    def backward(
        self, grad_ND, x_ND, w1_EDF, w3_EDF, w2_EFD, counts, activations, h_list, kept, grads, keep, tokens_N=None
    ):
        a_list, b_list, d_list = activations if activations is not None else ([], [], [])
        da_kept, db_kept, h_kept = kept if kept is not None else ([], [], [])
        out = self.module.swiglu_backward(
            grad_ND, x_ND, w1_EDF, w3_EDF, w2_EFD, counts, a_list, b_list, d_list, da_kept, db_kept, h_kept, *grads,
            keep, tokens_N,
        )  # fmt: skip
        return out if keep else None


def swiglu_engine(x_ND: torch.Tensor, *weights: torch.Tensor) -> PythonLoop | CompiledLoop:
    """The C++ engine for plain contiguous fp32 CPU tensors where it loads (and matches the Python loop), else the
    Python loop. A tensor subclass (DTensor, FakeTensor, …) has no data of its own for the kernel to read: only
    ATen's dispatch, which the Python loop goes through, computes with it."""
    if all(_plain_fp32(t) for t in (x_ND, *weights)):
        engine = compiled_engine()
        if engine is not None:
            return engine
    return PYTHON_LOOP


def _plain_fp32(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.dtype == torch.float32 and t.is_contiguous()


@functools.cache
def compiled_engine() -> CompiledLoop | None:
    """The C++ engine, once per process: None where the kernel does not load, or computes a single bit differently
    from the Python loop here (one warning then)."""
    module = compiled_cpu_kernels()
    if module is None:
        return None
    engine = CompiledLoop(module)
    if not matches_the_python_loop(engine):
        warnings.warn(
            "moetron: the CPU expert kernel differs from the Python loop here; using the Python loop", stacklevel=2
        )
        return None
    return engine


def matches_the_python_loop(engine: CompiledLoop) -> bool:
    """Forward and backward of both on a small problem with vector-loop tails (F = 37), an expert without rows, a
    dropped-route tail and large activations (saturated exps), and again in token order (a permutation, no tail):
    every output and gradient bitwise equal — the kernel at this process's thread count, the Python loop at one
    thread (the kernel runs each expert on one thread: `python_loop_on_one_thread`)."""
    generator = torch.Generator().manual_seed(0)
    counts, hidden, ffn = [5, 0, 40, 3], 8, 37
    x_ND = torch.randn(sum(counts) + 2, hidden, generator=generator) * 30
    shapes = ((hidden, ffn), (hidden, ffn), (ffn, hidden))
    weights = [torch.randn(len(counts), *shape, generator=generator) for shape in shapes]
    grad_ND = torch.randn(x_ND.shape[0], hidden, generator=generator)
    tokens_N = torch.randperm(sum(counts), generator=generator)
    problems = [(grad_ND, x_ND, None), (grad_ND[: sum(counts)], x_ND[: sum(counts)], tokens_N)]
    with torch.no_grad():
        for grad, x, tokens in problems:
            ours = run_swiglu(engine, grad, x, *weights, counts, tokens)
            with python_loop_on_one_thread():
                reference = run_swiglu(PYTHON_LOOP, grad, x, *weights, counts, tokens)
            if not all(torch.equal(a, b) for a, b in zip(ours, reference, strict=True)):
                return False
    return True


@contextlib.contextmanager
def python_loop_on_one_thread() -> Iterator[None]:
    """One intra-op thread for the block: the Python loop's values the C++ engine computes at any thread count (it
    runs each expert's GEMMs and element-wise passes on one thread, the experts spread over the threads; MKL's and
    TensorIterator's own splits at two threads and more round some values differently)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_swiglu(
    engine, grad_ND, x_ND, w1_EDF, w3_EDF, w2_EFD, counts: list[int], tokens_N: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """[y, grad_x, grad_w1, grad_w3, grad_w2] of one forward and full backward of `engine` (no autograd)."""
    y_ND, activations, h_list = engine.forward(x_ND, w1_EDF, w3_EDF, w2_EFD, counts, tokens_N)
    grads = tuple(torch.empty_like(t) for t in (x_ND, w1_EDF, w3_EDF, w2_EFD))
    engine.backward(grad_ND, x_ND, w1_EDF, w3_EDF, w2_EFD, counts, activations, h_list, None, grads, False, tokens_N)
    return [y_ND, *grads]


class ExpertByExpertSwiGLU(torch.autograd.Function):
    """`(silu(x·w1) * (x·w3))·w2` on rows sorted by expert, running each expert's WHOLE MLP (and then its
    whole backward) before the next expert's.

    On CPU `torch._grouped_mm` is a loop of one mm per expert, so the three grouped projections stream
    every expert's rows and [N, F] activations through memory three times forward and more backward.
    Expert by expert, an expert's rows and activations are reused from cache by its next GEMM: ~10% less
    CPU time than the grouped projections (or one bmm per projection) at E=64, D=128, F=256.
    Same per-expert mm calls on the same operands as the grouped_mm fallback, so the same values.
    Two engines compute it (`swiglu_engine`): the C++ one for fp32 where it builds, else the Python loop
    (`PythonLoop`), with the same bits at one thread; at more the C++ engine keeps the one-thread values (each expert
    runs on one thread, the experts spread over the threads: `python_loop_on_one_thread`). `tokens_N`: x and y in
    token order (see the module docstring).
    """

    @staticmethod
    @on_all_kernel_threads
    def forward(ctx, x_ND, w1_EDF, w3_EDF, w2_EFD, counts: list[int], tokens_N: torch.Tensor | None = None):
        ctx.engine = swiglu_engine(x_ND, w1_EDF, w3_EDF, w2_EFD)
        y_ND, ctx.activations, ctx.h_list = ctx.engine.forward(x_ND, w1_EDF, w3_EDF, w2_EFD, counts, tokens_N)
        ctx.save_for_backward(x_ND, w1_EDF, w3_EDF, w2_EFD)
        ctx.counts, ctx.tokens_N = counts, tokens_N
        ctx.activation_grads = None  # (da, db) per expert, kept by a pass that leaves the rest to a later one
        ctx.input_grad_done = ctx.weight_grads_done = False
        return y_ND

    @staticmethod
    @on_all_kernel_threads
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_ND):
        """Zero bubble (`torch.distributed.pipelining`) calls this twice on one graph: once for the input gradient
        (autograd.grad w.r.t. the stage inputs) and once for the weight gradients, from the same output gradient.
        Each call computes only what its pass will use (`_wanted`), and the first keeps the SwiGLU's two
        activation gradients for the second: the same products as one full backward, so the same bits."""
        x_ND, w1_EDF, w3_EDF, w2_EFD = ctx.saved_tensors
        want_x, want_w = _wanted(ctx)
        if ctx.activations is None and ctx.activation_grads is None:
            raise RuntimeError(
                "ExpertByExpertSwiGLU: backward through this graph a second time (its activations are freed); "
                "call backward once, or once for the inputs and once for the weights"
            )
        grad_x = empty_for_gradient(x_ND) if want_x else None
        grads_w = tuple(empty_for_gradient(w) if want_w else None for w in (w1_EDF, w3_EDF, w2_EFD))
        ctx.input_grad_done |= want_x
        ctx.weight_grads_done |= want_w
        keep = not (ctx.input_grad_done and ctx.weight_grads_done)  # the other pass still comes
        ctx.activation_grads = ctx.engine.backward(
            grad_ND, x_ND, w1_EDF, w3_EDF, w2_EFD, ctx.counts, ctx.activations, ctx.h_list,
            ctx.activation_grads, (grad_x, *grads_w), keep, ctx.tokens_N,
        )  # fmt: skip
        ctx.activations = None  # consumed: the in-place ops reused them
        if want_w:  # the weight gradients are done: h was their last reader
            ctx.h_list = None
        return grad_x, *grads_w, None, None


def _wanted(ctx) -> tuple[bool, bool]:
    """(input gradient, weight gradients) that this backward call's pass will use.

    `ctx.needs_input_grad` is fixed at forward; which inputs the running autograd.grad reaches is the engine's
    (`_will_engine_execute_node`, what torch.utils.checkpoint asks too). It refuses leaf nodes inside
    autograd.grad, so the operands enter the Function as views (`expert_by_expert_swiglu`)."""
    needs_x, needs_w1, needs_w3, needs_w2 = ctx.needs_input_grad[:4]
    nodes = [node for node, _ in ctx.next_functions]

    def reached(i: int) -> bool:
        if nodes[i] is None:
            return False
        try:
            return torch._C._will_engine_execute_node(nodes[i])
        except RuntimeError:  # a leaf (a direct `apply` caller): assume needed, as `needs_input_grad` says
            return True

    want_w = (needs_w1 or needs_w3 or needs_w2) and any(reached(i) for i in (1, 2, 3))
    return needs_x and reached(0), want_w


def _per_expert(x_NA: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, ...]:
    """Each expert's rows (views made in bulk); rows past the counts are left out."""
    return x_NA.split([*counts, x_NA.shape[0] - sum(counts)])[: len(counts)]


def expert_by_expert_swiglu(
    x_ND: torch.Tensor,
    w1_EDF: torch.Tensor,
    w3_EDF: torch.Tensor,
    w2_EFD: torch.Tensor,
    counts_E: torch.Tensor,
    tokens_N: torch.Tensor | None = None,
) -> torch.Tensor:
    """`ExpertByExpertSwiGLU` on rows sorted by expert (rows past Σ counts_E: zero output, zero gradient), or with
    `tokens_N` on rows in token order (sorted row r is token tokens_N[r]; y comes back in token order).

    Reads the counts on the host (`.tolist()`): free on a CPU, which is the only place it runs."""
    with torch.autocast(device_type=x_ND.device.type, enabled=False):  # operands are already in compute dtype
        # Leaves enter as views (no copy), so that no operand is a leaf of the Function: see `_wanted`. Only leaves:
        # the gradient of a view is a view, which autograd cannot add the router's input gradient into in place (a
        # fresh [T, D] sum instead, ~2 ms at T=8192, D=128, when x is the layer's input in token order).
        operands = (t.view_as(t) if t.requires_grad and t.is_leaf else t for t in (x_ND, w1_EDF, w3_EDF, w2_EFD))
        return ExpertByExpertSwiGLU.apply(*operands, counts_E.tolist(), tokens_N)


class CpuExperts(ExpertsBackend):
    """The MoE layer's CPU kernels: each the same bits as ATen's op it replaces (tests/unit/cpu/)."""

    def first_max_column(self, x_TE: torch.Tensor) -> torch.Tensor | None:
        return first_max_column(x_TE)

    def index_add_rows(self, out_TD: torch.Tensor, index_R: torch.Tensor, src_RD: torch.Tensor) -> torch.Tensor:
        return index_add_rows(out_TD, index_R, src_RD)

    def runs_swiglu(self, x_ND: torch.Tensor) -> bool:
        return x_ND.device.type == "cpu"

    def swiglu(self, x_ND, w1_EDF, w3_EDF, w2_EFD, counts_E, tokens_N=None) -> torch.Tensor:
        return expert_by_expert_swiglu(x_ND, w1_EDF, w3_EDF, w2_EFD, counts_E, tokens_N)


CPU_EXPERTS = CpuExperts()

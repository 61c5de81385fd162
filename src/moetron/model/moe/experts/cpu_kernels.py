"""CPU-only expert kernels: SwiGLU experts run expert by expert, and huge-page hints for weight gradients.

`GroupedExperts` runs these only where reading the device is free (`host_reads_are_free`: a CPU tensor),
because they take the per-expert row counts as host integers. On CUDA the grouped or batched backends run.

Shape legend: N rows sorted by expert (rows past Σ counts are dropped routes, not computed), E experts,
D hidden size, F ffn size per expert.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable

import torch

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


class ExpertByExpertSwiGLU(torch.autograd.Function):
    """`(silu(x·w1) * (x·w3))·w2` on rows sorted by expert, running each expert's WHOLE MLP (and then its
    whole backward) before the next expert's.

    On CPU `torch._grouped_mm` is a loop of one mm per expert, so the three grouped projections stream
    every expert's rows and [N, F] activations through memory three times forward and more backward.
    Expert by expert, an expert's rows and activations are reused from cache by its next GEMM: ~10% less
    CPU time than the grouped projections (or one bmm per projection) at E=64, D=128, F=256.
    Same per-expert mm calls on the same operands as the grouped_mm fallback, so the same values.
    Saves what autograd would (x·w1, x·w3, silu(x·w1) and the product, per expert): recomputing the last two in
    the backward, as this did before, was one silu and one mul per expert more, and measured ~3.5% slower on the
    whole layer at E=64, for two [N, F] activations less (16 MiB there; benchmarks/RESULTS.md, "MoE layer").
    """

    @staticmethod
    def forward(ctx, x_ND, w1_EDF, w3_EDF, w2_EFD, counts: list[int]):
        y_ND = x_ND.new_empty(x_ND.shape[0], w2_EFD.shape[-1])
        y_ND[sum(counts) :].zero_()  # rows past the counts (dropped routes) are not computed
        # Per-expert activation tensors, not one [N, F] buffer: allocations past glibc's 32 MiB mmap ceiling
        # get fresh pages every step, and faulting them in cost more system time than the GEMMs they feed.
        a_list, b_list, silu_list, h_list = [], [], [], []
        # Views made in bulk (split/unbind): the per-expert Python work is a visible cost at E = 128.
        for x_e, y_e, w1_DF, w3_DF, w2_FD in zip(
            _per_expert(x_ND, counts),
            _per_expert(y_ND, counts),
            *(w.unbind(0) for w in (w1_EDF, w3_EDF, w2_EFD)),
            strict=True,
        ):
            a_e, b_e = torch.mm(x_e, w1_DF), torch.mm(x_e, w3_DF)
            silu_e = torch.nn.functional.silu(a_e)
            h_e = silu_e * b_e
            torch.mm(h_e, w2_FD, out=y_e)
            a_list.append(a_e)
            b_list.append(b_e)
            silu_list.append(silu_e)
            h_list.append(h_e)
        ctx.save_for_backward(x_ND, w1_EDF, w3_EDF, w2_EFD)
        ctx.activations, ctx.counts = (a_list, b_list, silu_list, h_list), counts
        return y_ND

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_ND):
        x_ND, w1_EDF, w3_EDF, w2_EFD = ctx.saved_tensors
        counts = ctx.counts
        grad_x = empty_for_gradient(x_ND) if ctx.needs_input_grad[0] else None
        if grad_x is not None:
            grad_x[sum(counts) :].zero_()
        grad_w1, grad_w3, grad_w2 = (empty_for_gradient(w) for w in (w1_EDF, w3_EDF, w2_EFD))
        per_expert = zip(
            _per_expert(grad_ND, counts),
            _per_expert(x_ND, counts),
            *ctx.activations,
            _per_expert(grad_x, counts) if grad_x is not None else [None] * len(counts),
            w1_EDF.transpose(1, 2).unbind(0),
            w3_EDF.transpose(1, 2).unbind(0),
            w2_EFD.transpose(1, 2).unbind(0),
            grad_w1.unbind(0),
            grad_w3.unbind(0),
            grad_w2.unbind(0),
            strict=True,
        )
        for g_e, x_e, a_e, b_e, silu_e, h_e, gx_e, w1_FD, w3_FD, w2_DF, gw1_DF, gw3_DF, gw2_FD in per_expert:
            torch.mm(h_e.t(), g_e, out=gw2_FD)
            dh_e = torch.mm(g_e, w2_DF)
            # The autograd graph's MulBackward and SiluBackward, op for op (same products, so the same bits), in
            # place on the saved silu and on dh: both are dead after this, and fresh [n, F] buffers cost more.
            db_e = silu_e.mul_(dh_e)
            da_e = torch.ops.aten.silu_backward(dh_e.mul_(b_e), a_e)
            x_DN = x_e.t()
            torch.mm(x_DN, da_e, out=gw1_DF)
            torch.mm(x_DN, db_e, out=gw3_DF)
            if gx_e is not None:
                torch.mm(da_e, w1_FD, out=gx_e).add_(torch.mm(db_e, w3_FD))
        ctx.activations = None
        return grad_x, grad_w1, grad_w3, grad_w2, None


def _per_expert(x_NA: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, ...]:
    """Each expert's rows (views made in bulk); rows past the counts are left out."""
    return x_NA.split([*counts, x_NA.shape[0] - sum(counts)])[: len(counts)]


def expert_by_expert_swiglu(
    x_ND: torch.Tensor, w1_EDF: torch.Tensor, w3_EDF: torch.Tensor, w2_EFD: torch.Tensor, counts_E: torch.Tensor
) -> torch.Tensor:
    """`ExpertByExpertSwiGLU` on rows sorted by expert (rows past Σ counts_E: zero output, zero gradient).

    Reads the counts on the host (`.tolist()`): free on a CPU, which is the only place it runs."""
    with torch.autocast(device_type=x_ND.device.type, enabled=False):  # operands are already in compute dtype
        return ExpertByExpertSwiGLU.apply(x_ND, w1_EDF, w3_EDF, w2_EFD, counts_E.tolist())

"""The CPU head-loss backend: the fused LM head's (`model/fused_cross_entropy.py`) chunk size, scratch memory, softmax
and fp32 chunk loop on CPU, and the word-embedding lookup whose [V, C] gradient shares the head's memory.

    CPU_HEAD_LOSS.chunk_tokens(N, C, V, threads)   # cache-sized chunks, whole chunks per thread
    CPU_HEAD_LOSS.fused_head_forward(ctx, ...)      # fp32: the whole chunk loop in C++, a thread per chunk

What it changes against ATen's path, each for speed and none for the values beyond fp32 rounding:
  - chunks of ~8 MiB of fp32 logits (at least 256 rows), spread a chunk per thread (`cpu_head_workers`);
  - the softmax in one exp per logit (`csrc/softmax_gradient_rows.cpp`): the chunk becomes exp(x − max) − Σ·one-hot
    = Σ · (softmax − one-hot) in place, and 1 / Σ joins the row factor that already scales the [M, C] side of the
    gradient GEMMs; ATen's log_softmax, exp_ and one-hot subtraction agree with it to fp32 rounding;
  - fp32: the whole chunk loop in C++ (`csrc/fused_head.cpp`) with a thread per chunk rather than every thread in
    each of its GEMMs, in rounds of a chunk per thread, each thread then writing its share of dW's vocabulary from
    the round's chunks; within a chunk block by block of 2048 vocabulary columns (an online softmax), so that a
    block stays in cache from its logits GEMM to its dx product. dW is the chunks' products added in chunk order at
    any thread count, so at the same chunk size every thread count computes the same bits;
  - dW as [V, C] where MKL runs that GEMM faster (`weight_grad_as_rows`: all but AVX-512);
  - the chunk and dW buffers reused across steps (`CpuBufferPool`), the [V, C] gradients too
    (`gradient_memory.py`), and a tied embedding's gradient added into the head's;
  - forward and backward on every thread the step was started with (`threads.py`).

Shape legend: N tokens, C hidden size, V (padded) vocabulary, M tokens per chunk.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch

from moetron.cpu.compiled_kernels import fused_head_kernels, softmax_gradient_rows
from moetron.cpu.gradient_memory import GRADIENT_MEMORY, embedding_lookup, leave_for_lookup, lookup_slot
from moetron.cpu.threads import all_kernel_threads, kernel_threads, uses_fewer_threads
from moetron.model.backends import HeadLossBackend
from moetron.model.fused_cross_entropy import weight_grad_buffer

# One chunk's fp32 logits are ~8 MiB, so that they stay in cache between the GEMM, the softmax and the two gradient
# GEMMs, but at least 256 rows: every chunk re-reads the whole [C, V] head weight three times, and at V = 50k a
# 64-row floor (12 chunks for 768 tokens) made the GEMMs memory-bound — at two threads the logits GEMM cost 45% more
# CPU than at one, and a training step was 24% slower than with 256 rows (benchmarks/e2e.py, RESULTS).
# Several threads (csrc/fused_head.cpp): a thread per chunk holds a chunk buffer of its own; at most this much of
# them at once, else one chunk at a time with every thread in its GEMMs.
CPU_CHUNK_BYTES = 8 * 2**20
CPU_WORKER_BYTES = 2**30
SOFTMAX_BLOCK_BYTES = 2 * 2**20
MIN_CPU_ROWS = 256


def cpu_chunk_tokens(num_tokens: int, hidden: int, vocab: int, threads: int = 1) -> int:
    """Tokens per chunk for N tokens of width C against a V-word vocabulary at `threads` intra-op threads: the chunk
    that gives each of `cpu_head_workers` threads the same number of rows."""
    rows = max(MIN_CPU_ROWS, CPU_CHUNK_BYTES // (4 * vocab))
    workers = cpu_head_workers(num_tokens, hidden, vocab, threads, rows)
    per_worker = -(-num_tokens // workers)
    # whole chunks of at least `rows` rows each, as many per worker as fit: 768 tokens at two threads are two
    # chunks of 384 rather than four of 192 (MKL runs its GEMMs ~1.2x faster at 384 rows than at 192)
    chunks = workers * max(1, per_worker // rows)
    return max(1, -(-num_tokens // chunks))


def cpu_head_workers(num_tokens: int, hidden: int, vocab: int, threads: int, rows: int) -> int:
    """Threads that run whole chunks of `rows` rows each (csrc/fused_head.cpp): every intra-op thread while each has
    a chunk and their chunk buffers fit in CPU_WORKER_BYTES, else 1 (one chunk at a time, every thread in its
    GEMMs)."""
    workers = min(threads, -(-num_tokens // rows)) if num_tokens else 1
    if workers > 1 and workers * min(rows, num_tokens) * vocab * 4 > CPU_WORKER_BYTES:
        return 1
    return max(1, workers)


@functools.cache
def _cpu_capability() -> str:
    return torch.backends.cpu.get_cpu_capability()


class CpuBufferPool:
    """Reused CPU buffers for the head's [M, V] chunk and its [C, V] weight gradient, across steps.

    A fresh buffer is page-faulted in and zeroed by the kernel on every step before the GEMM overwrites it; at two
    threads both threads fault. At M = 256, V = 50304 (51 MB + 25 MB) reusing them costs 3–5% less CPU for the whole
    head at one thread and 2–6% less at two (THP on; fused_head.py's shape, interleaved A/B). A buffer is taken for
    as long as it is in use (the chunk: one forward; the weight gradient: until its backward), so two heads in
    flight never share one; at most `keep` free buffers are kept. Elsewhere than CPU `take` allocates."""

    def __init__(self, keep: int = 4):
        self.keep = keep
        self._free: OrderedDict[tuple, list[torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        key = (tuple(shape), dtype)
        with self._lock:
            free = self._free.get(key)
            if free:
                buffer = free.pop()
                if not free:
                    del self._free[key]
                return buffer
        return torch.empty(shape, dtype=dtype)

    def keep_at_least(self, count: int) -> None:
        """Keep up to `count` free buffers (a thread per chunk takes one per thread, and one for dW)."""
        self.keep = max(self.keep, count)

    def give(self, buffer: torch.Tensor) -> None:
        if buffer.device.type != "cpu":
            return
        key = (tuple(buffer.shape), buffer.dtype)
        with self._lock:
            self._free.setdefault(key, []).append(buffer)
            self._free.move_to_end(key)
            while sum(len(free) for free in self._free.values()) > self.keep:
                oldest = next(iter(self._free))
                self._free[oldest].pop(0)
                if not self._free[oldest]:
                    del self._free[oldest]


class CpuHeadLoss(HeadLossBackend):
    """The fused head's CPU kernels, memory and threads (module docstring)."""

    def __init__(self):
        self.buffers = CpuBufferPool()

    def lookup(self, tokens_BT: torch.Tensor, weight_VC: torch.Tensor) -> torch.Tensor:
        return embedding_lookup(tokens_BT, weight_VC)

    def kernel_threads(self) -> int:
        return kernel_threads()

    @contextlib.contextmanager
    def on_kernel_threads(self) -> Iterator[None]:
        if not uses_fewer_threads():
            yield
            return
        with all_kernel_threads():
            yield

    def chunk_tokens(self, num_tokens: int, hidden: int, vocab: int, threads: int) -> int:
        return cpu_chunk_tokens(num_tokens, hidden, vocab, threads)

    def softmax_block_rows(self, vocab: int, threads: int) -> int:
        """One thread: ~2 MiB of fp32 logits (a core's L2), so a block stays cached from its log_softmax to its exp —
        7% less CPU for that part than one block per chunk (256 × 50304). More threads: the whole chunk — every block
        is parallel regions of its own, and at two threads cache-sized blocks cost more in thread wake-ups than the
        cache saves (13.2 vs 10.7 ms per chunk)."""
        return max(1, SOFTMAX_BLOCK_BYTES // (4 * vocab)) if threads == 1 else 2**62

    def weight_grad_as_rows(self, device: torch.device) -> bool:
        """Which GEMM MKL runs faster depends on the CPU: with AVX-512 (the Intel machine of benchmarks/RESULTS.md,
        issue 28 third pass) xᵀ · G took 21.4 ms per 256-row chunk against 31.9 for Gᵀ · x; with AVX2 (AMD EPYC,
        issue 28 session 42) Gᵀ · x runs at 75–81 GFLOP/s against 65–73 at 256–768 rows, one thread and a thread's
        half of V alike, and the [V, C] layout also saves the backward's pass over dW."""
        return device.type == "cpu" and not _cpu_capability().startswith("AVX512")

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.buffers.take(shape, dtype, device)

    def give(self, buffer: torch.Tensor) -> None:
        self.buffers.give(buffer)

    def keep_at_least(self, count: int) -> None:
        self.buffers.keep_at_least(count)

    def take_gradient(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return GRADIENT_MEMORY.take(shape, dtype, device)

    def softmax_gradient_rows(
        self, logits_MV: torch.Tensor, labels_M: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        return softmax_gradient_rows(logits_MV, labels_M)

    def fused_head_forward(self, ctx: Any, x_NC, w_VC, labels_N, weight_N, chunk: int, grad_scale: float):
        kernels = fused_head_kernels(x_NC, w_VC, weight_N)
        if kernels is None:
            return None
        with torch.autocast("cpu", enabled=False):
            return self._forward_threads(ctx, kernels, x_NC, w_VC, labels_N, weight_N, chunk, grad_scale)

    def _forward_threads(self, ctx, kernels, x_NC, w_VC, labels_N, weight_N, chunk: int, grad_scale: float):
        """fp32: the chunk loop in C++, a thread per chunk (csrc/fused_head.cpp); its buffers from the pool."""
        needs_dx, needs_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        num_tokens, hidden = x_NC.shape
        vocab = w_VC.shape[0]
        workers = cpu_head_workers(num_tokens, hidden, vocab, torch.get_num_threads(), chunk)
        self.keep_at_least(workers + 1)
        rows = min(chunk, num_tokens) or 1
        logits = [self.take((rows, vocab), torch.float32, x_NC.device) for _ in range(workers)]
        dw = weight_grad_buffer(ctx, w_VC, self) if needs_dw else None
        dx_NC = torch.empty_like(x_NC, memory_format=torch.contiguous_format) if needs_dx else None
        try:
            loss = kernels.fused_head_forward(
                x_NC.contiguous(),
                w_VC.contiguous(),
                labels_N.contiguous(),
                weight_N.contiguous(),
                grad_scale,
                chunk,
                logits,
                dx_NC,
                dw,
                needs_dw and ctx.dw_as_rows,
            )
        finally:
            for buffer in logits:
                self.give(buffer)
        ctx.grads = (dx_NC, dw)
        return loss

    def transpose_scaled(self, dw_CV: torch.Tensor, ratio: torch.Tensor, out_VC: torch.Tensor) -> bool:
        kernels = fused_head_kernels(dw_CV, out_VC)
        if kernels is None:
            return False
        kernels.transpose_scaled(dw_CV, ratio.float(), out_VC)
        return True

    def lookup_slot(self, weight_VC: torch.Tensor) -> Any:
        return lookup_slot(weight_VC)

    def leave_for_lookup(self, slot: Any, grad_VC: torch.Tensor) -> None:
        leave_for_lookup(slot, grad_VC)


CPU_HEAD_LOSS = CpuHeadLoss()

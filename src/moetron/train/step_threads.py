"""How many intra-op threads a CPU training step gives the ops outside moetron's kernels (`model/cpu_threads.py`:
why, and how the kernels keep every thread)."""

from __future__ import annotations

import torch
from torch import nn

from moetron.model.moe.experts.grouped import GroupedExperts
from moetron.model.moe.routing.router import Router

# the smallest GEMM (2·M·K·N FLOPs) whose MKL split over two threads pays on this project's 2-core machine: 768 ×
# 128 × 512 (100 MFLOP) takes 0.61x the wall clock at 1.07x the CPU, 768 × 128 × 256 (50 MFLOP) 1.12x at 1.53x
MIN_THREADED_GEMM_FLOPS = 96e6


def step_threads(model: nn.Module, rows: int, threads: int) -> int:
    """Intra-op threads for a CPU training step's ops outside moetron's kernels: `threads` when the model's largest
    such GEMM on `rows` rows (a micro-batch's tokens) has at least MIN_THREADED_GEMM_FLOPS, else 1."""
    if threads <= 1:
        return threads
    return threads if largest_body_gemm_flops(model, rows) >= MIN_THREADED_GEMM_FLOPS else 1


def largest_body_gemm_flops(model: nn.Module, rows: int) -> float:
    """FLOPs of the largest GEMM a forward on `rows` rows runs through ATen rather than moetron's kernels: the
    linear layers but the output layer (the fused head's), and experts the expert kernel does not run (GELU or
    biased experts: a GEMM per expert of its share of the routed rows)."""
    topk = max((m.topk for m in model.modules() if isinstance(m, Router)), default=1)
    largest = 0.0
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and not name.endswith("output_layer"):
            out_features, in_features = _local_shape(module.weight)
            largest = max(largest, 2.0 * rows * in_features * out_features)
        elif isinstance(module, GroupedExperts) and not module.runs_expert_kernel_on_cpu():
            expert_rows = rows * (topk if module.num_global_experts > 1 else 1) / module.num_global_experts
            _, hidden, ffn = _local_shape(module.w1_EDF)
            largest = max(largest, 2.0 * expert_rows * hidden * ffn)
    return largest


def _local_shape(weight: torch.Tensor) -> tuple[int, ...]:
    """This rank's shape of a weight (a tensor-parallel DTensor's local shard)."""
    return tuple(getattr(weight, "_local_tensor", weight).shape)

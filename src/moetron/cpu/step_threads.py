"""How many intra-op threads a CPU training step gives the ops outside moetron's kernels, and which layers get every
thread back (`threads.py`: why, and how).

    threads = fence_step_threads(model, rows, hidden_size)   # the trainer, once, on CPU without --compile
    with body_threads(threads): step()
"""

from __future__ import annotations

import torch
from torch import nn

from moetron.cpu.threads import fence_on_all_kernel_threads
from moetron.model.moe.experts.grouped import GroupedExperts
from moetron.model.moe.routing.router import Router

# the smallest GEMM (2·M·K·N FLOPs) whose MKL split over two threads pays on this project's 2-core machine: 768 ×
# 128 × 512 (100 MFLOP) takes 0.61x the wall clock at 1.07x the CPU, 768 × 128 × 256 (50 MFLOP) 1.12x at 1.53x
MIN_THREADED_GEMM_FLOPS = 96e6
# the smallest activations (rows × hidden) whose element-wise ops pay for waking a second thread: layer_norm + GELU +
# residual add, forward and backward, take 1.50x the wall clock (1.67x the CPU) on two threads at [768, 128],
# 0.85x (1.21x) at [1536, 128], 0.59x (0.89x) at [3072, 128] (`OMP_WAIT_POLICY=PASSIVE`)
MIN_THREADED_BODY_ELEMENTS = 2**17


def step_threads(rows: int, hidden_size: int, threads: int) -> int:
    """Intra-op threads for a CPU training step's ops outside moetron's kernels: 1 when a micro-batch's activations
    (`rows` tokens × `hidden_size`) are below MIN_THREADED_BODY_ELEMENTS, else `threads`."""
    return 1 if rows * hidden_size < MIN_THREADED_BODY_ELEMENTS else threads


def fence_step_threads(model: nn.Module, rows: int, hidden_size: int) -> int:
    """The intra-op threads for the ops of a step on `rows` tokens outside moetron's kernels (`step_threads`); with
    fewer than now, the layers whose GEMMs split well are fenced to run on every thread (`threaded_gemm_layers`)."""
    threads = torch.get_num_threads()
    body = step_threads(rows, hidden_size, threads)
    if body < threads:
        for layer in threaded_gemm_layers(model, rows):
            fence_on_all_kernel_threads(layer)
    return body


def threaded_gemm_layers(model: nn.Module, rows: int) -> list[nn.Module]:
    """The layers whose GEMM on `rows` rows (a micro-batch's tokens) splits well over the threads (at least
    MIN_THREADED_GEMM_FLOPS) and runs through ATen rather than moetron's kernels: linear layers but the output layer
    (the fused head's), and experts the expert kernel does not run (GELU or biased experts: a GEMM per expert of its
    share of the routed rows). A step on fewer threads runs them on every thread (`fence_on_all_kernel_threads`)."""
    topk = max((m.topk for m in model.modules() if isinstance(m, Router)), default=1)
    layers = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and not name.endswith("output_layer"):
            out_features, in_features = _local_shape(module.weight)
            flops = 2.0 * rows * in_features * out_features
        elif isinstance(module, GroupedExperts) and not module.runs_experts_backend_on_cpu():
            expert_rows = rows * (topk if module.num_global_experts > 1 else 1) / module.num_global_experts
            _, hidden, ffn = _local_shape(module.w1_EDF)
            flops = 2.0 * expert_rows * hidden * ffn
        else:
            continue
        if flops >= MIN_THREADED_GEMM_FLOPS:
            layers.append(module)
    return layers


def _local_shape(weight: torch.Tensor) -> tuple[int, ...]:
    """This rank's shape of a weight (a tensor-parallel DTensor's local shard)."""
    return tuple(getattr(weight, "_local_tensor", weight).shape)

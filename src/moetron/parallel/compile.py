"""`--compile`: `torch.compile` each transformer block (torchtitan's per-block compile).

Blocks are compiled one by one rather than the whole model: one compiled block's code is reused by every layer
of the same shape (compile time does not grow with depth). `nn.Module.compile` compiles in place, so parameter
names stay unchanged. Inductor is told to draw random numbers with the eager kernels (`fallback_random`): dropout
masks and routing draws then stay those of the layer's own stream (`moetron.model.rng`), so a compiled run
reproduces the eager one and every parallel layout. Every pipeline schedule composes, zero bubble included (see
`apply_compile`'s `split_backward`).

Inside a MoE block everything with static shapes is compiled: norms, attention, router, shared experts, residual
adds, and the local token dispatch (the permute and unpermute of `dispatch.py` move exactly T·K rows whatever the
routing, so no shape depends on the data). What stays eager (`torch.compiler.disable`, a graph break):
  - the experts, except on CUDA in bf16 with the grouped-GEMM kernel. The CPU runs them expert by expert from host
    counts (`moetron/cpu/experts.py`), `torch._grouped_mm` has no fp32 fake-tensor rule (Inductor traces its
    bf16 form only), and the batched backend reads the largest count in dropless mode (a new shape per value);
  - an expert-parallel dispatcher: its all-to-all split sizes are host integers read from the device;
  - context parallelism's attention (`attend_fn`, `parallel/cp/`) and the router's all-reduce of the per-sequence
    route fractions (`sequence_mean`): collectives inside autograd Functions, whose ring variant posts
    `batch_isend_irecv` (which Dynamo cannot trace). Everything around them in the block still compiles; the
    eager attention is the same SDPA (or ring) call, so a compiled CP run follows the eager CP curve.
"""

from __future__ import annotations

import torch

from moetron.model.gpt import GPTModel
from moetron.model.moe.dispatch import LocalDispatcher
from moetron.model.moe.experts.backends import cuda_grouped_mm_is_a_grouped_kernel, grouped_mm_supported
from moetron.model.moe.experts.grouped import GroupedExperts


def experts_are_traceable(experts: GroupedExperts, device: torch.device, compute_dtype: torch.dtype) -> bool:
    """Whether the experts' forward compiles into the block's graph: one grouped GEMM per projection (CUDA, bf16,
    sm90/sm100), no host read."""
    if device.type != "cuda" or compute_dtype != torch.bfloat16 or experts.backend not in ("auto", "grouped_mm"):
        return False
    rocm = torch.version.hip is not None
    grouped = cuda_grouped_mm_is_a_grouped_kernel(compute_dtype, torch.cuda.get_device_capability(device), rocm)
    return grouped and grouped_mm_supported(device, compute_dtype, experts.hidden, experts.ffn)


def apply_compile(
    model: GPTModel,
    enabled: bool,
    device: torch.device | str = "cpu",
    compute_dtype: torch.dtype = torch.float32,
    split_backward: bool = False,
) -> None:
    """`split_backward`: the pipeline schedule (zero bubble) runs each block's backward in two `autograd.grad`
    calls, input gradients first with `retain_graph=True`, then weight gradients over the same graph. A compiled
    block's backward is one node that computes both, so it runs twice (the results are exact); AOTAutograd's
    donated buffers (saved tensors the backward frees as it goes) forbid running it with `retain_graph`, so they
    are switched off — process-wide, since AOTAutograd reads the flag when it compiles, at the first call.
    AOTAutograd's cache is off there too: it writes a block's entry when the block's backward first compiles, inside
    the split backward, and for a block whose graph breaks between views and their use (attention dropout's stream
    swap after the bias-free QKV projection) pickling that entry segfaulted, or wrote one that a later run read as a
    garbage view shape (tests/distributed/test_zero_bubble_compile.py). Inductor's own cache stays on."""
    if not enabled:
        return
    import torch._inductor.config as inductor_config

    inductor_config.fallback_random = True
    if split_backward:
        import torch._functorch.config as functorch_config

        functorch_config.donated_buffer = False
        functorch_config.enable_autograd_cache = False  # see above: crashed on 2 processes, not on one
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    device = torch.device(device)
    for _, layer in model.layer_items():
        if layer.is_moe:
            moe = layer.mlp
            if experts_are_traceable(moe.experts, device, compute_dtype):
                moe.experts.backend = "grouped_mm"  # what `auto` picks here, resolved now: no probe in the graph
            else:
                moe.experts.forward = torch.compiler.disable(moe.experts.forward)
            if not isinstance(moe.dispatcher, LocalDispatcher):
                moe.dispatcher.dispatch = torch.compiler.disable(moe.dispatcher.dispatch)
                moe.dispatcher.combine = torch.compiler.disable(moe.dispatcher.combine)
            if moe.router.sequence_mean is not None:
                moe.router.sequence_mean = torch.compiler.disable(moe.router.sequence_mean)
        attention = layer.self_attention
        if getattr(attention, "attend_fn", None) is not None:  # context parallelism (applied before this step)
            attention.attend_fn = torch.compiler.disable(attention.attend_fn)
        layer.compile()

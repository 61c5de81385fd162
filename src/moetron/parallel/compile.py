"""`--compile`: `torch.compile` each transformer block (torchtitan's per-block compile).

Blocks are compiled one by one rather than the whole model: one compiled block's code is reused by every layer
of the same shape (compile time does not grow with depth). Inside a MoE block the token dispatch and the grouped
expert GEMMs stay eager (`torch.compiler.disable` on this layer's experts and dispatcher): their shapes depend on
how many tokens each expert got, and `torch._grouped_mm` has no fake-tensor rule for fp32 (Inductor only traces
its bf16 form), so the graph breaks around them and everything else in the block (norms, attention, router,
shared experts, residual adds) is compiled. `nn.Module.compile` compiles in place, so parameter names stay
unchanged. Inductor is told to draw random numbers with the eager kernels
(`fallback_random`): dropout masks and routing draws then stay those of the layer's own stream
(`moetron.model.rng`), so a compiled run reproduces the eager one and every parallel layout.
"""

from __future__ import annotations

import torch

from moetron.model.gpt import GPTModel


def apply_compile(model: GPTModel, enabled: bool) -> None:
    if not enabled:
        return
    import torch._inductor.config as inductor_config

    inductor_config.fallback_random = True
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    for _, layer in model.layer_items():
        if layer.is_moe:
            moe = layer.mlp
            moe.experts.forward = torch.compiler.disable(moe.experts.forward)
            moe.dispatcher.dispatch = torch.compiler.disable(moe.dispatcher.dispatch)
            moe.dispatcher.combine = torch.compiler.disable(moe.dispatcher.combine)
        layer.compile()

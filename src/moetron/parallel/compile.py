"""`--compile`: `torch.compile` each transformer block (torchtitan's per-block compile).

Blocks are compiled one by one rather than the whole model: one compiled block's code is reused by every layer
of the same shape (compile time does not grow with depth), and the MoE dispatch's data-dependent parts
(token counts per expert) only break the graph inside MoE blocks. `nn.Module.compile` compiles in place, so
parameter names stay unchanged. Inductor is told to draw random numbers with the eager kernels
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
        layer.compile()

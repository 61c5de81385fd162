"""SDPA on fake CUDA tensors: decide the kernel a GPU would take, and call that kernel's aten op.

Without a CUDA runtime `F.scaled_dot_product_attention` always takes the math kernel, with its own dtype and
memory. Here the choice follows PyTorch's CUDA selection (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp,
default priority flash → efficient → math → cuDNN, on an sm90 device) for the shapes, dtypes and mask of the call,
and the chosen kernel's private aten op runs, so its meta function checks the arguments as the CUDA kernel does
and autograd records that kernel's backward:

  flash      fp16/bf16, no mask, q/k and v head dims equal, at most 256 and a multiple of 8, causal only for
             equal query and key lengths; grouped-query attention (fewer key/value heads) supported
  efficient  fp16/bf16/fp32, any additive or boolean mask, head dims multiples of 8 (fp32: 4), v's may differ
             from q/k's; the same number of heads for q, k and v
  math       anything else (a GPU-path smell: slow, and fp32 internals)

A bottom-right causal bias (`torch.nn.attention.bias.causal_lower_right`, what context parallelism's all-gather
variant passes for each chunk) is no mask to flash: FlashAttention-2's causal flag is bottom-right aligned for
unequal query and key lengths, so it takes flash where the rest allows (as torch's own `CausalBias` dispatch does);
elsewhere it becomes the mask it stands for.

Autocast casts SDPA's inputs to the autocast dtype on a GPU; a private op is not on autocast's list, so the cast
is made here. `CHOICES` counts the kernels taken (the worker reads and resets it per step): the fused kernels' ops
where they run (`observe.py`, so a direct call, as ring attention's, counts too), the math kernel here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from torch.nn.attention.bias import CausalBias, CausalVariant

KERNELS = ("flash", "efficient", "cudnn", "math")
CHOICES: Counter = Counter()
MATH_FALLBACK: Callable | None = None  # torch's own F.scaled_dot_product_attention (set by patches.patch_sdpa)
HALF = (torch.float16, torch.bfloat16)


def flash_eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, is_causal: bool) -> bool:
    if mask is not None or q.dtype not in HALF or q.dim() != 4:
        return False
    head = q.shape[-1]
    if v.shape[-1] != head or head > 256 or head % 8:
        return False
    if is_causal and q.shape[-2] != k.shape[-2]:
        return False
    return q.shape[1] % k.shape[1] == 0


def efficient_eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    if q.dtype not in (*HALF, torch.float32) or q.dim() != 4:
        return False
    align = 4 if q.dtype == torch.float32 else 8
    if q.shape[-1] % align or v.shape[-1] % align:
        return False
    return q.shape[1] == k.shape[1] == v.shape[1]


def choose(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, is_causal: bool) -> str:
    if flash_eligible(q, k, v, mask, is_causal):
        return "flash"
    if efficient_eligible(q, k, v):
        return "efficient"
    return "math"


def _autocast(*tensors):
    if not torch.is_autocast_enabled("cuda"):
        return tensors
    dtype = torch.get_autocast_dtype("cuda")
    return tuple(t.to(dtype) if t is not None and t.is_floating_point() else t for t in tensors)


def _additive_bias(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The mask as the efficient kernel takes it: additive, in q's dtype, [B, H, L, S], its rows 16-aligned (as
    sdpa's own preprocessing pads them)."""
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    batch, heads, length, keys = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    padded = -(-keys // 16) * 16
    bias = mask.new_zeros((*mask.shape[:-1], padded)) if padded != keys else None
    if bias is not None:
        bias[..., :keys] = mask
        mask = bias[..., :keys]
    return mask.expand(batch, heads, length, keys)


def scaled_dot_product_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """`F.scaled_dot_product_attention`, on cuda tensors through the kernel a GPU would choose."""
    if query.device.type != "cuda":
        return MATH_FALLBACK(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    if isinstance(attn_mask, CausalBias):
        lower_right = attn_mask.variant == CausalVariant.LOWER_RIGHT and query.shape[-2] != key.shape[-2]
        if not lower_right:  # square, or top-left: plain is_causal
            attn_mask, is_causal = None, True
        elif flash_eligible(*_autocast(query, key, value), None, False):
            query, key, value = _autocast(query, key, value)  # flash's causal flag is bottom-right aligned
            return torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, True, False, scale=scale
            )[0]
        else:
            attn_mask = attn_mask._materialize(query.device)
    query, key, value, attn_mask = _autocast(query, key, value, attn_mask)
    kernel = choose(query, key, value, attn_mask, is_causal)  # the kernels' ops are counted where they run (observe)
    if kernel == "flash":
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale
        )
        return out[0]
    if kernel == "efficient":
        bias = None if attn_mask is None else _additive_bias(attn_mask, query, key)
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        out = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, grad, dropout_p, is_causal, scale=scale
        )
        return out[0]
    CHOICES["math"] += 1
    return MATH_FALLBACK(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)

"""Key/value cache for incremental decoding (`moetron generate`).

Shapes: B batch, K key/value heads, L max length, D head dim, T new tokens.

One preallocated pair of `[B, K, L, D]` buffers per layer. A forward pass with `kv_cache=cache`
writes its T new keys/values at positions `cache.length … cache.length + T − 1` in every layer,
attends over everything cached so far, and then the model calls `advance(T)` once. The positions
of the new tokens are therefore offset by `cache.length` (learned positions and RoPE alike).

Multi-head latent attention (`model/mla.py`) caches its compressed latent as the "keys" `[B, 1, L, kv_lora_rank]`
and its shared rotated key as the "values" `[B, 1, L, qk_pos_emb_head_dim]` (`value_dim`): keys and values of every
head are expanded from them at each step.
"""

from __future__ import annotations

import torch

from moetron.model.config import ModelConfig


class KVCache:
    """Preallocated per-layer keys and values; `length` tokens are valid."""

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        kv_heads: int,
        max_length: int,
        head_dim: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        value_dim: int | None = None,
    ):
        shape = (batch_size, kv_heads, max_length, head_dim)
        value_shape = (batch_size, kv_heads, max_length, value_dim or head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.values = [torch.zeros(value_shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.batch_size = batch_size
        self.max_length = max_length
        self.length = 0

    @classmethod
    def for_model(
        cls,
        cfg: ModelConfig,
        batch_size: int,
        max_length: int | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> KVCache:
        """A cache sized for `cfg` (max_length defaults to the model's position limit)."""
        length = max_length or cfg.max_positions
        if cfg.multi_latent_attention:  # the latent and the shared rotary key, one "head" each
            return cls(cfg.num_layers, batch_size, 1, length, cfg.kv_lora_rank, device, dtype, cfg.qk_pos_emb_head_dim)
        return cls(cfg.num_layers, batch_size, cfg.kv_heads, length, cfg.head_dim, device, dtype)

    def check_room(self, batch_size: int, new_tokens: int) -> None:
        """Fail early (before any layer writes) when the new tokens do not fit."""
        if batch_size != self.batch_size:
            raise ValueError(f"KV cache was built for batch size {self.batch_size}, got a batch of {batch_size}")
        if self.length + new_tokens > self.max_length:
            raise ValueError(
                f"KV cache holds {self.length} of {self.max_length} tokens and cannot take {new_tokens} more; "
                f"build it with a larger max_length"
            )

    def update(self, layer_index: int, k_BKTD: torch.Tensor, v_BKTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this layer's new keys/values; return all valid keys/values `[B, K, length + T, D]`."""
        end = self.length + k_BKTD.shape[2]
        keys, values = self.keys[layer_index], self.values[layer_index]
        keys[:, :, self.length : end] = k_BKTD.to(keys.dtype)
        values[:, :, self.length : end] = v_BKTD.to(values.dtype)
        return keys[:, :, :end], values[:, :, :end]

    def advance(self, new_tokens: int) -> None:
        """Mark the tokens of the last forward pass as valid (called once per forward, after every layer)."""
        self.length += new_tokens

    def reset(self) -> None:
        self.length = 0


def kv_cache_bytes_per_token(cfg: ModelConfig, dtype_bytes: int = 2) -> int:
    """What `KVCache.for_model(cfg)` holds per token of context over all layers: 2·K·D numbers per layer, or
    MLA's latent and shared rotary key (`--kv-lora-rank` + `--qk-pos-emb-head-dim`)."""
    if cfg.multi_latent_attention:
        per_layer = cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim
    else:
        per_layer = 2 * cfg.kv_heads * cfg.head_dim
    return cfg.num_layers * per_layer * dtype_bytes

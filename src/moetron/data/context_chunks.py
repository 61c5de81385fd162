"""The load-balanced ("zigzag") split of every sequence over context-parallel ranks: pure index arithmetic.

A sequence of S tokens is cut into 2·N equal chunks for N context-parallel ranks; rank r holds chunks r and
2N−1−r (Megatron-Core's and torchtitan's split). Under a causal mask the late chunks attend to many keys and the
early ones to few, so pairing the r-th earliest with the r-th latest gives every rank the same attention work.

    take_zigzag(tokens_BS, rank, size)      # [B, S/N]: chunk r, then chunk 2N−1−r
    zigzag_positions(S, rank, size)         # [S/N]: the absolute positions of those tokens (RoPE, learned)

Lives in `data/` because the loader applies it (every CP rank of a data-parallel replica reads the same samples
and keeps its chunks); `parallel/cp/` reads the same arithmetic for positions and the attention mask.
"""

from __future__ import annotations

import torch


def zigzag_chunk_ids(rank: int, size: int) -> tuple[int, int]:
    """The two chunks (of 2·size) rank `rank` holds, in the order they are concatenated."""
    return rank, 2 * size - 1 - rank


def take_zigzag(x: torch.Tensor, rank: int, size: int, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s chunks of `x` along `dim` (whose length must be divisible by 2·size); `x` itself at size 1."""
    if size == 1:
        return x
    length = x.shape[dim]
    if length % (2 * size):
        raise ValueError(f"sequence length {length} is not divisible by 2 × {size} context-parallel ranks")
    chunks = x.chunk(2 * size, dim=dim)
    first, second = zigzag_chunk_ids(rank, size)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def zigzag_positions(seq_length: int, rank: int, size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """int64 [seq_length / size]: the absolute position of every token rank `rank` holds."""
    return take_zigzag(torch.arange(seq_length, device=device), rank, size, dim=0)

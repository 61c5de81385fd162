"""Dropout with the one-process mask on a rank that holds only some positions of every sequence.

Context parallelism (two zigzag chunks of every sequence) and sequence parallelism (a contiguous shard of those)
hand a dropout module a part of each sequence. `nn.Dropout` on that part would draw a mask of the part's shape
from the layer's stream: other draws than one process makes. `PositionDropout` draws the whole sequence's mask
(the draws `nn.Dropout` makes on the whole tensor, in the same stream order) and keeps this rank's positions: the
run equals the one-process run with dropout on, for split× the random numbers of the part.

    zigzag_dropout(nn.Dropout(p), cp_rank, cp)        # context parallelism: this rank's zigzag chunks
    shard_dropout(that_or_nn.Dropout, sp_rank, tp)     # sequence parallelism: a contiguous shard of the above
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from moetron.data.context_chunks import zigzag_positions

Positions = Callable[[int, torch.device], torch.Tensor]  # (local length, device) → one-process positions


class PositionDropout(nn.Dropout):
    """Dropout of a rank's positions (dim 1) of every sequence with the one-process mask: the whole sequence is
    `split` × the local length, and `positions(local length, device)` says where each local row sits in it."""

    def __init__(self, p: float, positions: Positions, split: int):
        super().__init__(p)
        self.positions, self.split = positions, split

    def forward(self, x_BSC: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x_BSC
        whole = list(x_BSC.shape)
        whole[1] *= self.split
        mask = F.dropout(torch.ones(whole, dtype=x_BSC.dtype, device=x_BSC.device), self.p, True)
        return x_BSC * mask.index_select(1, self.positions(x_BSC.shape[1], x_BSC.device))


def _parts(module: nn.Dropout) -> tuple[Positions, int]:
    if isinstance(module, PositionDropout):
        return module.positions, module.split
    return (lambda length, device: torch.arange(length, device=device)), 1


def zigzag_dropout(module: nn.Dropout, rank: int, size: int) -> PositionDropout:
    """`module`'s dropout on context-parallel rank `rank`'s zigzag chunks of every sequence."""
    inner, split = _parts(module)

    def positions(length: int, device: torch.device) -> torch.Tensor:
        return zigzag_positions(length * split * size, rank, size, device)[inner(length, device)]

    return PositionDropout(module.p, positions, split * size)


def shard_dropout(module: nn.Dropout, rank: int, size: int) -> PositionDropout:
    """`module`'s dropout on shard `rank` of `size` contiguous shards of what it saw (sequence parallelism)."""
    outer, split = _parts(module)

    def positions(length: int, device: torch.device) -> torch.Tensor:
        return outer(length * size, device)[rank * length : (rank + 1) * length]

    return PositionDropout(module.p, positions, split * size)

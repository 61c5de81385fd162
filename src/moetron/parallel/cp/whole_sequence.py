"""Context parallelism's random draws and capacity decisions as one process makes them.

A CP rank holds two zigzag chunks of every sequence. Whatever depends on the rest of the micro-batch would differ
from the one-process run if a rank computed it from its own tokens: the hidden dropout mask and the routers' noise
(each token's draws sit at its place in the layer's random stream), and capacity (the micro-batch's token count;
which routes an over-full expert keeps, by position or by score, among all of them). So:
  - every draw is made at the whole micro-batch's shape from the layer's stream — the one-process draws, in the
    same order — and this rank keeps its rows (cp× the random numbers of its own tokens): the dropout masks by
    `parallel/sequence_dropout.py` (`zigzag_dropout`, installed before tensor parallelism), the routers' noise by
    `ZigzagRows.draw`;
  - a router's keep decisions are made on the whole micro-batch's routes, all-gathered over the CP group (expert ids
    and scores: a few bytes per token and route), identically on every rank, which keeps its rows' decisions.
Expert buffers are then sized by the micro-batch's capacity: one rank may hold every kept route of an expert.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from moetron.data.context_chunks import zigzag_positions
from moetron.model.moe.routing.router import TokenRows
from moetron.parallel.diagnosis import Site


def micro_batch_rows(num_tokens: int, seq_len: int, rank: int, size: int, device: torch.device) -> torch.Tensor:
    """int64 [T]: the one-process row of each of rank `rank`'s T = B · seq_len tokens (x_BSD flattened), whose
    sequences hold `seq_len` of each sequence's seq_len · size tokens (its zigzag chunks)."""
    positions = zigzag_positions(seq_len * size, rank, size, device)
    starts = torch.arange(0, num_tokens // seq_len, device=device) * (seq_len * size)
    return (starts[:, None] + positions[None, :]).reshape(-1)


class ZigzagRows(TokenRows):
    """One router call's view of the micro-batch under context parallelism (see the module docstring)."""

    def __init__(self, num_tokens: int, seq_len: int, group, rank: int, size: int, device: torch.device):
        if num_tokens % seq_len:
            raise ValueError(f"{num_tokens} routed tokens are not whole sequences of {seq_len}")
        self.num_tokens, self.group, self.size = num_tokens, group, size
        self.rows = [micro_batch_rows(num_tokens, seq_len, r, size, device) for r in range(size)]
        self.my_rows = self.rows[rank]
        self.site = Site("the context-parallel all-gather of the routes (capacity over whole sequences)", group,
                         "context-parallel")  # fmt: skip

    def tokens(self, num_tokens: int) -> int:
        return num_tokens * self.size

    def draw_whole(self, draw: Callable[[tuple[int, ...]], torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        return draw((self.num_tokens * self.size, *shape[1:]))

    def whole(self, local: torch.Tensor) -> torch.Tensor:
        local = local.detach().contiguous()
        gathered = local.new_empty((self.size * local.shape[0], *local.shape[1:]))  # rank after rank
        with self.site:
            dist.all_gather_single(gathered, local, group=self.group)
        out = torch.empty_like(gathered)
        for rank, part in enumerate(gathered.chunk(self.size)):
            out.index_copy_(0, self.rows[rank], part)
        return out

    def mine(self, whole: torch.Tensor) -> torch.Tensor:
        return whole.index_select(0, self.my_rows)


class ZigzagTokens:
    """A router's `token_rows`: its `ZigzagRows` for each call (T tokens of sequences of seq_len here)."""

    def __init__(self, group, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size

    def __call__(self, num_tokens: int, seq_len: int | None, device: torch.device) -> ZigzagRows:
        if seq_len is None:
            raise ValueError("context parallelism routes whole [B, S, D] micro-batches (no sequence length given)")
        return ZigzagRows(num_tokens, seq_len, self.group, self.rank, self.size, device)

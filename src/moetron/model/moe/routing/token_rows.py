"""Where a router's T tokens sit in the micro-batch as one process would route it.

A router's random draws (top-2's sampled second expert, RSample, Jitter, the RTS keys) and its capacity decisions
(how many routes an expert keeps, and which) depend on the whole micro-batch: the draws on each token's place in the
generator's stream, capacity on the token count and on the other tokens routed to the same expert. In one process
every token of the micro-batch is here, and `LOCAL_ROWS` is the identity. A layout that splits the micro-batch's
sequences over ranks (context parallelism, `parallel/cp/whole_sequence.py`) gives the router its own `TokenRows`,
so that the draws and the decisions are the one-process run's for these tokens:

    rows.tokens(T)                 the micro-batch's token count (capacity is computed from it)
    rows.draw(torch.rand, (T, E))  draws at the micro-batch's shape, this rank's rows kept (draw_whole: all rows)
    rows.whole(ids_TK)             [T_all, …]: every rank's rows in the one-process order (no gradient)
    rows.mine(kept_TK_all)         this rank's rows of a whole-micro-batch tensor
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class TokenRows:
    """Every token of the micro-batch is local: the identity."""

    def tokens(self, num_tokens: int) -> int:
        return num_tokens

    def draw(self, draw: Callable[[tuple[int, ...]], torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        """This rank's rows of `draw` made at the micro-batch's shape (`shape` is this rank's)."""
        return self.mine(self.draw_whole(draw, shape))

    def draw_whole(self, draw: Callable[[tuple[int, ...]], torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        """`draw` at the micro-batch's shape (every rank's rows, in the one-process order)."""
        return draw(tuple(shape))

    def whole(self, local: torch.Tensor) -> torch.Tensor:
        return local

    def mine(self, whole: torch.Tensor) -> torch.Tensor:
        return whole


LOCAL_ROWS = TokenRows()

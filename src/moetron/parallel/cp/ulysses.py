"""Exact causal attention over a sequence split across context-parallel ranks: all-to-all over heads (Ulysses).

Megatron-Core's `--cp-comm-type a2a` (DeepSpeed-Ulysses). An all-to-all turns "every head, this rank's tokens"
into "1/N of the heads, every token": rank j receives head group j of every rank's zigzag chunks, puts the whole
sequence back in position order, runs the stock causal SDPA (any kernel, attention dropout included: the
`("cp", rank)` key of the dropout stream makes head groups draw independent masks, as TP's shards do), and a
second all-to-all returns each rank its tokens with every head. Both all-to-alls are autograd Functions whose
backward is the same exchange (a dim-0 equal-split all-to-all is its own transpose).

It needs this rank's query and key/value heads (after tensor parallelism) divisible by N, checked before launch
(`sizes.py`); a query head group then reads exactly its own key/value heads (GQA groups stay whole). Per layer it
saves what one process saves at seq / N (whole sequence, 1/N of the heads) and moves q, k, v and the output once
each, independent of N's ring steps: the cheaper variant when heads are plenty and the links are fast.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moetron.parallel.cp.attention import SplitSequenceAttention, gathered_positions
from moetron.parallel.diagnosis import Site


class _AllToAll(torch.autograd.Function):
    """`[N, …]` → `[N, …]`: block j goes to rank j, slot j receives rank j's block (its own transpose)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, site: Site) -> torch.Tensor:
        ctx.group, ctx.site = group, site
        x = x.contiguous()
        out = torch.empty_like(x)  # contiguous like `x`: the collective fills the storage in row-major order
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        with ctx.site:
            dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None, None


class UlyssesAttention(SplitSequenceAttention):
    """`--cp-comm-type a2a`: heads exchanged for tokens, the stock causal SDPA over the whole sequence."""

    collective = "all-to-all of attention heads"

    def __init__(self, group, rank: int, size: int):
        super().__init__(group, rank, size)
        self._orders: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def orders(self, local_length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(to position order, back to rank order) index vectors over the rank-ordered whole sequence."""
        key = (local_length, device)
        if key not in self._orders:
            positions = gathered_positions(local_length, self.size, device)
            self._orders[key] = (torch.argsort(positions), positions)
        return self._orders[key]

    def heads_to_sequence(self, x_BHTD: torch.Tensor) -> torch.Tensor:
        """`[B, H, T, D]` (every head, local tokens) → `[B, H/N, S, D]` (head group `rank`, every token, rank order)."""
        B, H, T, D = x_BHTD.shape
        blocks = x_BHTD.reshape(B, self.size, H // self.size, T, D).transpose(0, 1)
        received = _AllToAll.apply(blocks, self.group, self.site)  # [N (source rank), B, H/N, T, D]
        return received.permute(1, 2, 0, 3, 4).reshape(B, H // self.size, self.size * T, D)

    def sequence_to_heads(self, y_BhSD: torch.Tensor) -> torch.Tensor:
        """The inverse of `heads_to_sequence`."""
        B, h, S, D = y_BhSD.shape
        blocks = y_BhSD.reshape(B, h, self.size, S // self.size, D).permute(2, 0, 1, 3, 4)
        received = _AllToAll.apply(blocks, self.group, self.site)  # [N (head group), B, H/N, T, D]
        return received.transpose(0, 1).reshape(B, h * self.size, S // self.size, D)

    def attend(self, q_BHTD, k_BKTD, v_BKTD, dropout_p: float, gqa: dict) -> torch.Tensor:
        to_positions, to_ranks = self.orders(q_BHTD.shape[2], q_BHTD.device)
        with self.site:
            q, k, v = (self.heads_to_sequence(x)[:, :, to_positions] for x in (q_BHTD, k_BKTD, v_BKTD))
        y_BhSD = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, **gqa)
        with self.site:
            return self.sequence_to_heads(y_BhSD[:, :, to_ranks])

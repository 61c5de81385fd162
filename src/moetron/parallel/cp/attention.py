"""Exact causal attention over a sequence split across context-parallel ranks: all-gather K/V, a causal call per chunk.

Each rank holds the queries, keys and values of its two zigzag chunks (`data/context_chunks.py`). The keys and
values of the whole sequence are all-gathered over the `cp` group (`_GatherSequence`: an autograd Function
whose backward reduce-scatters dK / dV, because every rank's queries read every rank's keys) and put in position
order. Each of the rank's two chunks then attends, in one SDPA call, to the keys from the sequence's start to its
own end, causally aligned to the bottom right (`torch.nn.attention.bias.causal_lower_right`: query row i of a chunk
that ends at key n sees keys up to n − c + i). No mask tensor exists, so on a GPU each call is a flash-attention
call (FlashAttention-2's causal flag is bottom-right aligned; grouped-query attention read in place) and the result
is the one-process run's up to rounding. This is Megatron-Core's `--cp-comm-type all_gather` (Llama 3's choice for
long context): the gathered K/V cost `S · K · D` per layer (small with GQA, freed after the layer), the
communication is one all-gather forward and one reduce-scatter backward, and no partial results are merged.

Why not `torch.distributed.tensor.experimental.context_parallel` (torch 2.13): its ring attention replaces only
the CUDA SDPA kernels (`aten._scaled_dot_product_flash_attention`, `_efficient_attention`, `_cudnn_attention`
and their backwards). On CPU SDPA runs `_scaled_dot_product_flash_attention_for_cpu` or the math kernel, which it
does not handle, so it cannot run on gloo (the test suite's backend); it also shards the caller's buffers in
place inside a context manager rather than at the loader.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import bias as attention_bias

from moetron.data.context_chunks import zigzag_positions
from moetron.parallel.diagnosis import Site


class _GatherSequence(torch.autograd.Function):
    """`[B, K, T, D]` → `[B, K, size·T, D]`: every rank's part along the sequence, in rank order. Backward: the
    sum over ranks of the gradient of each rank's part, scattered back to its owner (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x_BKTD: torch.Tensor, group, size: int, site: Site) -> torch.Tensor:
        ctx.group, ctx.size, ctx.site = group, size, site
        x_TBKD = x_BKTD.permute(2, 0, 1, 3).contiguous()  # the collective concatenates along dim 0
        out = x_TBKD.new_empty((size * x_TBKD.shape[0], *x_TBKD.shape[1:]))
        dist.all_gather_single(out, x_TBKD, group=group)
        return out.permute(1, 2, 0, 3)

    @staticmethod
    def backward(ctx, grad_BKSD: torch.Tensor):
        grad_SBKD = grad_BKSD.permute(2, 0, 1, 3).contiguous()
        out = grad_SBKD.new_empty((grad_SBKD.shape[0] // ctx.size, *grad_SBKD.shape[1:]))
        with ctx.site:
            dist.reduce_scatter_single(out, grad_SBKD, group=ctx.group)
        return out.permute(1, 2, 0, 3), None, None, None


class SplitSequenceAttention:
    """The `attend_fn` of every `SelfAttention` on a context-parallel rank (`model/attention.py` calls it with
    SDPA's arguments): causal attention of this rank's queries (its zigzag chunks) to the whole sequence's keys. The
    `--cp-comm-type` variants differ only in how the keys reach the queries (`attend`)."""

    collective: ClassVar[str]  # what the collectives move, named in a hang's diagnosis

    def __init__(self, group, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size
        self.site = Site(f"the context-parallel {self.collective}", group, "context-parallel")

    def __call__(
        self,
        q_BHTD: torch.Tensor,
        k_BKTD: torch.Tensor,
        v_BKTD: torch.Tensor,
        dropout_p: float = 0.0,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        return self.attend(q_BHTD, k_BKTD, v_BKTD, dropout_p, {"enable_gqa": True} if enable_gqa else {})

    def attend(
        self, q_BHTD: torch.Tensor, k_BKTD: torch.Tensor, v_BKTD: torch.Tensor, dropout_p: float, gqa: dict
    ) -> torch.Tensor:
        raise NotImplementedError


def gathered_positions(local_length: int, size: int, device: torch.device) -> torch.Tensor:
    """int64 [size · T]: the sequence position of every rank's tokens, rank after rank (the order a gather along the
    sequence of the ranks' zigzag chunks holds them in)."""
    seq = local_length * size
    return torch.cat([zigzag_positions(seq, r, size, device) for r in range(size)])


class ContextParallelAttention(SplitSequenceAttention):
    """`--cp-comm-type all_gather`: every rank's keys and values gathered, a bottom-right causal call per chunk."""

    collective = "K/V all-gather (or its backward reduce-scatter)"

    def __init__(self, group, rank: int, size: int):
        super().__init__(group, rank, size)
        self._orders: dict[tuple, torch.Tensor] = {}

    def causal_mask(self, local_length: int, device: torch.device) -> torch.Tensor:
        """bool [T, S]: local query t may read gathered key s (key position <= query position); what the chunks'
        calls compute, as one mask (the tests' reference)."""
        query_pos_T = zigzag_positions(local_length * self.size, self.rank, self.size, device)
        key_pos_S = gathered_positions(local_length, self.size, device)
        return key_pos_S[None, :] <= query_pos_T[:, None]

    def position_order(self, local_length: int, device: torch.device) -> torch.Tensor:
        """int64 [S]: the gathered (rank-ordered) keys' indices in position order, built once per shape."""
        key = (local_length, device)
        if key not in self._orders:
            self._orders[key] = torch.argsort(gathered_positions(local_length, self.size, device))
        return self._orders[key]

    def chunk_ends(self, local_length: int) -> list[tuple[slice, int]]:
        """(this rank's query rows of a chunk, the key position it ends at) for its two zigzag chunks."""
        half, chunks = local_length // 2, 2 * self.size
        return [(slice(0, half), (self.rank + 1) * half), (slice(half, None), (chunks - self.rank) * half)]

    def attend(self, q_BHTD, k_BKTD, v_BKTD, dropout_p: float, gqa: dict) -> torch.Tensor:
        with self.site:
            k_BKSD = _GatherSequence.apply(k_BKTD, self.group, self.size, self.site)
            v_BKSD = _GatherSequence.apply(v_BKTD, self.group, self.size, self.site)
        order = self.position_order(q_BHTD.shape[2], q_BHTD.device)
        k_BKSD, v_BKSD = k_BKSD[:, :, order], v_BKSD[:, :, order]
        outs = []
        for rows, end in self.chunk_ends(q_BHTD.shape[2]):
            q = q_BHTD[:, :, rows]
            causal = attention_bias.causal_lower_right(q.shape[2], end)  # a flag, not a mask: no tensor of [t, end]
            outs.append(F.scaled_dot_product_attention(q, k_BKSD[:, :, :end], v_BKSD[:, :, :end], attn_mask=causal,
                                                       dropout_p=dropout_p, **gqa))  # fmt: skip
        return torch.cat(outs, dim=2)

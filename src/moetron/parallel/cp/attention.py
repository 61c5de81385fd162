"""Exact causal attention over a sequence split across context-parallel ranks: all-gather K/V, mask by position.

Each rank holds the queries, keys and values of its two zigzag chunks (`data/context_chunks.py`). The keys and
values of the whole sequence are all-gathered over the `cp` group (`_GatherSequence`: an autograd Function
whose backward reduce-scatters dK / dV, because every rank's queries read every rank's keys), and each local query
attends to the gathered keys at positions up to its own, the causal mask built from the zigzag positions. One
SDPA call per layer, the same kernel and the same softmax as the one-process run, so the result is that run's up
to rounding. This is Megatron-Core's `--cp-comm-type all_gather` (Llama 3's choice for long context): the gathered
K/V cost `S · K · D` per layer (small with GQA, and freed after the layer), the communication is one all-gather
forward and one reduce-scatter backward, and it needs no online-softmax merging of partial results.

Why not `torch.distributed.tensor.experimental.context_parallel` (torch 2.13): its ring attention replaces only
the CUDA SDPA kernels (`aten._scaled_dot_product_flash_attention`, `_efficient_attention`, `_cudnn_attention`
and their backwards). On CPU SDPA runs `_scaled_dot_product_flash_attention_for_cpu` or the math kernel, which it
does not handle, so it cannot run on gloo (the test suite's backend); it also shards the caller's buffers in
place inside a context manager rather than at the loader. A ring (p2p) version would overlap communication
with compute on GPUs; all-gather was built first because it is exact with the stock SDPA kernel everywhere.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F

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
    """`--cp-comm-type all_gather`: every rank's keys and values gathered, masked by position."""

    collective = "K/V all-gather (or its backward reduce-scatter)"

    def __init__(self, group, rank: int, size: int):
        super().__init__(group, rank, size)
        self._masks: dict[tuple, torch.Tensor] = {}

    def causal_mask(self, local_length: int, device: torch.device) -> torch.Tensor:
        """bool [T, S]: local query t may read gathered key s (key position <= query position)."""
        query_pos_T = zigzag_positions(local_length * self.size, self.rank, self.size, device)
        key_pos_S = gathered_positions(local_length, self.size, device)
        return key_pos_S[None, :] <= query_pos_T[:, None]

    def additive_mask(self, local_length: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """`causal_mask` as SDPA's additive float mask (0 / −inf) in the queries' dtype, built once and shared by
        every layer: given a bool mask, SDPA converts it to this form in every call and saves each copy for its
        backward (a `[T, S]` float tensor per layer)."""
        key = (local_length, device, dtype)
        if key not in self._masks:
            allowed_TS = self.causal_mask(local_length, device)
            zeros = torch.zeros(allowed_TS.shape, dtype=dtype, device=device)
            self._masks[key] = zeros.masked_fill(~allowed_TS, float("-inf"))
        return self._masks[key]

    def attend(self, q_BHTD, k_BKTD, v_BKTD, dropout_p: float, gqa: dict) -> torch.Tensor:
        with self.site:
            k_BKSD = _GatherSequence.apply(k_BKTD, self.group, self.size, self.site)
            v_BKSD = _GatherSequence.apply(v_BKTD, self.group, self.size, self.site)
        mask_TS = self.additive_mask(q_BHTD.shape[2], q_BHTD.device, q_BHTD.dtype)
        return F.scaled_dot_product_attention(q_BHTD, k_BKSD, v_BKSD, attn_mask=mask_TS, dropout_p=dropout_p, **gqa)

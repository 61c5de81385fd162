"""Exact causal attention over a sequence split across context-parallel ranks: K/V blocks passed around a ring.

Megatron-Core's `--cp-comm-type p2p` (ring attention). Each rank keeps its queries and, over `cp` steps, sees
every rank's K/V block: at step i it attends to the block of rank `rank − i` while that block travels on to the
next rank (`batch_isend_irecv`, posted before the step's compute so the two overlap on GPUs). The partial results
are merged with the online softmax (each block's output and log-sum-exp). Nothing whole-sequence is kept: the
forward saves q, the local k / v (stacked), the output and its log-sum-exp (`[B, H, T]`, fp32 or wider), and the
backward passes the blocks around again, recomputing each block's probabilities; each block's dK / dV travel with
it and reach its owner after the last step. So per layer the saved activations are those of one process at seq / cp,
without the all-gather variant's gathered K/V `[B, K, seq, D]` and its `[seq / cp, seq]` mask.

Under the zigzag split (`data/context_chunks.py`) rank r holds chunks (r, 2N−1−r) and every block pair is dense
or plain causal, never a ragged mask:
  - its own block: causal (the local positions increase);
  - the block of a rank s < r: every local query sees the block's first chunk (s < r), none its second;
  - the block of a rank s > r: only the local second chunk (2N−1−r > both of s's) sees it, all of it.
So every rank does the same work per step (load balance), and the merged result is SDPA's over the whole
sequence up to fp32 rounding (each block is computed in fp32, as a flash kernel accumulates).

Each block is computed with matmuls (scores `[B, H, t, t']` of one block pair at a time, freed after it), which
runs everywhere, gloo on CPU included; attention dropout is refused before launch (`sizes.py`): the backward
would have to redraw every block's mask. GQA reads the K key/value heads in place (no repeat over query heads).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from moetron.parallel.cp.attention import SplitSequenceAttention

# message tags: the K/V blocks and their travelling gradients may be in flight between the same two ranks at once
_KV_TAG, _GRAD_TAG = 1, 2


class RingAttention(SplitSequenceAttention):
    """`--cp-comm-type p2p`: the K/V blocks passed around the ring, partial results merged (the module docstring)."""

    collective = "ring exchange of K/V blocks (or of their gradients)"

    def __init__(self, group, rank: int, size: int):
        super().__init__(group, rank, size)
        self.next = dist.get_global_rank(group, (rank + 1) % size)
        self.prev = dist.get_global_rank(group, (rank - 1) % size)

    def attend(self, q_BHTD, k_BKTD, v_BKTD, dropout_p: float, gqa: dict) -> torch.Tensor:
        """GQA or not, the blocks read the K key/value heads in place (`_grouped`)."""
        if dropout_p:  # refused before launch; a guard for callers that skip validation
            raise ValueError("ring attention (--cp-comm-type p2p) has no attention dropout; use --cp-comm-type a2a")
        with self.site:
            return _RingAttention.apply(q_BHTD, k_BKTD, v_BKTD, self)

    def exchange(self, x: torch.Tensor, tag: int) -> tuple[torch.Tensor, list]:
        """Post: send `x` to the next rank, receive the previous rank's tensor of the same shape (returned with
        the requests to wait on)."""
        received = torch.empty_like(x, memory_format=torch.contiguous_format)
        ops = [dist.P2POp(dist.isend, x, self.next, self.group, tag), dist.P2POp(dist.irecv, received, self.prev,
                                                                              self.group, tag)]  # fmt: skip
        return received, dist.batch_isend_irecv(ops)

    def block_layout(self, step: int, local_length: int) -> tuple[slice, slice, bool]:
        """(local query rows, rows of the visiting K/V block, causal) for the block that arrives at `step`."""
        return zigzag_block(self.rank, (self.rank - step) % self.size, local_length)


def zigzag_block(rank: int, src: int, local_length: int) -> tuple[slice, slice, bool]:
    """Which of rank `rank`'s queries see which keys of rank `src` (both holding zigzag chunks of `local_length`
    tokens): (query rows, key rows, causal within them); every other pair is masked (the module docstring)."""
    half = local_length // 2
    if src == rank:
        return slice(None), slice(None), True
    if src < rank:
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


def _grouped(q_BHTD: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """`[B, H, T, D]` → `[B, K, R, T, D]`: the R query heads of each key/value head (H = K·R, heads grouped)."""
    B, H, T, D = q_BHTD.shape
    return q_BHTD.reshape(B, kv_heads, H // kv_heads, T, D)


def _scores(q_BKRtD: torch.Tensor, k_BKsD: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """fp32 attention logits `[B, K, R, t, s]`, −inf above the diagonal when `causal`."""
    s = torch.matmul(q_BKRtD, k_BKsD.unsqueeze(2).transpose(-1, -2)) * scale
    if causal:
        t, n = s.shape[-2:]
        s = s.masked_fill(torch.ones(t, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BHTD, k_BKTD, v_BKTD, ring: RingAttention):
        T, K, scale = q_BHTD.shape[2], k_BKTD.shape[1], 1.0 / math.sqrt(q_BHTD.shape[-1])
        acc = torch.promote_types(q_BHTD.dtype, torch.float32)  # the blocks' accumulation dtype (fp32 at least)
        q = _grouped(q_BHTD, K).to(acc)
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        kv = own_kv = torch.stack([k_BKTD, v_BKTD])  # one message a step; saved rather than k and v themselves:
        for step in range(ring.size):  # v is a view that would keep the whole qkv projection output alive
            if step + 1 < ring.size:
                arriving, requests = ring.exchange(kv, _KV_TAG)
            rows, cols, causal = ring.block_layout(step, T)
            s = _scores(q[:, :, :, rows], kv[0][:, :, cols].to(acc), causal, scale)
            block_lse = torch.logsumexp(s, dim=-1)
            block_out = torch.matmul(torch.exp(s - block_lse[..., None]), kv[1][:, :, cols].to(acc).unsqueeze(2))
            merged = torch.logaddexp(lse[..., rows], block_lse)
            out[:, :, :, rows] = (out[:, :, :, rows] * torch.exp(lse[..., rows] - merged)[..., None]
                                  + block_out * torch.exp(block_lse - merged)[..., None])  # fmt: skip
            lse[..., rows] = merged
            if step + 1 < ring.size:
                _wait(requests)
                kv = arriving
        out_BHTD = out.reshape(q_BHTD.shape).to(q_BHTD.dtype)
        ctx.save_for_backward(q_BHTD, own_kv, out_BHTD, lse)
        ctx.ring, ctx.scale, ctx.dtypes = ring, scale, (k_BKTD.dtype, v_BKTD.dtype)
        return out_BHTD

    @staticmethod
    def backward(ctx, grad_BHTD):
        q_BHTD, kv, out_BHTD, lse = ctx.saved_tensors
        ring, scale, T, K, acc = ctx.ring, ctx.scale, q_BHTD.shape[2], kv.shape[2], lse.dtype
        with ring.site:
            q, dout = _grouped(q_BHTD, K).to(acc), _grouped(grad_BHTD, K).to(acc)
            delta = (dout * _grouped(out_BHTD, K).to(acc)).sum(-1)  # rowsum(dO ∘ O): the softmax's backward term
            dq = torch.zeros_like(q)
            grads, requests = None, []
            for step in range(ring.size):
                if step + 1 < ring.size:
                    arriving, kv_requests = ring.exchange(kv, _KV_TAG)
                rows, cols, causal = ring.block_layout(step, T)
                k, v = kv[0][:, :, cols].to(acc), kv[1][:, :, cols].to(acc)
                p = torch.exp(_scores(q[:, :, :, rows], k, causal, scale) - lse[..., rows, None])
                ds = p * (torch.matmul(dout[:, :, :, rows], v.unsqueeze(2).transpose(-1, -2)) - delta[..., rows, None])
                dq[:, :, :, rows] += torch.matmul(ds, k.unsqueeze(2)) * scale
                block = torch.zeros(kv.shape, dtype=acc, device=kv.device)
                block[0][:, :, cols] = torch.matmul(ds.transpose(-1, -2), q[:, :, :, rows]).sum(2) * scale
                block[1][:, :, cols] = torch.matmul(p.transpose(-1, -2), dout[:, :, :, rows]).sum(2)
                if step > 0:  # the block's gradient so far, from the ranks it visited before this one
                    _wait(requests)
                    block += grads
                grads, requests = ring.exchange(block, _GRAD_TAG)  # after the last step: to the block's owner
                if step + 1 < ring.size:
                    _wait(kv_requests)
                    kv = arriving
            _wait(requests)
        dq_BHTD = dq.reshape(q_BHTD.shape).to(q_BHTD.dtype)
        return dq_BHTD, grads[0].to(ctx.dtypes[0]), grads[1].to(ctx.dtypes[1]), None

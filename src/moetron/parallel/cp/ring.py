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

Each block is one flash-attention call (`_FlashBlocks`: the aten flash kernel of the tensors' device, CUDA's or
the CPU's, which return the block's log-sum-exp; non-causal or square causal, so no mask ever), and the backward
calls the flash backward of each block with the merged output and log-sum-exp, which gives the block's exact share
of dQ, dK and dV. A GQA block's K/V heads are expanded to the query heads for the kernel call (its dK / dV summed
back). Where the flash kernel cannot run (fp32 on a GPU, head sizes flash refuses) the blocks are computed with
fp32 matmuls instead (`_MatmulBlocks`: scores `[B, H, t, t']` of one
block pair at a time), which runs everywhere. Attention dropout is refused before launch (`sizes.py`): the
backward would have to redraw every block's mask.

The two exchanges of the backward (the K/V blocks and their travelling gradients) go to the same neighbour and are
posted in the same order on every rank, so they pair up by order as NCCL's point-to-point operations do (tags,
which NCCL ignores, only label them for gloo).
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


class _FlashBlocks:
    """A block pair's attention by the device's flash kernel: forward (out, log-sum-exp) and backward (dq, dk, dv)
    with the merged out and log-sum-exp (each block's probabilities are then its share of the whole softmax)."""

    @staticmethod
    def usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        head = q.shape[-1]
        if k.shape[-1] != head or v.shape[-1] != head:
            return False  # flash takes one head size for q, k and v
        if q.device.type == "cpu":
            return q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
        return q.dtype in (torch.float16, torch.bfloat16) and head <= 256 and head % 8 == 0

    @staticmethod
    def forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        if q.device.type == "cpu":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        else:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
        return out, lse

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal: bool, scale: float) -> tuple[torch.Tensor, ...]:
        if q.device.type == "cpu":
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, k, v, out, lse, 0.0, causal, scale=scale
            )
        t, s, unused = q.shape[-2], k.shape[-2], torch.empty(0, dtype=torch.int64, device=q.device)
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, unused, unused, t, s, 0.0, causal, unused, unused, scale=scale
        )[:3]


def _hand_on_gradient(ring: RingAttention, step: int, block: torch.Tensor, grads, requests: list):
    """Add the visiting block's gradient so far (from the ranks it visited before this one) to this rank's share and
    send the sum on with the block: after the last step it reaches the block's owner."""
    if step > 0:
        _wait(requests)
        block += grads
    return ring.exchange(block, _GRAD_TAG)


def _expanded(kv_BKtD: torch.Tensor, heads: int) -> torch.Tensor:
    """K/V heads repeated for their query heads (GQA: query head h reads key/value head h // (H / K))."""
    return kv_BKtD.repeat_interleave(heads // kv_BKtD.shape[1], dim=1) if kv_BKtD.shape[1] != heads else kv_BKtD


def _summed(grad_BHtD: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of `_expanded`: each key/value head's query heads summed."""
    B, H, t, D = grad_BHtD.shape
    return grad_BHtD.reshape(B, kv_heads, H // kv_heads, t, D).sum(2) if H != kv_heads else grad_BHtD


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BHTD, k_BKTD, v_BKTD, ring: RingAttention):
        if _FlashBlocks.usable(q_BHTD, k_BKTD, v_BKTD):
            out_BHTD, lse = _flash_ring_forward(q_BHTD, k_BKTD, v_BKTD, ring)
        else:
            out_BHTD, lse = _matmul_ring_forward(q_BHTD, k_BKTD, v_BKTD, ring)
        ctx.save_for_backward(q_BHTD, torch.stack([k_BKTD, v_BKTD]), out_BHTD, lse)
        ctx.ring, ctx.dtypes = ring, (k_BKTD.dtype, v_BKTD.dtype)
        return out_BHTD

    @staticmethod
    def backward(ctx, grad_BHTD):
        q_BHTD, kv, out_BHTD, lse = ctx.saved_tensors
        with ctx.ring.site:
            flash = _FlashBlocks.usable(q_BHTD, kv[0], kv[1])
            backward = _flash_ring_backward if flash else _matmul_ring_backward
            dq_BHTD, dk, dv = backward(grad_BHTD, q_BHTD, kv, out_BHTD, lse, ctx.ring)
        return dq_BHTD, dk.to(ctx.dtypes[0]), dv.to(ctx.dtypes[1]), None


def _merge(out, lse, rows, block_out, block_lse) -> None:
    """Fold one block's (output, log-sum-exp) into the running result of the rows it covers (online softmax); `rows`
    indexes the dimensions after batch and heads (the query rows, or (query group, rows))."""
    rows = rows if isinstance(rows, tuple) else (rows,)
    merged = torch.logaddexp(lse[(..., *rows)], block_lse)
    index = (slice(None), slice(None), *rows)
    out[index] = (out[index] * torch.exp(lse[(..., *rows)] - merged)[..., None]
                  + block_out * torch.exp(block_lse - merged)[..., None])  # fmt: skip
    lse[(..., *rows)] = merged


def _flash_ring_forward(q_BHTD, k_BKTD, v_BKTD, ring: RingAttention) -> tuple[torch.Tensor, torch.Tensor]:
    T, H, scale = q_BHTD.shape[2], q_BHTD.shape[1], 1.0 / math.sqrt(q_BHTD.shape[-1])
    acc = torch.promote_types(q_BHTD.dtype, torch.float32)  # the merge's dtype (fp32 at least), as the kernel's lse
    out = torch.zeros(q_BHTD.shape, dtype=acc, device=q_BHTD.device)
    lse = torch.full(q_BHTD.shape[:-1], float("-inf"), dtype=acc, device=q_BHTD.device)
    kv = torch.stack([k_BKTD, v_BKTD])  # one message a step
    for step in range(ring.size):
        if step + 1 < ring.size:
            arriving, requests = ring.exchange(kv, _KV_TAG)
        rows, cols, causal = ring.block_layout(step, T)
        k, v = _expanded(kv[0][:, :, cols], H), _expanded(kv[1][:, :, cols], H)
        block_out, block_lse = _FlashBlocks.forward(q_BHTD[:, :, rows], k, v, causal, scale)
        _merge(out, lse, rows, block_out.to(acc), block_lse.to(acc))
        if step + 1 < ring.size:
            _wait(requests)
            kv = arriving
    return out.to(q_BHTD.dtype), lse


def _flash_ring_backward(grad_BHTD, q_BHTD, kv, out_BHTD, lse, ring: RingAttention):
    T, H, K, scale = q_BHTD.shape[2], q_BHTD.shape[1], kv.shape[2], 1.0 / math.sqrt(q_BHTD.shape[-1])
    acc = lse.dtype
    dq = torch.zeros(q_BHTD.shape, dtype=acc, device=q_BHTD.device)
    grads, requests = None, []
    for step in range(ring.size):
        if step + 1 < ring.size:
            arriving, kv_requests = ring.exchange(kv, _KV_TAG)
        rows, cols, causal = ring.block_layout(step, T)
        k, v = _expanded(kv[0][:, :, cols], H), _expanded(kv[1][:, :, cols], H)
        dout, q, out = grad_BHTD[:, :, rows].contiguous(), q_BHTD[:, :, rows], out_BHTD[:, :, rows]
        dq_b, dk_b, dv_b = _FlashBlocks.backward(dout, q, k, v, out, lse[..., rows].contiguous(), causal, scale)
        dq[:, :, rows] += dq_b.to(acc)
        block = torch.zeros(kv.shape, dtype=acc, device=kv.device)
        block[0][:, :, cols] = _summed(dk_b.to(acc), K)
        block[1][:, :, cols] = _summed(dv_b.to(acc), K)
        grads, requests = _hand_on_gradient(ring, step, block, grads, requests)
        if step + 1 < ring.size:
            _wait(kv_requests)
            kv = arriving
    _wait(requests)
    return dq.to(q_BHTD.dtype), grads[0], grads[1]


def _matmul_ring_forward(q_BHTD, k_BKTD, v_BKTD, ring: RingAttention) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks with fp32 matmuls (where no flash kernel runs: fp32 on a GPU, head sizes flash refuses)."""
    T, K, scale = q_BHTD.shape[2], k_BKTD.shape[1], 1.0 / math.sqrt(q_BHTD.shape[-1])
    acc = torch.promote_types(q_BHTD.dtype, torch.float32)  # the blocks' accumulation dtype (fp32 at least)
    q = _grouped(q_BHTD, K).to(acc)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    kv = torch.stack([k_BKTD, v_BKTD])
    for step in range(ring.size):
        if step + 1 < ring.size:
            arriving, requests = ring.exchange(kv, _KV_TAG)
        rows, cols, causal = ring.block_layout(step, T)
        s = _scores(q[:, :, :, rows], kv[0][:, :, cols].to(acc), causal, scale)
        block_lse = torch.logsumexp(s, dim=-1)
        block_out = torch.matmul(torch.exp(s - block_lse[..., None]), kv[1][:, :, cols].to(acc).unsqueeze(2))
        _merge(out, lse, (slice(None), rows), block_out, block_lse)
        if step + 1 < ring.size:
            _wait(requests)
            kv = arriving
    return out.reshape(q_BHTD.shape).to(q_BHTD.dtype), lse.flatten(1, 2)


def _matmul_ring_backward(grad_BHTD, q_BHTD, kv, out_BHTD, lse_BHT, ring: RingAttention):
    T, K, scale = q_BHTD.shape[2], kv.shape[2], 1.0 / math.sqrt(q_BHTD.shape[-1])
    acc = lse_BHT.dtype
    lse = lse_BHT.reshape(*_grouped(q_BHTD, K).shape[:-1])
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
        grads, requests = _hand_on_gradient(ring, step, block, grads, requests)
        if step + 1 < ring.size:
            _wait(kv_requests)
            kv = arriving
    _wait(requests)
    return dq.reshape(q_BHTD.shape).to(q_BHTD.dtype), grads[0], grads[1]

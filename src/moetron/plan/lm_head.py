"""The LM head + loss buffers in the memory plan: the fused chunks (`--fused-cross-entropy`, the default) or the
materialised `[T, V]` logits.

Fused (`model/fused_cross_entropy.py`): the head's forward holds one chunk of M rows at a time — the logits in the
compute dtype, their fp32 log-softmax (and, in bf16/fp16, the fp32 copy of the logits it reads) — and writes dX
`[T, h]` in the compute dtype; dW `[V, h]` fp32 becomes the head's gradient, which the plan already counts as the
gradient present at the start of backward. Nothing of size T·V is ever alive, so accumulation holds no previous
micro-batch's logits either. Plain: logits, fp32 log-softmax and both gradients, 16 B per token and vocabulary
entry, plus (accumulating) the previous micro-batch's logits.

Shape legend: T tokens per micro-batch (mbs · seq), h hidden, V padded vocabulary, M rows per chunk.
"""

from __future__ import annotations

import torch

from moetron.config import RunConfig
from moetron.model.fused_cross_entropy import chunk_tokens

LOGITS_BYTES_PER_ENTRY = 16  # logits + fp32 log-softmax + grad of the log-softmax + grad of the logits


def loss_rows(cfg: RunConfig, device_kind: str) -> int:
    """Rows of the [rows, V] buffers alive at once: T, or the fused path's chunk."""
    m = cfg.model
    tokens = cfg.train.micro_batch_size * m.seq_length
    if not cfg.train.fused_cross_entropy:
        return tokens
    return min(tokens, chunk_tokens(tokens, m.hidden_size, m.padded_vocab_size(), torch.device(device_kind)))


def lm_loss_bytes(cfg: RunConfig, compute_bytes: int, accumulating: bool, device_kind: str) -> int:
    m = cfg.model
    tokens, vocab = cfg.train.micro_batch_size * m.seq_length, m.padded_vocab_size()
    rows = loss_rows(cfg, device_kind)
    if not cfg.train.fused_cross_entropy:
        return rows * vocab * (LOGITS_BYTES_PER_ENTRY + (compute_bytes if accumulating else 0))
    fp32_copy = 4 if compute_bytes != 4 else 0
    return rows * vocab * (compute_bytes + 4 + fp32_copy) + tokens * m.hidden_size * compute_bytes


def describe(cfg: RunConfig, device_kind: str) -> str:
    rows, vocab = loss_rows(cfg, device_kind), cfg.model.padded_vocab_size()
    if cfg.train.fused_cross_entropy:
        return f"fused LM-head loss: [{rows}, {vocab}] chunk buffers + dX"
    return f"logits and loss buffers [{rows}, {vocab}]"

"""The LM head + loss buffers in the memory plan: the fused chunks (`--fused-cross-entropy`, the default) or the
materialised `[T, V]` logits.

Fused (`model/fused_cross_entropy.py`; CPU: `cpu/head_loss.py`): the head's forward holds one chunk of M rows at a
time — the logits, whose softmax and gradient it computes in place (in fp32: one [M, V] buffer; in bf16/fp16 the
logits in that dtype and the fp32 copy the softmax runs in); on CPU in fp32 one chunk per thread (`loss_workers`) —
and writes dX `[T, h]` in the compute dtype; dW `[V, h]` fp32 becomes the head's gradient, which the plan already
counts as the gradient present at the start of backward. Nothing of size T·V is ever alive, so accumulation holds no
previous micro-batch's logits either. Plain: logits, fp32 log-softmax and both gradients, 16 B per token and
vocabulary entry, plus (accumulating) the previous micro-batch's logits. Whether the trainer fuses is the one rule the
recipe applies too (`model.loss.fuses_head`): not under tensor parallelism, whose logits are vocabulary shards
(V / tp per rank, vocab-parallel cross-entropy), nor under a pipeline schedule that splits the backward (zero
bubble, resolved as the trainer resolves `--pipeline-schedule`); under PP it runs on the last stage.

Shape legend: T tokens per micro-batch (mbs · seq), h hidden, V padded vocabulary, M rows per chunk.
"""

from __future__ import annotations

import torch

from moetron.config import RunConfig
from moetron.model.fused_cross_entropy import chunk_tokens
from moetron.model.loss import fuses_head
from moetron.parallel.dims import ParallelDims
from moetron.parallel.pp.stage_layout import schedule_name, splits_backward

LOGITS_BYTES_PER_ENTRY = 16  # logits + fp32 log-softmax + grad of the log-softmax + grad of the logits


def fused(cfg: RunConfig, dims: ParallelDims | None = None) -> bool:
    """Whether the trainer runs the fused head + loss for this layout (see the module docstring)."""
    if dims is None:
        return cfg.train.fused_cross_entropy
    p = cfg.parallel
    schedule = schedule_name(p.pipeline_schedule, p.num_layers_per_virtual_pipeline_stage)
    return fuses_head(cfg.train.fused_cross_entropy, dims.tp > 1, dims.pp > 1 and splits_backward(schedule))


def loss_rows(cfg: RunConfig, device_kind: str, dims: ParallelDims | None = None) -> int:
    """Rows of one [rows, V] buffer: T, or the fused path's chunk (on CPU at this process's thread count)."""
    m = cfg.model
    tokens = cfg.train.micro_batch_size * m.seq_length
    if not fused(cfg, dims):
        return tokens
    threads = torch.get_num_threads()
    if device_kind == "cpu":  # the CPU backend's chunks (`moetron/cpu/head_loss.py`), which the trainer uses there
        from moetron.cpu.head_loss import cpu_chunk_tokens

        return min(tokens, cpu_chunk_tokens(tokens, m.hidden_size, m.padded_vocab_size(), threads))
    return min(tokens, chunk_tokens(tokens, m.hidden_size, m.padded_vocab_size(), torch.device(device_kind), threads))


def loss_workers(cfg: RunConfig, compute_bytes: int, device_kind: str, dims: ParallelDims | None = None) -> int:
    """Chunks of the fused head alive at once: on CPU in fp32 one per thread (`cpu_head_workers`: each thread runs
    whole chunks), else 1."""
    if device_kind != "cpu" or compute_bytes != 4 or not fused(cfg, dims):
        return 1
    m = cfg.model
    tokens = cfg.train.micro_batch_size * m.seq_length
    rows = loss_rows(cfg, device_kind, dims)
    from moetron.cpu.head_loss import cpu_head_workers

    return cpu_head_workers(tokens, m.hidden_size, local_vocab(cfg, dims), torch.get_num_threads(), rows)


def local_vocab(cfg: RunConfig, dims: ParallelDims | None) -> int:
    """This rank's vocabulary rows: the padded vocabulary, or its tensor-parallel shard."""
    return cfg.model.padded_vocab_size() // (dims.tp if dims is not None else 1)


def lm_loss_bytes(
    cfg: RunConfig, compute_bytes: int, accumulating: bool, device_kind: str, dims: ParallelDims | None = None
) -> int:
    m = cfg.model
    tokens, vocab = cfg.train.micro_batch_size * m.seq_length, local_vocab(cfg, dims)
    rows = loss_rows(cfg, device_kind, dims)
    if not fused(cfg, dims):
        return rows * vocab * (LOGITS_BYTES_PER_ENTRY + (compute_bytes if accumulating else 0))
    per_entry = 4 if compute_bytes == 4 else compute_bytes + 4  # in place in fp32; else the fp32 copy beside it
    workers = loss_workers(cfg, compute_bytes, device_kind, dims)
    chunks = workers * rows * vocab * per_entry
    return chunks + tokens * m.hidden_size * compute_bytes


def describe(cfg: RunConfig, device_kind: str, dims: ParallelDims | None = None) -> str:
    rows, vocab = loss_rows(cfg, device_kind, dims), local_vocab(cfg, dims)
    if fused(cfg, dims):
        return f"fused LM-head loss: [{rows}, {vocab}] chunk buffers + dX"
    shard = " (this GPU's vocabulary shard)" if dims is not None and dims.tp > 1 else ""
    return f"logits and loss buffers [{rows}, {vocab}]{shard}"

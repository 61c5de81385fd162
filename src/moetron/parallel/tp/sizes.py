"""What tensor parallelism splits, as pure arithmetic: the problems a config has with a TP size, found up front.

Tensor parallelism (`--tensor-model-parallel-size N`, Megatron's `MP_SIZE`) gives each of N ranks:
  attention   whole key/value groups of `query_key_value` (column-parallel; groups = heads / (heads / kv heads)),
              so N divides the query heads and the key/value heads; `dense` row-parallel over the same heads;
  dense MLP   `dense_h_to_4h` (+ `_up`) column-parallel, `dense_4h_to_h` row-parallel: N divides the ffn size;
  vocabulary  `word_embeddings` (and `output_layer`) rows: N divides the padded vocabulary;
  experts     whole (--expert-tensor-parallel-size 1, the default), or split like the dense MLP
              (--expert-tensor-parallel-size N): then N divides the expert ffn size;
  sequence    with --sequence-parallel, norms and dropout hold seq / N positions: N divides the sequence length;
  QK norm     per head (--qk-layernorm, Qwen3): over one head's channels, so a rank's whole heads normalise
              exactly; over all heads' channels (--qk-layernorm-scope all_heads, OLMoE) it would need every rank's
              heads, and is refused.

The padded vocabulary is `padded_vocab_size()` — a multiple of --make-vocab-size-divisible-by, a function of the
config only — at every TP size. Megatron pads to a multiple of divisible-by × TP instead; here the row count (and
so the checkpoint's global shape and the softmax over the padding rows) would then change with the layout, so a
TP size must divide the config's padded vocabulary, and the fix says which divisible-by makes it so (the default
128 works for every power-of-two TP size up to 128).
"""

from __future__ import annotations

import math

from moetron.model.config import ModelConfig
from moetron.parallel.dims import ParallelDims

TP_FLAG = "--tensor-model-parallel-size"


def tensor_parallel_problems(model: ModelConfig, dims: ParallelDims) -> list[str]:
    """Every problem the model has with the TP (and sequence- and expert-TP) layout, each with its fix."""
    tp = dims.tp
    if tp <= 1:
        return []
    p: list[str] = []
    fix = f"or a {TP_FLAG} that divides it"
    if model.num_attention_heads % tp:
        p.append(
            f"--num-attention-heads {model.num_attention_heads} is not divisible by {TP_FLAG} {tp}; every "
            f"tensor-parallel rank holds whole heads: use a multiple of {tp} {fix}"
        )
    if model.num_key_value_heads is not None and model.kv_heads % tp:
        p.append(
            f"--num-key-value-heads {model.kv_heads} is not divisible by {TP_FLAG} {tp}; the query-key-value "
            f"projection is split by key/value group, so every rank needs whole groups: use a multiple of {tp} {fix}"
        )
    if any(e == 1 for e in model.experts_per_layer()) and model.ffn_size % tp:
        p.append(
            f"the dense MLP's ffn size {model.ffn_size} (--ffn-hidden-size) is not divisible by {TP_FLAG} {tp}; "
            f"use a multiple of {tp} {fix}"
        )
    padded = model.padded_vocab_size()
    if padded % tp:
        divisible = math.lcm(model.make_vocab_size_divisible_by, tp)
        p.append(
            f"the padded vocabulary {padded} (--vocab-size {model.vocab_size} rounded up to a multiple of "
            f"--make-vocab-size-divisible-by {model.make_vocab_size_divisible_by}) is not divisible by {TP_FLAG} "
            f"{tp}; use --make-vocab-size-divisible-by {divisible}"
        )
    if dims.etp > 1 and model.moe_layer_indices() and model.expert_ffn_size % dims.etp:
        p.append(
            f"the experts' ffn size {model.expert_ffn_size} (--moe-ffn-hidden-size) is not divisible by "
            f"--expert-tensor-parallel-size {dims.etp}; use a multiple of {dims.etp}, or "
            f"--expert-tensor-parallel-size 1 (experts whole, expert parallelism across the TP ranks)"
        )
    if model.qk_layernorm and model.qk_layernorm_scope == "all_heads":
        p.append(
            f"--qk-layernorm-scope all_heads with {TP_FLAG} {tp} is not supported (its norm spans every head's "
            f"channels and a rank holds 1/{tp} of the heads); use --qk-layernorm-scope head (exact under "
            f"tensor parallelism), or {TP_FLAG} 1"
        )
    if dims.sp and model.seq_length % tp:
        p.append(
            f"--sequence-parallel splits each sequence over the {tp} tensor-parallel ranks but --seq-length "
            f"{model.seq_length} is not divisible by {tp}; use a multiple of {tp} or drop --sequence-parallel"
        )
    return p


def shard_range(size: int, parts: int, index: int) -> slice:
    """The slice of `size` elements part `index` of `parts` holds (equal parts; the problems above ensure it)."""
    step = size // parts
    return slice(index * step, (index + 1) * step)

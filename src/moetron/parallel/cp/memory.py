"""What context parallelism changes in the memory model: each rank holds seq / cp tokens of every sequence, plus
(`--cp-comm-type all_gather`) the whole sequence's keys and values while attending (`parallel/cp/attention.py`).

Every per-token activation term (`plan/memory_terms.py`) is priced at the rank's seq / cp tokens
(`per_rank_sequence`: the dimension's `rank_view`), as are the LM head's buffers and the all-to-all;
`gathered_kv_bytes` (its `saved_bytes`) adds what CP itself keeps: SDPA saves the
gathered K and V `[mbs, K, seq, D]` (in position order; each chunk's call reads a prefix of them) of every layer
for its backward (one layer at a time with activation checkpointing); no mask exists (bottom-right causal calls).
The ring (`p2p`, `parallel/cp/ring.py`) saves what one process saves at seq / cp (q, local k / v, output,
log-sum-exp) and Ulysses (`a2a`) the same bytes as the whole sequence at 1/cp of the heads, so neither adds a
term. (Not priced: CPU's math kernel under Ulysses with attention dropout keeps probabilities over the whole
sequence at 1/cp of the heads, cp times the per-token term's.)
"""

from __future__ import annotations

import dataclasses

from moetron.config import RunConfig
from moetron.parallel.dims import ParallelDims
from moetron.parallel.terms.model_cache import cached


def per_rank_sequence(cfg: RunConfig, dims: ParallelDims) -> RunConfig:
    """`cfg` with the sequence length one context-parallel rank holds (`cfg` itself without CP): for the
    per-token terms only, never for parameters (position embeddings keep their size)."""
    if dims.cp <= 1:
        return cfg
    # one shortened model per (model, cp) in an open `model_cache`: the caches keyed by model then hit for it too
    return dataclasses.replace(cfg, model=cached(_shortened, cfg.model, dims.cp))


def _shortened(model, cp: int):
    return dataclasses.replace(model, seq_length=model.seq_length // cp)


def gathered_kv_bytes(cfg: RunConfig, dims: ParallelDims, compute_bytes: int, layers: int,
                      micro_batches: float = 1) -> float:  # fmt: skip
    """The gathered keys and values that `layers` layers save for backward over `micro_batches` micro-batches in
    flight (one layer when recomputing): under `--cp-comm-type all_gather` only (the ring and Ulysses gather nothing
    whole-sequence). `cfg`: the whole sequence."""
    if dims.cp <= 1 or cfg.parallel.cp_comm_type != "all_gather" or not layers:
        return 0
    m = cfg.model
    seq = m.seq_length
    per_layer = 2 * cfg.train.micro_batch_size * m.kv_heads * m.head_dim * seq * compute_bytes
    return per_layer * (1 if m.checkpoint_activations else layers) * micro_batches

"""What one rank holds and sends, in the words every dimension's memory and cost terms use.

`LocalParams` counts the parameters a rank holds (each dimension's memory terms split or shard it: experts over
EP, tensor-parallel shares, a pipeline stage's part, ZeRO's shards); `compute_bytes` is the compute dtype's size;
`ring_share` is what a rank sends per byte of buffer in a ring collective. `plan/` adds the terms up.
"""

from __future__ import annotations

from dataclasses import dataclass

from moetron.config import RunConfig


@dataclass(frozen=True)
class LocalParams:
    total: int  # parameters this rank holds
    experts: int  # of which routed experts (num_experts / EP per MoE layer)
    replicated: int  # of which replicated on every data-parallel rank (all but sharded experts)
    matmul: int  # of which are matmul weights (cast to fp16/bf16 under autocast)
    adamw: int  # of which no hidden matrix: AdamW's under --optimizer muon too (terms/optimizer_state.py)
    adamw_experts: int  # of which routed experts' (their biases)


def compute_bytes(cfg: RunConfig) -> int:
    """Bytes per element of the compute dtype: 2 under bf16/fp16 autocast, else 4."""
    return 2 if cfg.train.fp16 or cfg.train.bf16 else 4


def ring_share(n: int) -> float:
    """Bytes a rank sends per byte of buffer in an all-gather / reduce-scatter / all-to-all of n ranks."""
    return (n - 1) / n if n > 1 else 0.0

"""`--qk-layernorm` under tensor parallelism: per head (Qwen3) is accepted, over all heads (OLMoE) refused in one line.

The per-head form is exact on head shards (tests/distributed/test_tensor_parallel_train.py trains it at TP = 2 + SP
against one process, first gradients included); here the rule that validate() and plan apply."""

from __future__ import annotations

from moetron.model.config import ModelConfig
from moetron.parallel.dims import ParallelDims
from moetron.parallel.tp.sizes import tensor_parallel_problems


def model(**overrides) -> ModelConfig:
    return ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128, **overrides)


def test_per_head_qk_norm_is_accepted_under_tp():
    dims = ParallelDims(world_size=2, dp=1, tp=2)
    assert tensor_parallel_problems(model(qk_layernorm=True, normalization="rmsnorm"), dims) == []


def test_all_heads_qk_norm_is_refused_under_tp_only():
    cfg = model(qk_layernorm=True, qk_layernorm_scope="all_heads")
    (problem,) = tensor_parallel_problems(cfg, ParallelDims(world_size=2, dp=1, tp=2))
    assert problem.startswith("--qk-layernorm-scope all_heads with --tensor-model-parallel-size 2 is not supported")
    assert "use --qk-layernorm-scope head" in problem
    assert tensor_parallel_problems(cfg, ParallelDims(world_size=1, dp=1)) == []

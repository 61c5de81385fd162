"""The memory plan counts the fused LM-head loss as what it allocates: a chunk of rows (never [T, V]) and dX."""

from __future__ import annotations

import dataclasses

import pytest

from moetron.config import RunConfig
from moetron.model.loss import language_model_loss
from moetron.parallel.parallelize import layout_head_loss
from moetron.parallel.pp.stage_layout import PipelineLayout
from moetron.parallel.tp.apply_tp import vocab_parallel_loss
from moetron.plan import lm_head
from moetron.plan.memory import estimate_memory


def config(fused: bool, **train) -> RunConfig:
    cfg = RunConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.vocab_size = 2, 128, 4, 64, 50257
    cfg.train.micro_batch_size, cfg.train.fused_cross_entropy = 12, fused
    cfg.train = dataclasses.replace(cfg.train, **train)
    return cfg


def test_fused_loss_buffers_are_one_chunk_and_dx():
    cfg = config(True)
    tokens, vocab = 12 * 64, 50304
    assert lm_head.loss_rows(cfg, "cpu") == 256  # the CPU floor of 256 rows (8 MiB of logits would be 41)
    # fp32: the softmax and its gradient in place of the logits, one [256, V] buffer
    assert lm_head.lm_loss_bytes(cfg, 4, False, "cpu") == 256 * vocab * 4 + tokens * 128 * 4
    assert lm_head.loss_rows(cfg, "cuda") == tokens  # a GPU chunk of ≥ 1024 rows holds this whole micro-batch
    bf16 = config(True, bf16=True)
    # bf16: the logits in bf16 and the fp32 copy the softmax runs in
    assert lm_head.lm_loss_bytes(bf16, 2, False, "cpu") == 256 * vocab * (2 + 4) + tokens * 128 * 2
    assert "fused LM-head loss: [256, 50304] chunk buffers" in lm_head.describe(cfg, "cpu")


def test_fused_loss_on_two_cpu_threads_counts_a_chunk_per_thread(monkeypatch):
    cfg = config(True)
    tokens, vocab = 12 * 64, 50304
    monkeypatch.setattr(lm_head.torch, "get_num_threads", lambda: 2)
    assert lm_head.loss_rows(cfg, "cpu") == 384 and lm_head.loss_workers(cfg, 4, "cpu") == 2
    # one weight gradient for all the threads (csrc/fused_head.cpp): the plan counts it as the head's gradient
    assert lm_head.lm_loss_bytes(cfg, 4, False, "cpu") == 2 * 384 * vocab * 4 + tokens * 128 * 4
    assert lm_head.loss_workers(cfg, 2, "cpu") == lm_head.loss_workers(cfg, 4, "cuda") == 1  # the Python loop


def test_fused_loss_is_a_fraction_of_the_logits_and_accumulation_keeps_none():
    fused, plain = (estimate_memory(config(f), config(f).dims(1), "cpu") for f in (True, False))
    assert fused.logits * 5 < plain.logits == 12 * 64 * 50304 * 16
    assert fused.peak < plain.peak
    accumulating = config(True, global_batch_size=24)
    assert estimate_memory(accumulating, accumulating.dims(1), "cpu").logits == fused.logits


@pytest.mark.parametrize(
    ("tp", "pp", "schedule", "expected"),
    [
        (1, 1, None, True),
        (2, 1, None, False),  # vocabulary-sharded logits: the vocab-parallel cross-entropy reads them
        (1, 2, None, True),  # 1F1B (the resolved default): the last stage fuses
        (1, 2, "zero-bubble", False),  # the split backward cannot hand out the fused gradients twice
        (2, 2, "zero-bubble", False),
        (1, 2, "gpipe", True),
    ],
)
def test_plan_and_recipe_make_the_same_head_loss_decision(tp, pp, schedule, expected):
    """The planner counts the head the recipe builds (and both executors run: `ParallelModel.head_loss`)."""
    for flag in (True, False):
        cfg = config(flag)
        cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size = tp, pp
        cfg.parallel.pipeline_schedule = schedule
        dims = cfg.dims(2 * tp * pp)
        layout = PipelineLayout.from_config(cfg.model.num_layers, cfg.parallel)
        head = layout_head_loss(flag, dims, layout)
        assert lm_head.fused(cfg, dims) == head.fused == (flag and expected)
        if not head.fused:  # the logits path: under TP the vocab-parallel loss, else the plain one
            assert head.loss_fn is (vocab_parallel_loss if tp > 1 else language_model_loss)

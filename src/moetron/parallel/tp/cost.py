"""Tensor and sequence parallelism in the cost model: the bytes one rank sends per step, and their time.

Communication (`comm_bytes_per_step`): what one rank sends in ring collectives (an all-reduce of n bytes sends
2·(tp−1)/tp·n, an all-gather or reduce-scatter (tp−1)/tp·n) over one optimizer step, forward and backward: per
layer and micro-batch, attention and a dense MLP each all-reduce the [T, h] activations once forward and once
backward; with SP they all-gather + reduce-scatter forward and all-gather + all-reduce backward (DTensor reduces
the gathered input's gradient with an all-reduce, so SP sends 25% more than TP alone, where Megatron's SP sends
the same); a MoE layer all-gathers its token shares' outputs (folding; backward: the input gradients) or
all-reduces the partial expert outputs (expert TP); the embedding all-reduces its output, the head its input
gradient. Recomputed layers (activation checkpointing) run their forward collectives twice. Measured against
the collectives DTensor issues in benchmarks/tensor_parallel.py.

The time (`tp_seconds`): the bytes of the slowest GPU's layers at its tokens of each sequence, over the tensor-parallel
group's link (TP ranks are neighbours: within a node), with 2·(forwards + 1 (+ 1 with SP)) collectives per layer and
micro-batch.
"""

from __future__ import annotations

from moetron.model.config import ModelConfig
from moetron.parallel.dimension import StepContext
from moetron.parallel.dims import ParallelDims


def comm_bytes_per_step(model: ModelConfig, dims: ParallelDims, micro_batch: int, num_micro: int, c: int) -> float:
    """Bytes one rank sends over its tensor-parallel group in one optimizer step (see the module docstring); `c`
    is the compute dtype's size (activations), the embedding and head collectives are fp32. In units of
    g = (tp−1)/tp · [T, h] bytes (an all-gather or reduce-scatter; an all-reduce is 2g)."""
    tp = dims.tp
    if tp == 1:
        return 0.0
    g = (tp - 1) / tp * micro_batch * model.seq_length * model.hidden_size
    forwards = 2 if model.checkpoint_activations else 1  # recomputation repeats a layer's forward collectives
    # attention or a dense MLP: all-reduce forward and backward; with SP all-gather + reduce-scatter forward and,
    # as DTensor redistributes the gradients, an all-gather + an all-reduce backward
    block = forwards * 2 * g + (3 * g if dims.sp else 2 * g)
    sp = 1 if dims.sp else 0
    per_micro = 0.0
    for num_experts in model.experts_per_layer():
        per_micro += block
        if num_experts == 1:
            per_micro += block
        elif dims.etp == 1:  # the token shares' outputs forward, their input gradients backward (+ SP's gathers)
            per_micro += (forwards + 1) * (1 + sp) * g
        else:  # partial expert outputs forward, input gradients backward (+ SP's gathers)
            per_micro += (forwards + 1) * (2 + sp) * g
    # the embedding's output (all-reduce) and the head's input gradient (all-reduce; SP: gather + scatter + the
    # embedding's scattered gradient gathered), fp32
    ends = (5 if dims.sp else 4) * g * 4
    return num_micro * (per_micro * c + ends)


def tp_seconds(step: StepContext) -> float:
    """The tensor-/sequence-parallel collectives of the slowest GPU's layers in one step."""
    plan, d = step.plan, step.plan.dims
    if d.tp == 1:
        return 0.0
    layers = plan.cfg.model.num_layers
    share = len(step.layers) / layers  # plan.tp_comm_bytes counts every layer of the model
    forwards = 2 if plan.cfg.model.checkpoint_activations else 1
    collectives = plan.accumulation_steps * len(step.layers) * 2 * (forwards + 1 + (1 if d.sp else 0))
    # plan.tp_comm_bytes counts the whole sequence; this rank sends for its tokens of it
    share /= plan.cfg.model.seq_length / step.local.model.seq_length
    return step.net.seconds(plan.tp_comm_bytes * share, collectives, d.tp)

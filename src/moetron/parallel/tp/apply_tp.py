"""Tensor parallelism (Megatron's `--tensor-model-parallel-size`, `MP_SIZE`) and sequence parallelism, on DTensor.

`apply_tp(model, mesh)` splits the dense parts over the `tp` ranks with `torch.distributed.tensor.parallel`:

    word_embeddings          vocab-parallel (RowwiseParallel of nn.Embedding: rows = vocabulary)
    query_key_value          ColwiseParallel: whole key/value groups per rank (the fused layout is grouped by them)
    attention dense          RowwiseParallel over the same heads
    MLA (model/mla.py)       as Megatron-Core: linear_q_up_proj (or linear_q_proj) and linear_kv_up_proj ColwiseParallel
                             by heads, dense RowwiseParallel; the down projections and latent norms replicated, the
                             shared rotary key's gradient summed over the head shards (`shared_key_hook`)
    dense_h_to_4h (+ _up)    ColwiseParallel;  dense_4h_to_h: RowwiseParallel
    LM head                  the tied embedding (or output_layer) as a vocabulary shard: logits are a DTensor
                             sharded on the vocabulary, and the loss is `vocab_parallel_loss` (`loss_parallel`):
                             no rank ever holds the full [B, T, V] logits
    norms, routers, experts  replicated (experts: see tp/moe.py, applied after expert parallelism)
    q/k_layernorm            per-head QK norm on this rank's heads, weight replicated, gradient summed over tp
    MTP modules (model/mtp)  each one's transformer layer as the main (dense) layers; enorm, hnorm, eh_proj replicated;
                             its final norm hands the shared vocab-parallel head a replicated DTensor, as the model's
                             does (`_mtp_plan`; with sequence parallelism its input is gathered for the shift and
                             eh_proj, `_mtp_input_gather`, and eh_proj's output scattered for the layer); the
                             final norms' head-shaped outputs handed back to the next depth (`_mtp_chain_input`)

With `--sequence-parallel` (Megatron's SP) the residual stream between the TP regions holds seq / tp positions:
norms run on sequence shards (`SequenceParallel`), each attention / MLP / MoE input is all-gathered
(`PrepareModuleInput` Shard(1) → Replicate) and each row-parallel output reduce-scattered (`output_layouts=
Shard(1)`); the embedding output is scattered after its dropout and the final norm's output gathered for the head.
Hidden dropout on a sequence shard draws the one-process mask of the whole sequence and keeps its shard
(`parallel/sequence_dropout.py`), so SP reproduces the one-process run with dropout on; attention dropout draws on head
shards from per-rank streams (`SelfAttention.stream_shard`) — independent masks, not the one-process ones.

Parameters stay plain local shards read through DTensor views (`shard_views.py`: why), each drawn at
its full shape and sliced, so every layout holds exactly the one-process weights. `record_tp_layouts` writes each
parameter's layout into the registry, where the gradient norm and the checkpoint read it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from moetron.model.gpt import GPTModel, TransformerLayer
from moetron.model.loss import language_model_loss, masked_mean
from moetron.model.mla import MultiLatentAttention
from moetron.model.mtp import mtp_transformer_layers
from moetron.parallel.mesh import ParallelMesh
from moetron.parallel.params import ParamRegistry
from moetron.parallel.sequence_dropout import shard_dropout
from moetron.parallel.tp.shard_views import ShardViews, localize_parameters


# ---------------------------------------------------------------- the plans
def _model_plan(model: GPTModel, sp: bool) -> dict:
    plan = {"word_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())}
    if model.output_layer is not None:
        plan["output_layer"] = ColwiseParallel(use_local_output=False)  # only its weight: logits() reads it
    if sp:  # positions are added to the full embedding; the residual stream is scattered after the dropout
        plan["embedding_dropout"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
        plan["final_layernorm"] = SequenceParallel()
    else:  # the head's input as a replicated DTensor, so that the vocab-sharded weight makes vocab-sharded logits
        plan["final_layernorm"] = PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Replicate(), use_local_output=False
        )
    # a pipeline stage holds some of the ends only (`split_for_pipeline` sets the others to None)
    return {name: style for name, style in plan.items() if getattr(model, name) is not None}


def _layer_plan(layer: TransformerLayer, sp: bool) -> dict:
    rows = Shard(1) if sp else Replicate()  # where a row-parallel output goes: reduce-scatter or all-reduce
    plan = {name: ColwiseParallel() for name in _head_projections(layer)}
    plan["self_attention.dense"] = RowwiseParallel(output_layouts=rows)
    if getattr(layer.self_attention, "q_layernorm", None) is not None:  # per head (sizes.py refuses all_heads):
        # heads are dim 1 of [B, H, T, D], so a head shard normalises exactly; the weight is replicated and its
        # gradient, partial on each rank's heads, is summed over tp by the view's backward (as SequenceParallel
        # does for a sequence shard)
        plan["self_attention.q_layernorm"] = SequenceParallel(sequence_dim=1, use_local_output=True)
        plan["self_attention.k_layernorm"] = SequenceParallel(sequence_dim=1, use_local_output=True)
    if not layer.is_moe:
        plan["mlp.dense_h_to_4h"] = ColwiseParallel()
        if layer.mlp.dense_h_to_4h_up is not None:
            plan["mlp.dense_h_to_4h_up"] = ColwiseParallel()
        plan["mlp.dense_4h_to_h"] = RowwiseParallel(output_layouts=rows)
    if sp:
        gather = {"desired_input_layouts": (Replicate(),), "use_local_output": True}
        plan["input_layernorm"] = SequenceParallel()
        plan["post_attention_layernorm"] = SequenceParallel()
        plan["self_attention"] = PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None), use_local_output=True
        )
        if layer.is_moe:  # routing needs every token: the MoE layer sees the whole sequence, returns its shard
            plan["mlp"] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),),
                desired_input_layouts=(Replicate(),),
                use_local_input=True,
                output_layouts=(Replicate(), None),
                desired_output_layouts=(Shard(1), None),
            )
        else:
            plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), **gather)
    return plan


def _mtp_plan(sp: bool) -> dict:
    """An MTP module's own parts: its final norm's output meets the vocabulary-sharded head weight (the
    vocab-parallel loss then reads sharded logits); the norms and eh_proj stay replicated. With sequence
    parallelism eh_proj's output (whole sequences, see `_mtp_input_gather`) is scattered into the transformer
    layer's SP plan, and the final norm runs on the shard and is gathered for the head (`apply_tp`)."""
    if not sp:
        return {
            "final_layernorm": PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=Replicate(), use_local_output=False
            )
        }
    return {
        "eh_proj": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
        "final_layernorm": SequenceParallel(),
    }


def _mtp_input_gather() -> PrepareModuleInput:
    """With sequence parallelism, an MTP module's input (h, embedding, rope): the previous depth's hidden state
    arrives as this rank's positions and is gathered whole, so that enorm, hnorm and eh_proj see whole sequences
    next to the shifted tokens' embedding (which arrives whole)."""
    return PrepareModuleInput(
        input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None), use_local_output=True
    )


def _mtp_chain_input(sp: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """A final norm's output (the model's, or an MTP module's: a replicated DTensor of whole sequences, laid out
    for the vocab-parallel head) as the next MTP depth takes its input: this rank's sequence shard under sequence
    parallelism (`_mtp_input_gather` gathers it again, as it does every depth's), else the whole local tensor."""

    def chain_input(h_BTC: torch.Tensor) -> torch.Tensor:
        if not isinstance(h_BTC, DTensor):
            return h_BTC
        return (h_BTC.redistribute(placements=[Shard(1)]) if sp else h_BTC).to_local()

    return chain_input


def _sequence_gather() -> PrepareModuleOutput:
    """A final norm's sequence-shard output gathered whole (a replicated DTensor) for the vocab-parallel head."""
    return PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=False)


def _head_projections(layer: TransformerLayer) -> list[str]:
    """The attention projections whose output channels are whole heads (column-parallel)."""
    attention = layer.self_attention
    if not isinstance(attention, MultiLatentAttention):
        return ["self_attention.query_key_value"]
    query = "linear_q_proj" if attention.linear_q_proj is not None else "linear_q_up_proj"
    return [f"self_attention.{query}", "self_attention.linear_kv_up_proj"]


def summed_over_shards(tp_mesh) -> Callable[[torch.Tensor], torch.Tensor]:
    """Identity forward; backward, the sum of the gradient over the TP ranks (Megatron's copy to the tensor-parallel
    region): a replicated tensor each head shard uses for its own heads only (MLA's shared rotary key). DTensor's
    own rule does it — a Partial gradient of a Replicate input is all-reduced — so no collective is written here."""

    def summed(x: torch.Tensor) -> torch.Tensor:
        shared = DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False)
        return shared.to_local(grad_placements=[Partial()])

    return summed


# ---------------------------------------------------------------- applying it
def apply_tp(model: GPTModel, mesh: ParallelMesh) -> None:
    """Split the dense parts of `model` over the tensor-parallel ranks (see the module docstring). Call on the meta
    device (a built model works too: its full tensors are sliced). No-op when tp == 1."""
    tp = mesh.size("tp")
    if tp == 1:
        return
    tp_mesh, rank, sp = mesh.submesh("tp"), mesh.coords.tp, mesh.dims.sp
    if sp:  # torch 2.13: with --compile, a warm AOTAutograd cache replays sequence-parallel blocks with different
        # gradients (a cold cache reproduces the eager run exactly), so those blocks are compiled afresh every run
        torch._functorch.config.enable_autograd_cache = False
    parallelize_module(model, tp_mesh, _model_plan(model, sp))
    if sp and model.final_layernorm is not None:  # a second style on the same module: the head needs the whole
        # sequence (replicated)
        parallelize_module(model.final_layernorm, tp_mesh, _sequence_gather())
    mtp_modules = list(model.mtp.layers.values()) if getattr(model, "mtp", None) is not None else []
    for layer in [layer for _, layer in model.layer_items()] + mtp_transformer_layers(model):
        parallelize_module(layer, tp_mesh, _layer_plan(layer, sp))
        layer.self_attention.stream_shard = ("tp", rank)
        if isinstance(layer.self_attention, MultiLatentAttention):
            layer.self_attention.shared_key_hook = summed_over_shards(tp_mesh)
        if sp:
            layer.hidden_dropout = shard_dropout(layer.hidden_dropout, rank, tp)
    if mtp_modules:  # each depth reads the previous final norm's output (model/mtp.py), here head-shaped
        model.mtp.chain_input = _mtp_chain_input(sp)
    for module in mtp_modules:
        if sp:
            parallelize_module(module, tp_mesh, _mtp_input_gather())
        parallelize_module(module, tp_mesh, _mtp_plan(sp))
        if sp:  # as the model's final norm: the head needs the whole sequence
            parallelize_module(module.final_layernorm, tp_mesh, _sequence_gather())
    for module in model.modules():
        localize_parameters(module, rank, tp)


def record_tp_layouts(model: nn.Module, registry: ParamRegistry) -> None:
    """Write each tensor-parallel parameter's split dimension into the registry; replicated ones keep None.
    Experts split by expert TP record theirs (`tp_shard_dims`)."""
    for prefix, module in model.named_modules():
        if isinstance(module, ShardViews):
            for name, spec in module.shard_specs.items():
                if spec.shard_dim is not None:
                    registry.set_tp_dim(f"{prefix}.{name}", spec.shard_dim)
        for name, dim in getattr(module, "tp_shard_dims", {}).items():
            registry.set_tp_dim(f"{prefix}.{name}", dim)


# ---------------------------------------------------------------- the vocab-parallel loss
_LOSS_PARALLEL_DEPTH = [0]


@contextlib.contextmanager
def loss_parallel_scope():
    """`loss_parallel()`, re-entrant (its ops are switched on once; an inner scope must not switch them off). The
    backward of the loss needs it too: the executor's micro-batch scope (`ParallelModel.micro_batch`) holds it."""
    if _LOSS_PARALLEL_DEPTH[0]:
        yield
        return
    _LOSS_PARALLEL_DEPTH[0] += 1
    try:
        with loss_parallel():
            yield
    finally:
        _LOSS_PARALLEL_DEPTH[0] -= 1


def vocab_parallel_loss(
    logits_BTV: torch.Tensor, labels_BT: torch.Tensor, loss_mask_BT: torch.Tensor | None = None
) -> torch.Tensor:
    """Megatron's masked mean of fp32 token cross-entropies over vocabulary-sharded logits (a DTensor): each rank
    computes the log-softmax of its vocabulary shard with two all-reduces of [N] statistics (max and sum) and the
    label's logit from the shard that holds it (`loss_parallel`). Returns a plain fp32 scalar, the same on every
    TP rank. Plain logits fall back to `language_model_loss`."""
    if not isinstance(logits_BTV, DTensor):
        return language_model_loss(logits_BTV, labels_BT, loss_mask_BT)
    with loss_parallel_scope():
        losses_N = F.cross_entropy(logits_BTV.float().flatten(0, 1), labels_BT.flatten(), reduction="none")
    return masked_mean(losses_N.to_local(), loss_mask_BT)

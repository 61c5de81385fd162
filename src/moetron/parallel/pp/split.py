"""Pipeline parallelism: this rank's stages of the GPT, run by `torch.distributed.pipelining`'s schedules.

    split_for_pipeline(model, mesh, layout)     # on the meta model: keep this rank's layers, names unchanged
    parts = apply_pp(model, registry, mesh, layout)   # stage modules, data parallelism per stage, tied embeddings
    stages = pipeline_stages(parts, ...); schedule = build_schedule(...)   # schedules.py: PyTorch's engine

A stage module is tensor in / tensor out: the first stage maps tokens [B, T] to hidden states [B, T, C], a middle
stage hidden states to hidden states, the last stage hidden states to logits [B, T, V]. It registers the very
modules of the model it runs (`layers.<global index>`, the embeddings, the final norm, the head), so parameter
names are the model's: the registry, data parallelism, the checkpoint and the initialisation see the names of
the one-process model. RoPE angles are recomputed on every stage from the sequence length (they are not
parameters). MoE aux losses reach their gradients inside each layer (`model/moe/aux_loss.py`), so nothing but
the hidden states crosses a stage boundary.

Tied embeddings (Megatron's default): the first stage looks tokens up in `word_embeddings.weight` and the last
stage multiplies by it for the logits, so both hold a copy (initialised identically: weights are drawn by
name). After the backward their gradients are summed over the two ranks (Megatron's embedding group), so both
copies take the same optimizer step — the one-process gradient — and stay equal; the last stage's copy is left
out of the gradient norm (counted once) and both save it under one name (DCP writes it once).

Multi-token prediction (--mtp-num-layers, model/mtp.py) runs on the last stage, where Megatron-Core puts it: the
MTP modules sit in the last stage module (`mtp.layers.<k>`), which runs them on its last layer's output when the
pipeline executor hands it the micro-batch's tokens and labels (`mtp_batch`; every rank reads every micro-batch)
and queues their loss for the executor's loss function (`mtp_losses`). The MTP modules embed shifted tokens with
the model's embeddings, so the last stage holds `word_embeddings` (and learned `position_embeddings`) even when
the head is untied, and their gradients are summed with the first stage's copies like the tied embedding's.

Data parallelism wraps each stage module on its own (`apply_dp`: DDP over dp × cp, the expert reducer over edp);
torch's stage runs DDP's `no_sync` for all but a stage's last backward, and `MoetronStage` arms the expert
reducer for that same backward. ZeRO composes: at stage 1 each stage's optimizer slices are taken after the tied
embedding's sum (`finish_gradients`); at stages 2–3 each stage module is an FSDP2 root of its own (torchtitan's
recipe, `dp/fsdp.py` `shard_stage`), whose gradients torch's stage reduce-scatters after the last micro-batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from moetron.model.gpt import GPTModel
from moetron.model.loss import HeadLoss
from moetron.parallel.dp.replicate import DataParallel, apply_dp
from moetron.parallel.dp.zero_spec import REPLICATED, ZeroSpec
from moetron.parallel.mesh import ParallelMesh
from moetron.parallel.params import ParamRegistry
from moetron.parallel.pp.stage_layout import PipelineLayout

TIED_EMBEDDING = "word_embeddings.weight"  # the first stage's embedding, the last stage's head when tied
SHARED_POSITIONS = "position_embeddings.weight"  # learned positions: the last stage's MTP modules add them too


def last_stage_embeds(model: GPTModel) -> bool:
    """Whether the last stage needs the embedding tables: the tied head, or the MTP modules' shifted tokens."""
    return not model.cfg.untie_embeddings_and_output_weights or bool(model.cfg.mtp_num_layers)


def split_for_pipeline(model: GPTModel, mesh: ParallelMesh, layout: PipelineLayout | None) -> None:
    """Keep only this pipeline rank's layers (their global names unchanged) and ends: the embedding on the rank
    of the first stage, the final norm and head on the rank of the last (tied: the word embeddings there too).
    Call on the meta model (memory then scales with the stage from the start); a built model works too."""
    if layout is None or layout.pp == 1:
        return
    rank = mesh.coords.pp
    keep = {str(i) for i in layout.layers_of(rank)}
    for name in [n for n in model.layers if n not in keep]:
        del model.layers[name]
    first, last = layout.holds_first(rank), layout.holds_last(rank)
    if not first and not (last and model.mtp is not None):
        model.position_embeddings = None
    if not last:
        model.final_layernorm = None
        model.output_layer = None
        model.mtp = None
    if not first and not (last and last_stage_embeds(model)):
        model.word_embeddings = None


class StageModule(nn.Module):
    """One pipeline stage of a GPT: tokens or hidden states in, hidden states or logits out."""

    def __init__(self, model: GPTModel, layers: tuple[int, ...], first: bool, last: bool, emit_hidden: bool = False):
        super().__init__()
        self.first, self.last = first, last
        self.emit_hidden = last and emit_hidden  # last stage: the last layer's output (the fused head applies the head)
        self._model = [model]  # a list, so it is no submodule: DDP must see this stage's parameters only
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layers})
        if first:
            self.word_embeddings = model.word_embeddings
            self.position_embeddings = model.position_embeddings
        self.mtp_batch: Callable[[], tuple[torch.Tensor, torch.Tensor] | None] | None = None  # the executor's
        self.mtp_head_loss: HeadLoss | None = None
        self.mtp_losses: list[torch.Tensor] = []  # each training forward's MTP loss, until the loss function takes it
        # a later stage receives [B, T / tp, C] under sequence parallelism: the tokens it runs are tp times that
        self.sequence_shards = 1
        if last:
            self.final_layernorm = model.final_layernorm
            if last_stage_embeds(model):
                self.word_embeddings = model.word_embeddings
            if model.output_layer is not None:
                self.output_layer = model.output_layer
            if model.mtp is not None:
                self.mtp = model.mtp
                self.position_embeddings = model.position_embeddings

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: tokens [B, T] (first stage) or hidden states [B, T, C]; returns [B, T, C] or (last stage, unless
        `emit_hidden`) logits [B, T, V]."""
        model = self._model[0]
        if self.first:
            x, rope = model.embed(x)
        else:
            rope = model.rope_angles(self.positions(x.shape[1] * self.sequence_shards, x.device))
        x = model.run_layers(x, rope, layers=self.layers)
        batch = self.mtp_batch() if self.last and self.mtp_batch is not None else None
        if batch is not None:  # training: the MTP modules on the last layer's output (evaluation never runs them)
            self.mtp_losses.append(model.mtp.loss(model, x, *batch, self.mtp_head_loss))
        return model.logits(x) if self.last and not self.emit_hidden else x

    def positions(self, length: int, device: torch.device) -> torch.Tensor:
        """The absolute positions of the `length` tokens a later stage runs: 0 … length − 1, or under context
        parallelism those of this rank's zigzag chunks (`GPTModel.sequence_positions`, as the first stage's
        `embed` uses)."""
        model = self._model[0]
        if model.sequence_positions is not None:
            return model.sequence_positions(length, device)
        return torch.arange(length, device=device)


@dataclass
class PipelineParts:
    """This rank's stages: their modules and data parallelism, and the tied-embedding gradient sum."""

    layout: PipelineLayout
    mesh: ParallelMesh
    stage_indices: tuple[int, ...]
    modules: list[StageModule]
    data_parallel: list[DataParallel]
    tied_embedding: nn.Parameter | None = None  # held by the first and the last stage's ranks: grads summed
    shared_positions: nn.Parameter | None = None  # learned positions with MTP: on both ends too, grads summed
    embedding_group: object | None = None
    dense_after_backward: list[nn.Parameter] | None = None  # zero-bubble: dense grads reduced here, not by DDP

    @property
    def holds_first(self) -> bool:
        return 0 in self.stage_indices

    @property
    def holds_last(self) -> bool:
        return self.layout.num_stages - 1 in self.stage_indices

    def duplicate_parameters(self) -> set[int]:
        """ids of the tensors the optimizer steps that another rank also holds and counts in the gradient norm (the
        last stage's copy of the tied embeddings, or at ZeRO-1 its shard: the same name)."""
        if self.tied_embedding is None or self.holds_first:
            return set()
        return {id(p) for name, p in self.optimizer_parameters() if name in (TIED_EMBEDDING, SHARED_POSITIONS)}

    # ------------------------------------------------------------ DataParallel's interface, for the trainer
    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager:  # noqa: ARG002 - the stages arm it
        return contextlib.nullcontext()

    def optimizer_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name, parameter) the optimizer steps: every stage's, each once (the tied embedding is in two)."""
        seen, out = set(), []
        for dp in self.data_parallel:
            for name, param in dp.optimizer_parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    out.append((name, param))
        return out

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        for dp in self.data_parallel:
            dp.attach_optimizer(optimizer)

    def finish_gradients(self) -> None:
        """After the schedule: average the dense gradients the zero-bubble schedule left unreduced, sum the tied
        embedding's gradient (under ZeRO 2–3 its dp shard: both copies' shards hold the same rows), then finish
        every stage's reductions (last: at ZeRO-1 that takes the optimizer's slices of the whole gradients)."""
        if self.dense_after_backward:
            mean_gradients(self.dense_after_backward, self.mesh.group("dp_cp"), self.mesh.size("dp_cp"))
        for shared in (self.tied_embedding, self.shared_positions) if self.embedding_group is not None else ():
            if shared is None:
                continue
            grad = shared.grad
            if grad is None:
                grad = shared.grad = torch.zeros_like(shared)
            dist.all_reduce(grad.to_local() if hasattr(grad, "to_local") else grad, group=self.embedding_group)
        for dp in self.data_parallel:
            dp.finish_gradients()


def apply_pp(
    model: GPTModel,
    registry: ParamRegistry,
    mesh: ParallelMesh,
    layout: PipelineLayout,
    emit_hidden: bool = False,
    zero: ZeroSpec = REPLICATED,
) -> PipelineParts:
    """This rank's stage modules (on a model `split_for_pipeline` cut), each wrapped by data parallelism at ZeRO
    stage `zero` (2–3: FSDP2 per stage module, see `dp/fsdp.py`'s `shard_stage`). `emit_hidden`: the last stage
    returns its hidden states, for the fused head + loss (`ParallelModel.head_loss`)."""
    rank = mesh.coords.pp
    indices = layout.stages_of(rank)
    last = layout.num_stages - 1
    modules = [StageModule(model, layout.stage_layers[s], s == 0, s == last, emit_hidden) for s in indices]
    for module in modules:
        module.sequence_shards = mesh.size("tp") if mesh.dims.sp else 1
    # zero-bubble computes weight gradients with autograd.grad and adds them to .grad itself: DDP's hooks would
    # never fire, so the dense gradients are averaged after the schedule instead (experts: the reducer's finish;
    # FSDP2: torch's stage reduce-scatters after the last micro-batch itself)
    split_backward = layout.splits_backward and mesh.size("dp_cp") > 1 and not zero.uses_fsdp
    data_parallel = [apply_dp(m, registry, mesh, zero, ddp=not split_backward) for m in modules]
    parts = PipelineParts(layout, mesh, indices, modules, data_parallel)
    if split_backward:
        parts.dense_after_backward = [p for m in modules for _, p in registry.named_parameters(m, "dense")]
    if last_stage_embeds(model):
        group = embedding_group(mesh, layout)  # collective: every rank takes part
        if model.word_embeddings is not None:  # this rank holds the first or the last stage
            # `_parameters`: the parameter itself (under tensor parallelism `.weight` reads a DTensor view of it)
            parts.tied_embedding, parts.embedding_group = model.word_embeddings._parameters["weight"], group
        if model.position_embeddings is not None and model.cfg.mtp_num_layers:
            parts.shared_positions = model.position_embeddings._parameters["weight"]
    return parts


def embedding_group(mesh: ParallelMesh, layout: PipelineLayout):
    """The group of this rank's first- and last-stage peers (same dp/tp coordinates), None on other ranks.

    For pp = 2 that is the pp group. Otherwise each pair is a new group: `new_group` is collective over the
    world, so every rank creates every pair in the same order."""
    first, last = layout.rank_of_stage(0), layout.rank_of_stage(layout.num_stages - 1)
    mine = mesh.coords.pp in (first, last)
    if mesh.size("pp") == 2:
        return mesh.group("pp") if mine else None
    dims, found = mesh.dims, None
    for dp in range(dims.dp):
        for cp in range(dims.cp):
            for tp in range(dims.tp):
                ranks = [dims.rank_of(pp=first, dp=dp, cp=cp, tp=tp), dims.rank_of(pp=last, dp=dp, cp=cp, tp=tp)]
                group = dist.new_group(ranks)
                if mine and (dp, cp, tp) == (mesh.coords.dp, mesh.coords.cp, mesh.coords.tp):
                    found = group
    return found


BUCKET_ELEMENTS = 1 << 25  # 128 MiB of fp32 per all-reduce


def mean_gradients(params: list[nn.Parameter], group, size: int) -> None:
    """Average `params`' gradients over `group` in flat buckets (missing gradients count as zeros).

    Our own collective because the zero-bubble schedule's split backward bypasses DDP (see `apply_pp`)."""
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    start = 0
    while start < len(grads):
        end, elements = start, 0
        while end < len(grads) and (end == start or elements + grads[end].numel() <= BUCKET_ELEMENTS):
            elements += grads[end].numel()
            end += 1
        bucket = grads[start:end]
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        flat.div_(size)
        pieces = flat.split([g.numel() for g in bucket])
        torch._foreach_copy_(bucket, [piece.view_as(g) for piece, g in zip(pieces, bucket, strict=True)])
        start = end

"""The one ordered recipe that turns a run config into this rank's parallel model (torchtitan's `parallelize_*`).

    mesh = ParallelMesh.build(dims, env)                 # coordinates and process groups by purpose
    parallel = build(cfg, mesh, env.device)               # this rank's part, initialised and wrapped: ParallelModel
    parallel.module(tokens)                               # what the forward runs through (DDP, or the model)
    parallel.head_loss(parallel.model, hidden, labels)    # the LM head + loss this layout runs (`fuses_head`)
    with parallel.micro_batch(last=True): loss.backward() # gradients reduced in the last micro-batch only
    parallel.finish_gradients()                           # wait for the reductions
    optimizer = AdamW(parallel.optimizer_parameters())    # the weights, or at ZeRO-1 this rank's shards of them
    parallel.attach_optimizer(optimizer)                  # ZeRO-1: gather the updated shards after each step
    clip_gradients(params, max_norm, parallel.grad_norm_sq)   # the true global norm

`build` runs every step once, in this order (the order is the contract), each one small `apply_*` in its own module:
  1. build on the meta device (no memory; layers keyed by global index, so names never change);
     split_for_pipeline  keep this pipeline rank's layers and ends (pp/split.py);
     apply_cp_dropout    context parallelism's dropout: the one-process masks at this rank's positions, before
                    tensor parallelism hooks the embedding dropout (cp/apply_cp.py);
  2. apply_tp       split attention, dense MLPs and the vocabulary over the tp ranks; sequence parallelism
                    (tp/apply_tp.py);
  3. apply_ep       keep this rank's `E / ep` experts, install the all-to-all dispatcher (ep/apply_ep.py);
  4. apply_moe_tp   each TP rank dispatches its share of the tokens through that dispatcher, or (expert TP)
                    keeps a slice of every expert's ffn channels (tp/moe.py);
     apply_cp       context parallelism: zigzag positions, attention over the whole sequence, the routers'
                    draws and capacity over the whole micro-batch (cp/apply_cp.py);
  5. apply_ac       recompute each layer in backward (activation_checkpoint.py);
  6. apply_compile  `torch.compile` each transformer block (compile.py);
  7. materialise on the device and initialise: weights are drawn per parameter name and per GLOBAL expert id
     (a tensor-parallel shard: at the full shape, then sliced), so every layout holds exactly the weights of the
     one-process model;
  8. the parameter-kind registry is read off the model (params.py), with each parameter's TP layout;
  9. apply_dp       DDP over the dense parameters, the expert reducer over the edp group (dp/replicate.py);
                    with ZeRO stage 1 the optimizer on shards, stages 2–3 FSDP2 (dp/sharded_optimizer.py, dp/fsdp.py). A
                    meta-device build at stage 2–3 is sharded during step 7 instead, block by block (dp/fsdp.py),
                    so no rank ever holds the whole model.
     with pp > 1 apply_pp builds this rank's stage modules and wraps each with apply_dp at the run's ZeRO stage
     (pp/split.py; stages 2–3: FSDP2 per stage module). ZeRO under TP shards the TP-local tensors over dp.
The ZeRO spec, the pipeline layout and the LM head + loss (`model.loss.fuses_head`) are derived once, here, and
held by the `ParallelModel` the trainer, its executors and evaluation read. A new parallel dimension is one more
`apply_*` between 1 and 9 plus its coordinates in `dims.py`/`mesh.py`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from moetron.config import RunConfig
from moetron.errors import ConfigError
from moetron.model.config import ModelConfig
from moetron.model.gpt import GPTModel
from moetron.model.loss import HeadLoss, fuses_head, language_model_loss, make_head_loss
from moetron.parallel.activation_checkpoint import apply_ac
from moetron.parallel.compile import apply_compile
from moetron.parallel.cp.apply_cp import apply_cp, apply_cp_dropout
from moetron.parallel.device_backends import use_device_backends
from moetron.parallel.dims import ParallelDims
from moetron.parallel.dp.replicate import DataParallel, apply_dp
from moetron.parallel.dp.zero_spec import REPLICATED, ZeroSpec
from moetron.parallel.ep.apply_ep import apply_ep
from moetron.parallel.ep.dispatch_spec import PLAIN as PLAIN_EP_DISPATCH
from moetron.parallel.ep.dispatch_spec import EPDispatchSpec
from moetron.parallel.grad_norm import global_grad_norm_sq
from moetron.parallel.mesh import ParallelMesh
from moetron.parallel.params import ParamRegistry
from moetron.parallel.pp.split import PipelineParts, apply_pp, split_for_pipeline
from moetron.parallel.pp.stage_layout import PipelineLayout
from moetron.parallel.tp.apply_tp import apply_tp, loss_parallel_scope, record_tp_layouts, vocab_parallel_loss
from moetron.parallel.tp.moe import apply_moe_tp
from moetron.parallel.tp.sizes import tensor_parallel_problems


@dataclass
class ParallelModel:
    """The model in its parallel form, what `build` derived for it, and the per-step hooks the executors and the
    trainer call."""

    model: GPTModel  # the unwrapped model: parameters by their layout-free names
    mesh: ParallelMesh
    registry: ParamRegistry
    zero: ZeroSpec
    layout: PipelineLayout  # pp == 1: one stage
    head_loss: HeadLoss  # the LM head + loss of this layout (`model.loss.fuses_head`)
    grad_norm_sq: Callable[[list[torch.Tensor]], torch.Tensor]
    data_parallel: DataParallel | None = None  # pp == 1: what apply_dp installed on the whole model
    pipeline: PipelineParts | None = None  # pp > 1: this rank's pipeline stages (each with its data parallelism)

    @property
    def _gradients(self) -> DataParallel | PipelineParts:
        """Whoever reduces this rank's gradients and feeds the optimizer: the stages', or the whole model's."""
        return self.pipeline if self.pipeline is not None else self.data_parallel

    @property
    def module(self) -> nn.Module:
        """What the forward runs through (DDP over the dense parameters, or the model itself); pp == 1 only."""
        return self.data_parallel.module

    def loss_scope(self) -> contextlib.AbstractContextManager:
        """Around the loss and its backward: under tensor parallelism the logits are vocabulary shards and the
        vocab-parallel cross-entropy needs `loss_parallel`."""
        return loss_parallel_scope() if self.mesh.size("tp") > 1 else contextlib.nullcontext()

    @contextlib.contextmanager
    def micro_batch(self, last: bool) -> Iterator[None]:
        """Around one micro-batch's forward and backward: gradient reduction in the last one only, and the loss
        scope (`loss_scope`)."""
        with self._gradients.micro_batch(last), self.loss_scope():
            yield

    def finish_gradients(self) -> None:
        """After the last micro-batch's backward: wait for (and finish) the gradient reductions."""
        self._gradients.finish_gradients()

    def optimizer_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name, tensor) the optimizer steps and the trainer unscales and clips (ZeRO-1: this rank's shards)."""
        return self._gradients.optimizer_parameters()

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self._gradients.attach_optimizer(optimizer)


def check_dims(cfg: ModelConfig, mesh: ParallelMesh) -> None:
    """Every layout problem (degrees, expert counts the EP size must divide, what TP splits) as one ConfigError."""
    problems = mesh.dims.problems(cfg.experts_per_layer()) + tensor_parallel_problems(cfg, mesh.dims)
    if problems:
        raise ConfigError(problems)


def layout_head_loss(fused_flag: bool, dims: ParallelDims, layout: PipelineLayout) -> HeadLoss:
    """The LM head + loss for this layout: `fuses_head`'s choice; unfused, under tensor parallelism the
    vocab-parallel cross-entropy on the logits' vocabulary shards."""
    vocab_parallel = dims.tp > 1
    fused = fuses_head(fused_flag, vocab_parallel, layout.splits_backward)
    return make_head_loss(fused, vocab_parallel_loss if vocab_parallel else language_model_loss)


def build(cfg: RunConfig, mesh: ParallelMesh, device: torch.device | str) -> ParallelModel:
    """Steps 1–9 (see the module docstring), each once: this rank's part of the model, initialised from
    `--seed`, wrapped by data parallelism (or split into its pipeline stages)."""
    zero, layout = ZeroSpec.from_config(cfg), PipelineLayout.from_config(cfg.model.num_layers, cfg.parallel)
    model = build_local_model(
        cfg.model,
        mesh,
        device,
        cfg.train.seed,
        compile_blocks=cfg.train.compile,
        zero=zero,
        layout=layout,
        expert_replicas=cfg.parallel.moe_expert_replicas,
        cp_comm_type=cfg.parallel.cp_comm_type,
        ep_dispatch=EPDispatchSpec.from_config(cfg.parallel),
    )
    registry = ParamRegistry.from_model(model)
    record_tp_layouts(model, registry)
    head = layout_head_loss(cfg.train.fused_cross_entropy, mesh.dims, layout)
    if layout.pp == 1:
        data_parallel = apply_dp(model, registry, mesh, zero)
        norm_sq = global_grad_norm_sq(model, registry, mesh, data_parallel.optimizer_parameters())
        return ParallelModel(model, mesh, registry, zero, layout, head, norm_sq, data_parallel=data_parallel)
    parts = apply_pp(model, registry, mesh, layout, emit_hidden=head.fused, zero=zero)
    stage_norm_sq = global_grad_norm_sq(model, registry, mesh, parts.optimizer_parameters())
    duplicates = parts.duplicate_parameters()

    def norm_sq(params: list[torch.Tensor]) -> torch.Tensor:  # the tied embedding's second copy counts once
        return stage_norm_sq([p for p in params if id(p) not in duplicates])

    return ParallelModel(model, mesh, registry, zero, layout, head, norm_sq, pipeline=parts)


def build_local_model(
    cfg: ModelConfig,
    mesh: ParallelMesh,
    device: torch.device | str,
    seed: int,
    compile_blocks: bool = False,
    zero: ZeroSpec = REPLICATED,
    layout: PipelineLayout | None = None,
    expert_replicas: int = 0,
    cp_comm_type: str = "all_gather",
    ep_dispatch: EPDispatchSpec = PLAIN_EP_DISPATCH,
) -> GPTModel:
    """Steps 1–7 of `build`: this rank's part of the model, materialised on `device` and initialised from `seed`.
    `build` calls it; on its own it serves a model that is only read at a layout (`checkpoint.open_run(...).model(
    device, mesh)`, the lm-eval harness under torchrun): nothing there computes gradients, so steps 8–9 (the
    pipeline stages' executor parts, data parallelism and its reducers) would only allocate what is never used."""
    check_dims(cfg, mesh)
    use_device_backends(device)  # the seams' kernels for this device type, chosen once here
    with torch.device("meta"):
        model = GPTModel(cfg)
    split_for_pipeline(model, mesh, layout)
    apply_cp_dropout(model, mesh)
    apply_tp(model, mesh)
    apply_ep(model, mesh, expert_replicas, ep_dispatch)
    apply_moe_tp(model, mesh)
    apply_cp(model, mesh, cp_comm_type)
    apply_ac(model, cfg.checkpoint_activations)
    split_backward = layout is not None and layout.splits_backward
    apply_compile(model, compile_blocks, device, zero.compute_dtype, split_backward)
    if zero.uses_fsdp and mesh.distributed:
        from moetron.parallel.dp.fsdp import materialize_sharded

        materialize_sharded(model, mesh, zero, device, seed)
        return model
    model.to_empty(device=device)
    model.init_weights(seed)
    return model

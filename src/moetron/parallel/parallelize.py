"""The one ordered recipe that turns a GPT model into its parallel form (torchtitan's `parallelize_*`).

    mesh = ParallelMesh.build(dims, env)                 # coordinates and process groups by purpose
    model = build_model(cfg.model, mesh, env.device, seed, zero=zero)   # this rank's part, initialised
    parallel = parallelize(model, mesh, zero)              # zero = ZeroSpec.from_config(cfg): the ZeRO stage
    parallel.module(tokens)                               # what the forward runs through (DDP, or the model)
    with parallel.micro_batch(last=True): loss.backward() # gradients reduced in the last micro-batch only
    parallel.finish_gradients()                           # wait for the reductions
    optimizer = AdamW(parallel.optimizer_parameters())    # the weights, or at ZeRO-1 this rank's shards of them
    parallel.attach_optimizer(optimizer)                  # ZeRO-1: gather the updated shards after each step
    clip_gradients(params, max_norm, parallel.grad_norm_sq)   # the true global norm

The order matters, and each step is one small `apply_*` in its own module:
  1. build on the meta device (no memory; layers keyed by global index, so names never change);
     split_for_pipeline  keep this pipeline rank's layers and ends (pipeline.py);
  2. apply_tp       split attention, dense MLPs and the vocabulary over the tp ranks; sequence parallelism
                    (tensor_parallel.py);
  3. apply_ep       keep this rank's `E / ep` experts, install the all-to-all dispatcher (expert_parallel.py);
  4. apply_moe_tp   each TP rank dispatches its share of the tokens through that dispatcher, or (expert TP)
                    keeps a slice of every expert's ffn channels (tensor_parallel_moe.py);
  5. apply_ac       recompute each layer in backward (activation_checkpoint.py);
  6. apply_compile  `torch.compile` each transformer block (compile.py);
  7. materialise on the device and initialise: weights are drawn per parameter name and per GLOBAL expert id
     (a tensor-parallel shard: at the full shape, then sliced), so every layout holds exactly the weights of the
     one-process model;
  8. the parameter-kind registry is read off the model (params.py), with each parameter's TP layout;
  9. apply_dp       DDP over the dense parameters, the expert reducer over the edp group (data_parallel.py);
                    with ZeRO stage 1 the optimizer on shards, stages 2–3 FSDP2 (zero.py, fsdp.py). A meta-device
                    build at stage 2–3 is sharded during step 7 instead, block by block (fsdp.py), so no rank
                    ever holds the whole model.
     with pp > 1 apply_pp builds this rank's stage modules and wraps each with apply_dp (pipeline.py).
A new parallel dimension is one more `apply_*` between 1 and 9 plus its coordinates in `dims.py`/`mesh.py`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from moetron.errors import ConfigError
from moetron.model.config import ModelConfig
from moetron.model.gpt import GPTModel
from moetron.model.loss import LossFunction
from moetron.parallel.activation_checkpoint import apply_ac
from moetron.parallel.compile import apply_compile
from moetron.parallel.dp.replicate import DataParallel, apply_dp
from moetron.parallel.dp.zero_spec import REPLICATED, ZeroSpec
from moetron.parallel.ep.all_to_all import apply_ep
from moetron.parallel.grad_norm import global_grad_norm_sq
from moetron.parallel.mesh import ParallelMesh
from moetron.parallel.params import ParamRegistry
from moetron.parallel.pp.split import PipelineParts, apply_pp, split_for_pipeline
from moetron.parallel.pp.stage_layout import PipelineLayout
from moetron.parallel.tp.apply_tp import apply_tp, loss_parallel_scope, record_tp_layouts
from moetron.parallel.tp.moe import apply_moe_tp
from moetron.parallel.tp.sizes import tensor_parallel_problems


@dataclass
class ParallelModel:
    """The model in its parallel form and the per-step hooks the executors and the trainer call."""

    model: GPTModel  # the unwrapped model: parameters by their layout-free names
    mesh: ParallelMesh
    registry: ParamRegistry
    data_parallel: DataParallel | PipelineParts
    grad_norm_sq: Callable[[list[torch.Tensor]], torch.Tensor]
    pipeline: PipelineParts | None = None  # this rank's pipeline stages (pp > 1)

    @property
    def module(self) -> nn.Module:
        """What the forward runs through (DDP over the dense parameters, or the model itself)."""
        return self.data_parallel.module

    @property
    def loss_fn(self) -> LossFunction:
        """The LM loss for this model's logits (vocab-parallel cross-entropy under tensor parallelism)."""
        return self.model.loss_fn

    @contextlib.contextmanager
    def micro_batch(self, last: bool) -> Iterator[None]:
        """Around one micro-batch's forward and backward: gradient reduction in the last one only; under tensor
        parallelism the vocab-parallel loss's backward needs `loss_parallel` too."""
        tp = self.mesh.size("tp") > 1
        with self.data_parallel.micro_batch(last), loss_parallel_scope() if tp else contextlib.nullcontext():
            yield

    def finish_gradients(self) -> None:
        """After the last micro-batch's backward: wait for (and finish) the gradient reductions."""
        self.data_parallel.finish_gradients()

    def optimizer_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name, tensor) the optimizer steps and the trainer unscales and clips (ZeRO-1: this rank's shards)."""
        return self.data_parallel.optimizer_parameters()

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.data_parallel.attach_optimizer(optimizer)


def check_dims(cfg: ModelConfig, mesh: ParallelMesh) -> None:
    """Every layout problem (degrees, expert counts the EP size must divide, what TP splits) as one ConfigError."""
    problems = mesh.dims.problems(cfg.experts_per_layer()) + tensor_parallel_problems(cfg, mesh.dims)
    if problems:
        raise ConfigError(problems)


def build_model(
    cfg: ModelConfig,
    mesh: ParallelMesh,
    device: torch.device | str,
    seed: int,
    checkpoint_activations: bool | None = None,
    compile_blocks: bool = False,
    zero: ZeroSpec = REPLICATED,
    pipeline: PipelineLayout | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> GPTModel:
    """Steps 1–7: this rank's part of the model, materialised on `device` and initialised from `seed`.

    `checkpoint_activations` defaults to the model config's flag; `pipeline` is the stage layout when pp > 1;
    `compute_dtype` (the autocast dtype, fp32 without one) tells `apply_compile` what the experts will run in."""
    check_dims(cfg, mesh)
    with torch.device("meta"):
        model = GPTModel(cfg)
    split_for_pipeline(model, mesh, pipeline)
    apply_tp(model, mesh)
    apply_ep(model, mesh)
    apply_moe_tp(model, mesh)
    apply_ac(model, cfg.checkpoint_activations if checkpoint_activations is None else checkpoint_activations)
    apply_compile(model, compile_blocks, device, compute_dtype)
    if zero.uses_fsdp and mesh.distributed:
        from moetron.parallel.dp.fsdp import materialize_sharded

        materialize_sharded(model, mesh, zero, device, seed)
        return model
    model.to_empty(device=device)
    model.init_weights(seed)
    return model


def parallelize(
    model: GPTModel, mesh: ParallelMesh, zero: ZeroSpec = REPLICATED, pipeline: PipelineLayout | None = None
) -> ParallelModel:
    """Steps 8–9 on a model from `build_model` (a model built whole, e.g. by `create_model`, is split, tensor-
    and expert-sharded here first: correct, but it briefly held everything)."""
    check_dims(model.cfg, mesh)
    split_for_pipeline(model, mesh, pipeline)
    apply_tp(model, mesh)
    apply_ep(model, mesh)
    apply_moe_tp(model, mesh)
    registry = ParamRegistry.from_model(model)
    record_tp_layouts(model, registry)
    if pipeline is None or pipeline.pp == 1:
        data_parallel = apply_dp(model, registry, mesh, zero)
        norm_sq = global_grad_norm_sq(model, registry, mesh, data_parallel.optimizer_parameters())
        return ParallelModel(model, mesh, registry, data_parallel, norm_sq)
    parts = apply_pp(model, registry, mesh, pipeline)
    norm_sq = global_grad_norm_sq(model, registry, mesh, parts.optimizer_parameters())
    duplicates = parts.duplicate_parameters()
    return ParallelModel(
        model, mesh, registry, parts, lambda params: norm_sq([p for p in params if id(p) not in duplicates]), parts
    )

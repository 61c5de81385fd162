"""The one ordered recipe that turns a GPT model into its parallel form (torchtitan's `parallelize_*`).

    mesh = ParallelMesh.build(dims, env)                 # coordinates and process groups by purpose
    parallel = parallelize(cfg.model, mesh, env.device, seed, train_cfg)
    parallel.module(tokens)                               # what the forward runs through (DDP, or the model)
    with parallel.micro_batch(last=True): loss.backward() # gradients reduced in the last micro-batch only
    parallel.finish_gradients()                           # wait for the reductions
    clip_gradients(params, max_norm, parallel.grad_norm_sq)   # the true global norm

The order matters, and each step is one small `apply_*` in its own module:
  1. build on the meta device (no memory; layers keyed by global index, so names never change);
  2. apply_ep       keep this rank's `E / ep` experts, install the all-to-all dispatcher (expert_parallel.py);
  3. apply_ac       recompute each layer in backward (activation_checkpoint.py);
  4. apply_compile  `torch.compile` each transformer block (compile.py);
  5. materialise on the device and initialise: weights are drawn per parameter name and per GLOBAL expert id,
     so every layout holds exactly the weights of the one-process model;
  6. the parameter-kind registry is read off the model (params.py);
  7. apply_dp       DDP over the dense parameters, the expert reducer over the edp group (data_parallel.py).
A new parallel dimension is one more `apply_*` between 1 and 7 plus its coordinates in `dims.py`/`mesh.py`:
tensor parallelism goes before apply_ep, pipeline splitting right after the build (each stage keeps its layers).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from moetron.errors import ConfigError
from moetron.model.config import ModelConfig
from moetron.model.gpt import GPTModel
from moetron.parallel.activation_checkpoint import apply_ac
from moetron.parallel.compile import apply_compile
from moetron.parallel.data_parallel import DataParallel, apply_dp
from moetron.parallel.expert_parallel import apply_ep
from moetron.parallel.grad_norm import global_grad_norm_sq
from moetron.parallel.mesh import ParallelMesh
from moetron.parallel.params import ParamRegistry


@dataclass
class ParallelModel:
    """The model in its parallel form and the per-step hooks the executors and the trainer call."""

    model: GPTModel  # the unwrapped model: parameters by their layout-free names
    mesh: ParallelMesh
    registry: ParamRegistry
    data_parallel: DataParallel
    grad_norm_sq: Callable[[list[torch.Tensor]], torch.Tensor]

    @property
    def module(self) -> nn.Module:
        """What the forward runs through (DDP over the dense parameters, or the model itself)."""
        return self.data_parallel.module

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager:
        return self.data_parallel.micro_batch(last)

    def finish_gradients(self) -> None:
        """After the last micro-batch's backward: wait for (and finish) the gradient reductions."""
        self.data_parallel.finish_gradients()


def check_dims(cfg: ModelConfig, mesh: ParallelMesh) -> None:
    """Every layout problem (degrees, and expert counts the EP size must divide) as one ConfigError."""
    problems = mesh.dims.problems(cfg.experts_per_layer())
    if problems:
        raise ConfigError(problems)


def build_model(
    cfg: ModelConfig,
    mesh: ParallelMesh,
    device: torch.device | str,
    seed: int,
    checkpoint_activations: bool | None = None,
    compile_blocks: bool = False,
    compute_dtype: torch.dtype = torch.float32,
) -> GPTModel:
    """Steps 1–5: this rank's part of the model, materialised on `device` and initialised from `seed`.

    `checkpoint_activations` defaults to the model config's flag; `compute_dtype` (the autocast dtype, fp32 without
    one) tells `apply_compile` what the experts will run in."""
    check_dims(cfg, mesh)
    with torch.device("meta"):
        model = GPTModel(cfg)
    apply_ep(model, mesh)
    apply_ac(model, cfg.checkpoint_activations if checkpoint_activations is None else checkpoint_activations)
    apply_compile(model, compile_blocks, device, compute_dtype)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model


def parallelize(model: GPTModel, mesh: ParallelMesh) -> ParallelModel:
    """Steps 6–7 on a model from `build_model` (a model built whole, e.g. by `create_model`, is expert-sharded
    here first: correct, but it briefly held every expert)."""
    check_dims(model.cfg, mesh)
    apply_ep(model, mesh)
    registry = ParamRegistry.from_model(model)
    data_parallel = apply_dp(model, registry, mesh)
    return ParallelModel(model, mesh, registry, data_parallel, global_grad_norm_sq(model, registry, mesh))

"""The one ordered recipe that turns a GPT model into its parallel form (torchtitan's `parallelize`).

    model = build_model(cfg.model, env, dims, seed)   # meta → this rank's experts → materialise → init
    parallel = parallelize(model, env, dims)           # EP dispatchers, DDP (shards a full model if given one)
    out = parallel.module(tokens, labels_BT=labels)              # DDP (dense) or the model itself
    loss.backward(); parallel.finish_gradients()                 # expert grads over EDP, / full DP size
    clip_gradients(params, max_norm, parallel.grad_norm_sq)      # true global norm across EP shards

Order matters: (1) build on the meta device (no memory), (2) replace each MoE layer's experts by only this
rank's `E / ep` experts and install the all-to-all dispatcher, (3) materialise and initialise — experts are
drawn per GLOBAL expert id, so every layout holds exactly the weights of the one-process model — and
(4) wrap the dense parameters in DDP over the data-parallel group. Activation checkpointing is the model's
own flag; TP and PP (later) slot in before step (2).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from moetron.errors import ConfigError
from moetron.model.config import ModelConfig
from moetron.model.gpt import GPTModel
from moetron.model.moe.experts import GroupedExperts
from moetron.model.moe.layer import MoELayer
from moetron.parallel.data_parallel import global_grad_norm_sq, reduce_expert_gradients, wrap_data_parallel
from moetron.parallel.dims import ParallelDims
from moetron.parallel.env import DistEnv
from moetron.parallel.expert_parallel import AllToAllDispatcher


@dataclass
class ParallelModel:
    """The wrapped model and the per-step hooks the trainer calls."""

    module: nn.Module  # what forward runs through: DDP over the dense parameters, or the model itself
    dims: ParallelDims
    meshes: dict = field(default_factory=dict)  # "ep", "edp", "dp" → 1-D DeviceMesh (empty in one process)
    grad_norm_sq: Callable[[list[torch.Tensor]], torch.Tensor] | None = None  # for clip_gradients: global norm²

    def group(self, name: str):
        mesh = self.meshes.get(name)
        return mesh.get_group() if mesh is not None else None

    def finish_gradients(self) -> None:
        """After the last micro-batch's backward: reduce the sharded experts' gradients (DDP did the rest)."""
        if self.dims.ep_enabled:
            reduce_expert_gradients(unwrap_model(self.module), self.group("edp"), self.dims.dp)


def unwrap_model(module: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (or the module itself)."""
    return getattr(module, "module", module)


def check_dims(cfg: ModelConfig, dims: ParallelDims) -> None:
    """Every layout problem (degrees, and expert counts the EP size must divide) as one ConfigError."""
    problems = dims.problems(cfg.experts_per_layer())
    if problems:
        raise ConfigError(problems)


def ep_coordinates(env: DistEnv, dims: ParallelDims) -> tuple[int, int]:
    """(ep_rank, ep_size) of this process: its position in the contiguous block of EP ranks (E+D layout)."""
    if not dims.ep_enabled:
        return 0, 1
    return dims.ep_rank(env.rank), dims.ep


def shard_experts(model: GPTModel, ep_rank: int, ep_size: int) -> None:
    """Keep only this rank's experts in every MoE layer (see `shard_layer_experts`)."""
    for moe in model.moe_layers():
        shard_layer_experts(moe, ep_rank, ep_size)


def shard_layer_experts(moe: MoELayer, ep_rank: int, ep_size: int) -> None:
    """Keep experts `ep_rank·L … ep_rank·L + L − 1` of the layer (L = E / ep_size) and install nothing else.
    On the meta device this allocates nothing; on a built layer the kept slices are copied, the rest freed."""
    old = moe.experts
    local = old.num_global_experts // ep_size
    offset = ep_rank * local
    device = old.w1_EDF.device
    with torch.device("meta"):  # an uninitialised shell: no draw, no memory
        new = GroupedExperts(
            local,
            old.hidden,
            old.ffn,
            old.swiglu,
            old.b1_EF is not None,
            activation=old.activation,
            backend=old.backend,
            expert_offset=offset,
            num_global_experts=old.num_global_experts,
        )
    if device.type != "meta":
        new.to_empty(device=device)
        start = offset - old.expert_offset
        with torch.no_grad():
            for name, param in new.named_parameters():
                param.copy_(getattr(old, name)[start : start + local])
    moe.experts = new


def install_dispatchers(model: GPTModel, ep_group, ep_size: int, ep_rank: int) -> None:
    """Swap every MoE layer's local dispatcher for the all-to-all one over `ep_group`."""
    for moe in model.moe_layers():
        moe.dispatcher = AllToAllDispatcher(moe.num_experts, ep_group, ep_size, ep_rank)


def is_sharded(moe: MoELayer) -> bool:
    return moe.experts.num_experts < moe.experts.num_global_experts


def parallelize(model: GPTModel, env: DistEnv, dims: ParallelDims) -> ParallelModel:
    """Apply expert and data parallelism to `model` (in place) and return the wrapped form.

    A model built with all experts (e.g. by `create_model`) is sharded here: correct, but it briefly holds
    every expert; `build_model` avoids that by sharding on the meta device."""
    check_dims(model.cfg, dims)
    meshes = dims.build_mesh(env.device.type) or {}
    ep_rank, ep_size = ep_coordinates(env, dims)
    ep_group = meshes["ep"].get_group() if dims.ep_enabled else None
    if dims.ep_enabled:
        assert meshes["ep"].get_local_rank() == ep_rank, "the mesh and ParallelDims disagree on the EP layout"
        if not all(is_sharded(moe) for moe in model.moe_layers()):
            shard_experts(model, ep_rank, ep_size)
        install_dispatchers(model, ep_group, ep_size, ep_rank)
    module = wrap_data_parallel(model, env, dims)
    return ParallelModel(module, dims, meshes, global_grad_norm_sq(model, ep_group))


def build_model(cfg: ModelConfig, env: DistEnv, dims: ParallelDims, seed: int) -> GPTModel:
    """Build on meta, keep this rank's experts, materialise on `env.device`, initialise from `seed`.

    Expert memory scales as 1 / ep; the weights equal those of `create_model(cfg, seed=seed)` at the same
    global expert ids. Needs no process group (the EP coordinate follows from the rank)."""
    check_dims(cfg, dims)
    ep_rank, ep_size = ep_coordinates(env, dims)
    with torch.device("meta"):
        model = GPTModel(cfg)
    if dims.ep_enabled:
        shard_experts(model, ep_rank, ep_size)
    model.to_empty(device=env.device)
    model.init_weights(seed)
    return model

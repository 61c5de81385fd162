"""Tensor-parallel parameters as plain local shards, seen as DTensors by the module that computes with them.

`parallelize_module` turns a module's parameters into DTensors. moetron keeps them as plain `nn.Parameter`s
holding this rank's shard, and gives the module a DTensor *view* of each one whenever it reads the attribute
(`module.weight` → `DTensor.from_local(local shard, mesh, placements)`, a fresh autograd view each time, so the
gradient lands in the local shard and the TP collectives stay DTensor's). Why not DTensor parameters:
  - DDP rejects DTensor parameters, and the fused / foreach kernels of AdamW, gradient clipping and unscaling
    reject lists that mix DTensors with plain tensors — and routed experts (expert parallelism) and the
    replicated norms and routers stay plain tensors;
  - names, the optimizer, the checkpoint and the registry then see one kind of tensor; the registry records each
    parameter's layout (`record_tp_layouts`), from which the gradient norm and the checkpoint's global view
    (`GlobalView`) build what they need.
The view is a class-level property on a per-class subclass (`module.__class__` is swapped, as FSDP2's
`fully_shard` does), so `named_parameters()` / `state_dict()` still see the local parameter under its own name,
a layer recomputed by activation checkpointing reads fresh views, and a tied weight read outside its module's
forward (the LM head reading `word_embeddings.weight`) is a view too.

Initialisation stays layout-free: every localized parameter records the slice of the full tensor it holds
(`module.param_slices`, read by `moetron.model.init`), and is drawn at the full shape, then sliced.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from moetron.model.init import TensorSlice
from moetron.parallel.tp.sizes import shard_range


@dataclass(frozen=True)
class ShardSpec:
    """How a local parameter sits in its global DTensor."""

    mesh: object  # DeviceMesh
    placements: tuple
    shape: torch.Size  # global
    stride: tuple[int, ...]  # global

    @property
    def shard_dim(self) -> int | None:
        """The tensor dimension split over the mesh (None: replicated)."""
        dims = [p.dim for p in self.placements if isinstance(p, Shard)]
        return dims[0] if dims else None

    def tensor_slice(self, rank: int, size: int) -> TensorSlice:
        index = [slice(None)] * len(self.shape)
        if self.shard_dim is not None:
            index[self.shard_dim] = shard_range(self.shape[self.shard_dim], size, rank)
        return TensorSlice(tuple(self.shape), tuple(index))


class ShardViews:
    """Mixin of the swapped classes: `weight` / `bias` read as DTensor views of the local shards."""

    shard_specs: dict[str, ShardSpec]

    def shard_view(self, name: str) -> torch.Tensor | None:
        if name not in self._parameters:
            raise AttributeError(name)  # e.g. an embedding's bias: then nn.Module says it has none
        local = self._parameters[name]
        spec = self.shard_specs.get(name)
        # under ZeRO 2–3 FSDP2 holds the tensor-parallel shard as its own DTensor shard over dp between forwards
        # and reads it back through this attribute: that one is returned as it is
        if local is None or spec is None or isinstance(local, DTensor):
            return local
        return DTensor.from_local(
            local, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride
        )

    @property
    def weight(self):
        return self.shard_view("weight")

    @property
    def bias(self):
        return self.shard_view("bias")


_VIEW_CLASSES: dict[type, type] = {}


def _view_class(cls: type) -> type:
    if issubclass(cls, ShardViews):
        return cls
    if cls not in _VIEW_CLASSES:
        _VIEW_CLASSES[cls] = type(f"TensorParallel{cls.__name__}", (ShardViews, cls), {})
    return _VIEW_CLASSES[cls]


def localize_parameters(module: nn.Module, tp_rank: int, tp_size: int) -> None:
    """Replace `module`'s own DTensor parameters (`weight`, `bias`) with plain local shards read through views."""
    specs = {}
    for name, param in list(module._parameters.items()):
        if not isinstance(param, DTensor):
            continue
        if name not in ("weight", "bias"):
            raise TypeError(f"tensor parallelism localizes weight/bias only, not {type(module).__name__}.{name}")
        specs[name] = ShardSpec(param.device_mesh, tuple(param.placements), param.shape, param.stride())
        module._parameters[name] = nn.Parameter(param.to_local().detach(), requires_grad=param.requires_grad)
    if not specs:
        return
    module.__class__ = _view_class(type(module))
    module.shard_specs = {**getattr(module, "shard_specs", {}), **specs}
    slices = {name: spec.tensor_slice(tp_rank, tp_size) for name, spec in specs.items() if spec.shard_dim is not None}
    module.param_slices = {**getattr(module, "param_slices", {}), **slices}


def sharded_modules(model: nn.Module):
    """(name, module) of every module with localized tensor-parallel parameters."""
    for name, module in model.named_modules():
        if isinstance(module, ShardViews):
            yield name, module

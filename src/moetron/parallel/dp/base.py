"""`DataParallel`: what `apply_dp` installed, whatever the ZeRO stage; the base of stage 0/1's (`replicate.py`)
and stages 2–3's (`fsdp.py`) wrappers, in a module of its own so that neither imports the other's."""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from moetron.parallel.diagnosis import Site


class GradientReducer(Protocol):
    """Reduces gradients the module does not (`replicate.ExpertGradReducer`: the experts over edp)."""

    def start(self, last_micro_batch: bool) -> None: ...

    def finish(self) -> None: ...


class DataParallel:
    """What `apply_dp` installed: the module forward runs through, and the hooks of one optimizer step."""

    def __init__(self, model: nn.Module, module: nn.Module, expert_reducer: GradientReducer | None):
        self.model = model  # unwrapped: parameters by their layout-free names
        self.module = module
        self.expert_reducer = expert_reducer
        # DDP's all-reduce runs inside the last micro-batch's backward: its label for the failure diagnosis
        self.reduction_site = None
        if isinstance(module, DistributedDataParallel):
            self.reduction_site = Site("the gradient reduction (DDP)", module.process_group, "data-parallel")

    def micro_batch(self, last: bool):
        """Context for one micro-batch's forward and backward: gradients are reduced in the last one only."""
        if self.expert_reducer is not None:
            self.expert_reducer.start(last)
        if isinstance(self.module, DistributedDataParallel) and not last:
            return self.module.no_sync()
        return self.reduction_site or contextlib.nullcontext()

    def finish_gradients(self) -> None:
        if self.expert_reducer is not None:
            self.expert_reducer.finish()

    def optimizer_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name, tensor) of what the optimizer steps and the trainer unscales and clips: the trainable
        parameters themselves (DTensor shards under FSDP2), or their shards at ZeRO stage 1."""
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Install what must follow each optimizer step (nothing when the optimizer updates the weights)."""

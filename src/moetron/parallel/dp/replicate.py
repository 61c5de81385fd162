"""Data parallelism: dense parameters over the data-parallel group, routed experts over their expert-data-parallel
group, both reduced while the backward pass is still running.

Dense: `DistributedDataParallel` over the `dp` group (its bucketed all-reduce overlaps the backward; `no_sync`
during gradient accumulation). Every replica starts from the same weights (they are drawn per parameter name).

Experts: each rank holds `E / ep` experts, replicated over the `edp` ranks that hold the same shard. The
all-to-all backward already brought every expert-parallel peer's tokens into this rank's expert gradients, so
the sum over `edp` covers every data-parallel rank's loss once, and dividing by the full `dp` makes it their
mean — the same value as with ep = 1 (DeepSpeed's rule, PR #5259). `ExpertGradReducer` does that sum with
PyTorch's post-accumulate-grad hooks and asynchronous all-reduces, launched while the backward continues.
It is not a second DDP over the edp group because DDP's forward hook runs again when activation checkpointing
recomputes a layer inside the backward, and DDP then marks the same parameters ready twice. The all-reduces are
launched in one fixed order on every rank (a gradient whose turn has not come waits, and any gradient missing
at the end is zero-filled and reduced in that order too), so ranks can never pair up different collectives.

ZeRO (`zero.py`): stage 1 keeps this reduction and shards only the optimizer state (`sharded_optimizer.py`);
stages 2–3 replace both reductions by FSDP2's reduce-scatters (`fsdp.py`). Whatever the stage, `DataParallel`
(`base.py`, below both) tells the trainer which tensors the optimizer steps (`optimizer_parameters`).
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from moetron.parallel.diagnosis import Site
from moetron.parallel.dp.base import DataParallel
from moetron.parallel.dp.exact_buckets import reduce_in_a_fixed_order
from moetron.parallel.dp.fsdp import apply_fsdp
from moetron.parallel.dp.sharded_optimizer import OptimizerShards
from moetron.parallel.dp.zero_spec import REPLICATED, ZeroSpec
from moetron.parallel.mesh import ParallelMesh
from moetron.parallel.params import ParamRegistry


class ExpertGradReducer:
    """Sum expert gradients over `group` and divide by `divide_by`, overlapping the backward pass."""

    def __init__(self, params: list[nn.Parameter], group, divide_by: int):
        self.params = list(reversed(params))  # the backward produces the last layers' gradients first
        self.group, self.divide_by = group, divide_by
        self.site = Site("the gradient reduction of the experts", group, "expert-data-parallel")
        self.position = {id(p): i for i, p in enumerate(self.params)}
        self.enabled = False
        self._ready: set[int] = set()
        self._next = 0  # index in self.params of the next gradient to launch
        self._pending: list = []
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_gradient)

    def start(self, last_micro_batch: bool) -> None:
        """Call before each micro-batch's backward: reduce only in the last one (the others accumulate)."""
        self.enabled = last_micro_batch

    def _on_gradient(self, param: nn.Parameter) -> None:
        if not self.enabled:
            return
        self._ready.add(self.position[id(param)])
        while self._next in self._ready:
            self._launch(self.params[self._next])
            self._next += 1

    def _launch(self, param: nn.Parameter) -> None:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        param.grad.div_(self.divide_by)
        self._pending.append(dist.all_reduce(param.grad, group=self.group, async_op=True))

    def finish(self) -> None:
        """After the last backward: launch what is left (in order), wait for every reduction."""
        with self.site:
            for param in self.params[self._next :]:
                self._launch(param)
            for work in self._pending:
                work.wait()
        self._pending.clear()
        self._ready.clear()
        self._next = 0
        self.enabled = False


class ShardedOptimizerDataParallel(DataParallel):
    """ZeRO stage 1: stage 0's reductions, then the optimizer steps this rank's shards (`OptimizerShards`)."""

    def __init__(self, model, module, expert_reducer, shards: OptimizerShards):
        super().__init__(model, module, expert_reducer)
        self.shards = shards

    def finish_gradients(self) -> None:
        super().finish_gradients()
        self.shards.shard_gradients()

    def optimizer_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return self.shards.named_parameters()

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.shards.attach(optimizer)


def apply_dp(
    model: nn.Module, registry: ParamRegistry, mesh: ParallelMesh, zero: ZeroSpec = REPLICATED, ddp: bool = True
) -> DataParallel:
    """Stage 0/1: DDP over the dense parameters (dp group) and the expert reducer (edp group), at stage 1 with the
    optimizer on shards; stages 2–3: FSDP2. Nothing in one process (there is nothing to shard).

    `ddp=False`: no DDP, the caller reduces the dense gradients (the zero-bubble pipeline schedule computes weight
    gradients with `autograd.grad`, so DDP's hooks never see them)."""
    if not mesh.distributed:
        return DataParallel(model, model, None)
    if zero.uses_fsdp:
        return apply_fsdp(model, mesh, zero)
    replicated = _replicate(model, registry, mesh, ddp)
    if not zero.shards_optimizer:
        return replicated
    groups = [(mesh.submesh("dp_cp"), registry.named_parameters(model, "dense"))]
    groups.append((mesh.submesh("edp"), registry.named_parameters(model, "expert")))
    shards = OptimizerShards([(m, named) for m, named in groups if named])
    return ShardedOptimizerDataParallel(model, replicated.module, replicated.expert_reducer, shards)


def _replicate(model: nn.Module, registry: ParamRegistry, mesh: ParallelMesh, ddp: bool = True) -> DataParallel:
    experts = registry.named_parameters(model, "expert")
    reducer = None
    if experts and mesh.size("edp") * mesh.size("ep") > 1:
        # dp_cp: context-parallel peers are gradient replicas too (dp without context parallelism)
        reducer = ExpertGradReducer([p for _, p in experts], mesh.group("edp"), divide_by=mesh.size("dp_cp"))
    module: nn.Module = model
    if mesh.size("dp_cp") > 1 and ddp:
        ignored = [n for n, _ in experts]
        if ignored:
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
        device = next(model.parameters()).device
        device_ids = [device.index] if device.type == "cuda" else None
        _accept_dtensor_parameters(model)
        # No buffer broadcast per forward: the only buffers that change (expert biases) are updated identically on
        # every rank from all-reduced loads, so re-broadcasting them would be a wasted collective.
        module = DistributedDataParallel(
            model, device_ids=device_ids, process_group=mesh.group("dp_cp"), **_no_forward_buffer_sync()
        )
        reduce_in_a_fixed_order(module)  # the same sums on every step of every process: resume bit-exact
    return DataParallel(model, module, reducer)


def _accept_dtensor_parameters(model: nn.Module) -> None:
    """DDP reduces local tensors: a model with DTensor parameters (tensor parallelism) is first given local views
    by torch's own DDP + TP composition (replaced by the DTensors again after each forward)."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):
        from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform

        _pre_dp_module_transform(model)


def _no_forward_buffer_sync() -> dict:
    """`forward_sync_buffers=False` where torch has it (it deprecates `broadcast_buffers`), else the old flag."""
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}

"""Host reads (host syncs on a GPU) of one MoE layer step on the CUDA code path: counted, never timed.

The modes and the measured step are tests/support/host_sync_steps.py's, which benchmarks/host_syncs.py prints, so
the test asserts what the benchmark prints.
"""

from __future__ import annotations

import pytest
import torch
from host_read_counter import HostReadCounter, cuda_code_path
from host_sync_steps import EXPERTS, LOCAL_MODES, layer_config, local_reads

from moetron.model import backends
from moetron.model.moe.layer import MoELayer
from moetron.model.moe.routing import deepspeed_gating


@pytest.mark.parametrize("mode", list(LOCAL_MODES))
def test_grouped_mm_step_reads_nothing_on_the_host(mode):
    reads = local_reads(mode, "grouped_mm")
    assert reads.total == 0, dict(reads.by_kind)


@pytest.mark.parametrize("mode", list(LOCAL_MODES))
def test_batched_step_reads_only_the_dropless_max_load(mode):
    reads = local_reads(mode, "batched")
    expected = {"__int__": 1} if "dropless" in mode else {}  # PaddedLayout's int(counts.max())
    assert dict(reads.by_kind) == expected


def test_the_cpu_path_reads_where_reads_are_free():
    """Outside cuda_code_path the CPU-only kernels run, and the RTS sort path reads the device once on purpose."""
    torch.manual_seed(0)
    layer = MoELayer(layer_config("grouped_mm", **LOCAL_MODES["capacity top-1 RTS"]), EXPERTS, layer_index=1)
    with HostReadCounter() as reads:
        layer(torch.randn(2, 64, 64))
    assert dict(reads.by_kind) == {"__bool__": 1}
    cpu = torch.device("cpu")
    cpu_experts, sort_keep = backends.experts_backend(cpu), deepspeed_gating.keep_top_random_keys_top1
    assert cpu_experts is not backends.ATEN_EXPERTS  # the CPU backend (tests/conftest.py registers it, as build does)
    with cuda_code_path():  # every CPU-only kernel is swapped for what CUDA runs
        assert backends.experts_backend(cpu) is backends.ATEN_EXPERTS
        assert deepspeed_gating.keep_top_random_keys_top1 is not sort_keep
    assert backends.experts_backend(cpu) is cpu_experts  # restored
    assert deepspeed_gating.keep_top_random_keys_top1 is sort_keep


def test_dropless_capacity_is_read_on_demand_only():
    torch.manual_seed(0)
    layer = MoELayer(layer_config("grouped_mm", **LOCAL_MODES["dropless top-2"]), EXPERTS, layer_index=1)
    with HostReadCounter() as reads, cuda_code_path():
        _, aux = layer(torch.randn(1, 64, 64))
    assert reads.total == 0
    routing = aux.routing
    assert isinstance(routing.capacity_source, torch.Tensor) and routing.host_capacity is None
    with HostReadCounter() as reads:
        assert routing.capacity == int(routing.tokens_per_expert_E.max())  # the int, on demand
        assert routing.capacity == routing.capacity_source  # kept: read once
    assert reads.by_kind["__int__"] == 2  # routing.capacity's one read + the test's own int(...)
    layer.router.cfg.moe_token_dropping = True
    _, aux = layer(torch.randn(1, 64, 64))
    assert aux.capacity == aux.routing.host_capacity == aux.routing.capacity == 16  # capacity mode: a host int


def test_counter_sees_reads_in_forward_backward_and_hooks_and_restores_tensor():
    class ReadsInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a * 1

        @staticmethod
        def backward(ctx, grad):
            grad.tolist()
            return grad

    methods = dict(torch.Tensor.__dict__)
    x = torch.randn(3, requires_grad=True)
    with HostReadCounter() as reads:
        y = ReadsInBackward.apply(x * 2)
        y.register_hook(lambda g: g if g.sum().item() else g)
        bool(y.sum() > 0)
        y.to("cpu").sum().backward()
        x.to(torch.float64)  # a dtype change is no host read
        torch.autograd.grad(ReadsInBackward.apply(x).sum(), x)
    assert dict(reads.by_kind) == {"__bool__": 1, "to": 1, "item": 1, "tolist": 2}
    assert dict(torch.Tensor.__dict__) == methods  # the wrapped read methods are restored

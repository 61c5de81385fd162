"""ZeRO-2/3's expert-gradient reduction settings per backend (NCCL's checked here, without a GPU): whatever the
backend and the expert-data-parallel size, the experts' gradients end up summed over edp and divided by dp once.

FSDP2's own rule (its private `_get_gradient_divide_factors`) turns the settings into the collective's
reduce op and the divisions around it; composing the two gives the total divisor. With edp = 1 no collective runs
and FSDP2 copies the gradient: our settings leave it no divide factor there (a plain copy in every torch version;
2.13 would divide the copy by one and then, under gloo's sum-then-divide, again), so the divisor is `divide_after`
alone — the same settings on gloo and NCCL, which the 4-rank gloo test (test_zero_grad_norm.py) then measures.
"""

from __future__ import annotations

import pytest
import torch

from moetron.parallel.dp.fsdp import ExpertReduction, expert_reduction, policies
from moetron.parallel.dp.zero_spec import ZeroSpec

DP = 4


@pytest.mark.parametrize(
    ("backend", "edp", "want"),
    [
        ("nccl", 1, ExpertReduction(divide_factor=None, force_sum=False, divide_after=DP)),
        ("gloo", 1, ExpertReduction(divide_factor=None, force_sum=False, divide_after=DP)),
        ("nccl", 2, ExpertReduction(divide_factor=float(DP), force_sum=False, divide_after=1)),
        ("gloo", 2, ExpertReduction(divide_factor=float(DP), force_sum=True, divide_after=1)),
    ],
)
def test_expert_reduction_settings(backend, edp, want):
    assert expert_reduction(backend, edp, DP) == want


class _Group:
    """What FSDP2's divide-factor rule reads of a process group: its size."""

    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size


def _total_divisor(reduction: ExpertReduction, edp: int, reduce_dtype: torch.dtype, device_type: str) -> float:
    """How much FSDP2 (torch's own rule) and then `finish_gradients` divide the edp-summed gradient by."""
    collectives = pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_collectives")
    from torch.distributed import ReduceOp

    pre, post, op, _ = collectives._get_gradient_divide_factors(
        _Group(edp), None, reduce_dtype, device_type, reduction.divide_factor, reduction.force_sum
    )
    divisor = (pre or 1.0) * (post or 1.0) * reduction.divide_after
    if edp == 1:  # no collective: FSDP2 (torch 2.13) copies the gradient divided by the divide factor, if any
        return divisor * (reduction.divide_factor or 1.0)
    if op == ReduceOp.AVG:
        return divisor * edp
    if getattr(op, "op", None) == ReduceOp.PREMUL_SUM:
        return divisor / op.factor
    assert op == ReduceOp.SUM, op
    return divisor


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("backend", "device_type"), [("nccl", "cuda"), ("gloo", "cpu")])
@pytest.mark.parametrize("edp", [1, 2])
def test_experts_are_divided_by_dp_once(backend, device_type, edp, compute_dtype):
    reduce_dtype = policies(ZeroSpec(2, compute_dtype))[0].reduce_dtype or torch.float32  # None: the grads' fp32
    divisor = _total_divisor(expert_reduction(backend, edp, DP), edp, reduce_dtype, device_type)
    assert divisor == pytest.approx(DP)

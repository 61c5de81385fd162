"""benchmarks/gemm_floor.py: a step's GEMMs are recorded with their layouts and shared buffers, and replay alone."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def gemm_floor(monkeypatch):
    monkeypatch.syspath_prepend(REPO / "benchmarks")
    import gemm_floor

    return gemm_floor


def test_a_linear_steps_gemms_are_recorded_with_their_flops_and_replayed(gemm_floor):
    layer = torch.nn.Linear(16, 24)
    x = torch.randn(10, 16)

    def step():
        layer.zero_grad(set_to_none=True)
        (layer(x).relu() @ torch.randn(24, 8)).sum().backward()

    calls = gemm_floor.record_gemms(step)
    names = [call.op.overloadpacket.__name__ for call in calls]
    assert names.count("addmm") == 1 and names.count("mm") >= 3  # forward (bias) + the product, two gradients
    # forward 10·16·24 + 10·24·8, backward: d(relu) 10·8·24, dW 24·10·16 (dx of x is not needed)
    assert gemm_floor.gemm_flops(calls) == 2 * (10 * 16 * 24 + 10 * 24 * 8 + 10 * 8 * 24 + 24 * 10 * 16)
    assert gemm_floor.replay_seconds(calls, time.perf_counter, reps=2) > 0


def test_shared_buffers_stay_shared_and_integer_arguments_keep_their_values(gemm_floor):
    w = torch.randn(8, 8)
    x = torch.randn(4, 8)
    out = torch.empty(4, 8)

    def step():
        torch.mm(x, w.T, out=out)
        out.addmm_(x, w)

    calls = gemm_floor.record_gemms(step)
    replay = gemm_floor._materialise(calls)
    (_, (a0, b0), kw0), (_, (c1, a1, b1), _) = replay
    assert b0.data_ptr() == b1.data_ptr() and b0.stride() == (1, 8) and b1.stride() == (8, 1)  # W and Wᵀ: one buffer
    assert kw0["out"].data_ptr() == c1.data_ptr() and a0.data_ptr() == a1.data_ptr()
    offsets = torch.tensor([3, 7], dtype=torch.int32)
    spec = gemm_floor._spec(offsets)
    assert torch.equal(spec.values, offsets) and gemm_floor._spec(w).values is None

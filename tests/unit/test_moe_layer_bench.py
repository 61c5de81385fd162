"""benchmarks/moe_layer.py's timing loop: a median time and a median page-fault count per implementation."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def moe_layer(monkeypatch):
    monkeypatch.syspath_prepend(REPO / "benchmarks")  # the benchmark under test, not a helper
    import moe_layer

    return moe_layer


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="minor-fault counts are read from getrusage")
def test_median_times_counts_the_page_faults_of_each_step(moe_layer):
    leaf = torch.zeros(4, requires_grad=True)

    def fresh_pages() -> torch.Tensor:  # 64 MiB of new anonymous pages every call, whatever the allocator holds
        with mmap.mmap(-1, 64 << 20) as region:
            for offset in range(0, len(region), mmap.PAGESIZE):
                region[offset] = 1
        return leaf

    def nothing() -> torch.Tensor:
        return leaf

    steps = {"faults": moe_layer.Step(fresh_pages, [leaf]), "none": moe_layer.Step(nothing, [leaf])}
    seconds, faults = moe_layer.median_times(steps, reps=3, warmup=1, clock=moe_layer.CLOCKS["cpu"])
    assert set(seconds) == set(faults) == set(steps)
    assert all(value >= 0 for value in seconds.values())
    assert faults["faults"] >= 16  # 16384 4 KiB pages, or 32 huge pages where THP is "always"
    assert faults["none"] == 0


def test_kernel_mode_steps_both_engines_and_checks_their_bits(moe_layer):
    from moetron.cpu import experts as cpu_kernels

    rows = moe_layer.run_kernel(moe_layer.Shape(64, 16, 32, 4, 1), reps=1, warmup=0, clock=moe_layer.CLOCKS["cpu"])
    if cpu_kernels.compiled_engine() is None:
        assert rows[0].startswith("<!-- the C++ engine is not available here")
        return
    assert [row.split(" | ")[1] for row in rows] == ["dropless", "capacity"]
    assert all(row.endswith("| True |") for row in rows)  # both engines: the same outputs and gradients
    assert cpu_kernels.swiglu_engine(torch.zeros(2, 8), *(torch.zeros(1, 8, 8),) * 3) is cpu_kernels.compiled_engine()


def test_phases_mode_marks_every_phase_in_order_and_they_sum_to_the_total(moe_layer):
    """The experts' backward is marked when their node has run, also where their input is the layer's own input
    (token order), so no phase is empty or negative and the phases add up to the step."""
    rows = moe_layer.run_phases(moe_layer.Shape(64, 16, 32, 4, 1), reps=1, warmup=0, clock=moe_layer.CLOCKS["cpu"])
    for kind in ("moetron dropless", "moetron capacity"):
        phases = {row.split(" | ")[2]: float(row.split(" | ")[3].rstrip(" |")) for row in rows if f"| {kind} |" in row}
        assert "backward: experts" in phases and "backward: combine" in phases
        assert all(value >= 0 for value in phases.values())
        total = phases.pop("total")
        assert abs(sum(phases.values()) - total) <= 0.01 * max(total, 1.0)  # each printed to 3 decimals

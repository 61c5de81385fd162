"""Host reads of one MoE layer step with the all-to-all dispatcher (EP = 2, two gloo processes), on the CUDA
code path: at most one per rank, the `.tolist()` of the exchanged split sizes. benchmarks/host_syncs.py spawns
the group and measures; this test asserts what it prints."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from host_syncs import ep_reads  # noqa: E402


@pytest.mark.distributed
def test_expert_parallel_step_reads_only_the_split_sizes():
    per_rank = ep_reads("grouped_mm", world=2)
    assert per_rank == [{"tolist": 1}, {"tolist": 1}]

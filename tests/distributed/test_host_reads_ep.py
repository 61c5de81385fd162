"""Host reads of one MoE layer step with the all-to-all dispatcher (EP = 2, two gloo processes), on the CUDA
code path: at most one per rank, the `.tolist()` of the exchanged split sizes. tests/support/host_sync_steps.py spawns
the group and measures (benchmarks/host_syncs.py prints it); this test asserts the counts."""

from __future__ import annotations

import pytest
from host_sync_steps import ep_reads


@pytest.mark.distributed
def test_expert_parallel_step_reads_only_the_split_sizes():
    per_rank = ep_reads("grouped_mm", world=2)
    assert per_rank == [{"tolist": 1}, {"tolist": 1}]

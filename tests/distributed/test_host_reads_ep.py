"""Host reads of one MoE layer step with the all-to-all dispatchers (EP = 2, two gloo processes), on the CUDA code
path: the uneven-split dispatcher reads once per rank (the `.tolist()` of the exchanged split sizes); the
static-shape one (`--moe-ep-dispatch static`) never. tests/support/host_sync_steps.py spawns the group and measures
both (benchmarks/host_syncs.py prints them); this test asserts the counts."""

from __future__ import annotations

import pytest
from host_sync_steps import ep_reads


@pytest.mark.distributed
def test_expert_parallel_step_reads_only_the_split_sizes_and_nothing_when_static():
    per_rank = ep_reads("grouped_mm", world=2)
    assert [by_mode["EP=2 all-to-all"] for by_mode in per_rank] == [{"tolist": 1}, {"tolist": 1}]
    assert [by_mode["EP=2 all-to-all static"] for by_mode in per_rank] == [{}, {}]

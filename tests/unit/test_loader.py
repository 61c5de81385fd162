"""DistributedBatchLoader: Megatron's sampler order per rank, drop_last, exhaustion and exact resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moetron.data.loader import DistributedBatchLoader


class CountingDataset:
    """Sample i = [i, i, ..., i] of seq_length + 1 tokens, so a batch shows which indices it holds."""

    def __init__(self, n: int, seq_length: int = 4):
        self.n, self.seq_length = n, seq_length

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return np.full(self.seq_length + 1, i, dtype=np.int64)


def megatron_sampler(total, consumed, mbs, rank, dp):
    """MegatronPretrainingSampler as described: sequential blocks of mbs·dp, rank slice, drop_last."""
    batch = []
    for idx in range(consumed, total):
        batch.append(idx)
        if len(batch) == mbs * dp:
            yield batch[rank * mbs : (rank + 1) * mbs]
            batch = []


def indices(batch: torch.Tensor) -> list[int]:
    return batch[:, 0].tolist()


@pytest.mark.parametrize("mbs,dp", [(2, 3), (1, 1), (4, 2)])
def test_rank_slices_follow_megatron_sampler(mbs, dp):
    ds = CountingDataset(29)
    for rank in range(dp):
        loader = DistributedBatchLoader(ds, mbs, rank, dp)
        batches = list(loader)
        assert all(b.dtype == torch.int64 and b.shape == (mbs, 5) for b in batches)
        assert [indices(b) for b in batches] == list(megatron_sampler(29, 0, mbs, rank, dp))
        assert loader.consumed_samples == len(batches) * mbs * dp == 29 // (mbs * dp) * mbs * dp


def test_exhaustion_raises_stop_iteration():
    loader = DistributedBatchLoader(CountingDataset(10), 2, 1, 2)
    assert len(loader) == 2 and not loader.exhausted
    loader.next_micro_batch()
    loader.next_micro_batch()
    assert loader.exhausted
    with pytest.raises(StopIteration):
        loader.next_micro_batch()
    assert loader.consumed_samples == 8  # the 2 leftover samples are dropped


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_continues_exactly(num_workers):
    ds = CountingDataset(50)
    full = [indices(b) for b in DistributedBatchLoader(ds, 2, 1, 3, num_workers=num_workers)]
    first = DistributedBatchLoader(ds, 2, 1, 3, num_workers=num_workers)
    head = [indices(first.next_micro_batch()) for _ in range(3)]
    state = first.state_dict()
    assert state == {"consumed_samples": 18}
    resumed = DistributedBatchLoader(ds, 2, 1, 3, consumed_samples=state["consumed_samples"])
    assert head + [indices(b) for b in resumed] == full
    reloaded = DistributedBatchLoader(ds, 2, 1, 3, num_workers=num_workers)
    reloaded.next_micro_batch()  # move, then jump back via the checkpoint state
    reloaded.load_state_dict(state)
    assert head + [indices(b) for b in reloaded] == full
    first.close()
    reloaded.close()


def test_resume_with_another_data_parallel_size():
    ds = CountingDataset(40)
    two = [DistributedBatchLoader(ds, 2, r, 2) for r in range(2)]
    seen = [i for _ in range(3) for loader in two for i in indices(loader.next_micro_batch())]
    one = DistributedBatchLoader(ds, 4, 0, 1, consumed_samples=two[0].consumed_samples)
    assert seen == list(range(12)) and indices(one.next_micro_batch()) == [12, 13, 14, 15]


def test_bad_shape_rejected():
    with pytest.raises(ValueError, match="rank 2 of 2"):
        DistributedBatchLoader(CountingDataset(4), 1, 2, 2)

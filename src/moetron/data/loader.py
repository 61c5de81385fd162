"""The rank-aware, resumable batch loader: Megatron's `MegatronPretrainingSampler` order, without a DataLoader.

All data-parallel ranks walk the same global index sequence from `consumed_samples`: each step takes the
next block of `micro_batch_size · dp_size` indices and rank r keeps `[r·mbs, (r+1)·mbs)` of it; a final
incomplete block is dropped. The position is one number, the global `consumed_samples` (all ranks' samples),
so a checkpoint restores it exactly and it stays valid when the data-parallel size changes between runs.

With `num_workers > 0` a background thread pool reads the next micro-batches ahead (the order is unchanged;
reading is numpy and mmap, which release the GIL for the copies).

Context parallelism: the `cp_size` ranks of one data-parallel replica read the same samples (the block of their
`dp_rank`; no rank reads more than its replica's samples) and keep their zigzag chunks of each sequence
(`local_chunks`, applied to the inputs and to the labels after the one-token shift, `data/context_chunks.py`).
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from moetron.data.context_chunks import take_zigzag


class DistributedBatchLoader:
    """Micro-batches `[mbs, seq_length + 1]` (int64) of `dataset` for data-parallel rank `dp_rank` of `dp_size`.

    `next_micro_batch()` raises StopIteration when fewer than `mbs · dp_size` samples remain (check
    `exhausted` to tell it apart beforehand); iterating the loader yields micro-batches until then.
    """

    def __init__(self, dataset, micro_batch_size: int, dp_rank: int, dp_size: int, consumed_samples: int = 0,
                 num_workers: int = 0, prefetch: int = 2, cp_rank: int = 0, cp_size: int = 1):  # fmt: skip
        if micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"bad loader shape: micro_batch_size={micro_batch_size}, rank {dp_rank} of {dp_size}")
        if not 0 <= cp_rank < cp_size:
            raise ValueError(f"bad loader shape: context-parallel rank {cp_rank} of {cp_size}")
        self.cp_rank, self.cp_size = cp_rank, cp_size
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")
        self.dataset = dataset
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self._consumed = int(consumed_samples)
        self._pool = ThreadPoolExecutor(num_workers) if num_workers > 0 else None
        self._ahead: deque[tuple[int, Future]] = deque()  # (consumed_samples it was read at, pending batch)
        self._prefetch = max(1, prefetch)

    @property
    def step_samples(self) -> int:
        """Samples one micro-batch step consumes over all ranks: `mbs · dp_size`."""
        return self.micro_batch_size * self.dp_size

    @property
    def consumed_samples(self) -> int:
        """Samples consumed so far by all data-parallel ranks together (the resume position)."""
        return self._consumed

    @property
    def next_first_sample(self) -> int:
        """Dataset index of the first sample of the micro-batch `next_micro_batch()` returns next (it keys the
        model's random streams, so draws follow the samples, not the rank that reads them)."""
        return int(self.rank_indices(self._consumed)[0])

    @property
    def remaining_micro_batches(self) -> int:
        return max(0, (len(self.dataset) - self._consumed) // self.step_samples)

    @property
    def exhausted(self) -> bool:
        return self.remaining_micro_batches == 0

    def rank_indices(self, consumed: int) -> np.ndarray:
        """The dataset indices this rank reads in the step that starts at global position `consumed`."""
        start = consumed + self.dp_rank * self.micro_batch_size
        return np.arange(start, start + self.micro_batch_size, dtype=np.int64)

    def local_chunks(self, x_BT: torch.Tensor) -> torch.Tensor:
        """This context-parallel rank's zigzag chunks of `x_BT` (inputs `batch[:, :-1]` or labels `batch[:, 1:]`
        of a micro-batch); `x_BT` itself without context parallelism."""
        return take_zigzag(x_BT, self.cp_rank, self.cp_size)

    def _read(self, consumed: int) -> torch.Tensor:
        samples = [np.asarray(self.dataset[int(i)], dtype=np.int64) for i in self.rank_indices(consumed)]
        return torch.from_numpy(np.stack(samples))

    def next_micro_batch(self) -> torch.LongTensor:
        """This rank's next micro-batch; advances `consumed_samples` by `mbs · dp_size`."""
        if self.exhausted:
            raise StopIteration(f"data exhausted after {self._consumed} of {len(self.dataset)} samples")
        if self._pool is None:
            batch = self._read(self._consumed)
        else:
            batch = self._take_prefetched()
        self._consumed += self.step_samples
        return batch

    def _take_prefetched(self) -> torch.Tensor:
        if self._ahead and self._ahead[0][0] != self._consumed:  # position changed (load_state_dict)
            self._ahead.clear()
        position = self._ahead[-1][0] + self.step_samples if self._ahead else self._consumed
        while len(self._ahead) < self._prefetch and position + self.step_samples <= len(self.dataset):
            self._ahead.append((position, self._pool.submit(self._read, position)))
            position += self.step_samples
        return self._ahead.popleft()[1].result()

    def __iter__(self):
        return self

    def __next__(self) -> torch.LongTensor:
        return self.next_micro_batch()

    def __len__(self) -> int:
        return self.remaining_micro_batches

    def state_dict(self) -> dict:
        return {"consumed_samples": self._consumed}

    def load_state_dict(self, state: dict) -> None:
        consumed = int(state["consumed_samples"])
        if consumed < 0:
            raise ValueError(f"consumed_samples must be >= 0, got {consumed}")
        self._consumed = consumed
        self._ahead.clear()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

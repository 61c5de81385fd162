"""A loader of random tokens with the trainer's loader interface, for tests and benchmarks (where the data path is
not what is measured). Benchmarks reach it by putting tests/support on their path.

The loader interface every consumer relies on: `next_micro_batch()` → int64 `[mbs, seq + 1]`;
`next_first_sample` → the dataset index of that batch's first sample (keys the model's random streams);
`state_dict()` / `load_state_dict()` → the resume position.
"""

from __future__ import annotations

import torch


class RandomTokenLoader:
    """Endless random micro-batches; batch i of data-parallel rank r is "samples" (i·dp + r)·mbs … + mbs − 1."""

    def __init__(self, micro_batch_size: int, seq_length: int, vocab_size: int, seed: int = 0,
                 dp_rank: int = 0, dp_size: int = 1):  # fmt: skip
        self.shape, self.vocab = (micro_batch_size, seq_length + 1), vocab_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.generator = torch.Generator().manual_seed(seed)
        self.consumed_samples = 0

    @property
    def next_first_sample(self) -> int:
        return self.consumed_samples + self.dp_rank * self.shape[0]

    def next_micro_batch(self) -> torch.Tensor:
        self.consumed_samples += self.shape[0] * self.dp_size
        return torch.randint(0, self.vocab, self.shape, generator=self.generator)

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples = int(state["consumed_samples"])

"""The index arithmetic of Megatron's GPTDataset, reproduced exactly and vectorised with numpy.

A GPT sample is `seq_length + 1` consecutive tokens of the stream made by concatenating documents in
`doc_idx` order; consecutive samples overlap by one token (the last input token of sample i is the first of
sample i+1), so sample i spans stream positions `[i·seq_length, (i+1)·seq_length]`. Three arrays describe it:

- `doc_idx` (int32): the split's document ids repeated once per epoch and shuffled (the last epoch separately
  when it would be used for less than 80% of its samples).
- `sample_idx` (int64, `[num_samples + 1, 2]`): row i = (position in doc_idx, token offset in that document)
  where sample i starts; sample i runs from row i to row i+1, both ends inclusive.
- `shuffle_idx` (uint32, or int64 when that could overflow): the order samples are served in.

One `np.random.RandomState(seed)` draws the doc_idx shuffle(s) first and then the shuffle_idx shuffle(s), as
Megatron does, so the same inputs give the same samples in the same order. Megatron's C++ `build_sample_idx`
walks every document in a loop; here each row is found with one `np.searchsorted` over document end positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moetron.data.config import parse_split

# Megatron separates the last epoch when it supplies fewer than this share of an epoch's samples.
SEPARATE_LAST_EPOCH_FRACTION = 0.80


def get_train_valid_test_split(split: str, size: int) -> list[int]:
    """Document boundaries `[0, b1, b2, size]` of train/valid/test (Megatron's `get_train_valid_test_split_`).

    Each boundary adds `round(fraction · size)`; then all boundaries after the first shift so the last is `size`.
    """
    weights = parse_split(split)
    total = sum(weights)
    bounds = [0]
    for weight in weights:
        bounds.append(bounds[-1] + int(round(weight / total * float(size))))
    excess = bounds[-1] - size
    return [bounds[0]] + [b - excess for b in bounds[1:]]


def num_epochs_for(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Smallest E with `(E·tokens_per_epoch − 1) // seq_length >= num_samples` (at least 1)."""
    if tokens_per_epoch <= 1:
        raise ValueError(f"a split needs at least 2 tokens to make a sample, it has {tokens_per_epoch}")
    # (E·T − 1) // S >= N  ⇔  E·T − 1 >= N·S  ⇔  E >= (N·S + 1) / T
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def separate_last_epoch(num_epochs: int, tokens_per_epoch: int, seq_length: int, num_samples: int) -> bool:
    """Whether the last epoch is shuffled on its own (it would supply < 80% of an epoch's samples)."""
    if num_epochs == 1:
        return False
    from_earlier_epochs = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    last_epoch_samples = num_samples - from_earlier_epochs
    samples_per_epoch = (tokens_per_epoch - 1) // seq_length
    return last_epoch_samples < int(SEPARATE_LAST_EPOCH_FRACTION * samples_per_epoch)


def build_doc_idx(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_last: bool):
    """The documents repeated `num_epochs` times and shuffled (the last epoch on its own when `separate_last`)."""
    if separate_last and num_epochs > 1:
        first = build_doc_idx(documents, num_epochs - 1, rng, False)
        last = build_doc_idx(documents, 1, rng, False)
        return np.concatenate((first, last))
    doc_idx = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
    rng.shuffle(doc_idx)
    return doc_idx


def build_sample_idx(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_epochs: int, tokens_per_epoch: int):
    """`[num_samples + 1, 2]` int64 rows (doc_idx position, offset) where each sample starts.

    Row k is the stream position `k·seq_length`, placed in the document that contains it (empty documents
    contain nothing and are skipped); row 0 is (0, 0) as in Megatron even when the first document is empty.
    """
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    doc_lengths = sizes[doc_idx].astype(np.int64)
    doc_ends = np.cumsum(doc_lengths)
    positions = np.arange(1, num_samples + 1, dtype=np.int64) * seq_length
    doc_positions = np.searchsorted(doc_ends, positions, side="right")
    sample_idx = np.zeros((num_samples + 1, 2), dtype=np.int64)
    sample_idx[1:, 0] = doc_positions
    sample_idx[1:, 1] = positions - (doc_ends[doc_positions] - doc_lengths[doc_positions])
    return sample_idx


def build_shuffle_idx(num_shuffled_together: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of `[0, num_shuffled_together)` followed by a separate permutation of the rest."""
    dtype = shuffle_dtype(total)
    first = np.arange(num_shuffled_together, dtype=dtype)
    rng.shuffle(first)
    if num_shuffled_together == total:
        return first
    last = np.arange(num_shuffled_together, total, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def shuffle_dtype(total: int) -> type:
    """uint32 halves the file; int64 once `total` reaches 2^32 − 2 (Megatron's threshold)."""
    return np.int64 if total >= np.iinfo(np.uint32).max - 1 else np.uint32


@dataclass
class IndexPlan:
    """What one GPTDataset's index needs, computed cheaply on every rank (the cache key depends on it)."""

    documents: np.ndarray  # int32 document ids of the split
    num_samples: int  # requested samples
    seq_length: int
    seed: int
    tokens_per_epoch: int
    num_epochs: int

    @classmethod
    def make(cls, documents, sizes: np.ndarray, num_samples: int, seq_length: int, seed: int) -> IndexPlan:
        documents = np.asarray(documents, dtype=np.int32)
        tokens_per_epoch = int(np.sum(sizes[documents], dtype=np.int64))
        num_epochs = num_epochs_for(tokens_per_epoch, seq_length, num_samples)
        return cls(documents, num_samples, seq_length, seed, tokens_per_epoch, num_epochs)

    @property
    def separate_last_epoch(self) -> bool:
        return separate_last_epoch(self.num_epochs, self.tokens_per_epoch, self.seq_length, self.num_samples)


def build_index_mappings(plan: IndexPlan, sizes: np.ndarray) -> dict[str, np.ndarray]:
    """doc_idx, sample_idx and shuffle_idx for `plan`, drawing the RNG in Megatron's order."""
    rng = np.random.RandomState(seed=plan.seed)
    separate = plan.separate_last_epoch
    doc_idx = build_doc_idx(plan.documents, plan.num_epochs, rng, separate)
    sample_idx = build_sample_idx(sizes, doc_idx, plan.seq_length, plan.num_epochs, plan.tokens_per_epoch)
    total = sample_idx.shape[0] - 1
    together = ((plan.num_epochs - 1) * plan.tokens_per_epoch - 1) // plan.seq_length if separate else total
    shuffle_idx = build_shuffle_idx(together, total, rng)
    return {"doc": doc_idx, "sample": sample_idx, "shuffle": shuffle_idx}

"""Blending several datasets by weight, exactly as Megatron's BlendableDataset and `build_blending_indices`.

Each component is asked for `ceil(total · w_i · 1.005)` samples (0.5% headroom); the blend has the sum of
those. Sample k comes from the dataset with the largest deficit `w_i · max(k, 1) − count_i` (ties → the lowest
index), taking that dataset's next unused sample. There is no randomness: the order only depends on the
weights and the size. The decisions are made in float64 with the same operations as Megatron's C++ helper, so
ties break identically.

Megatron caches the two index arrays only when `--data-cache-path` is given; so does this module.

Shapes: D = samples in the blend, B = one block of guessed decisions, K = datasets.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from moetron.data.index_cache import IndexCache, build_or_load
from moetron.errors import UserError

MAX_DATASETS = 254  # dataset_index is uint8, as in Megatron
HEADROOM = 1.005


def blend_num_samples(weights: Sequence[float], num_samples: int) -> list[int]:
    """Samples each component must supply: `ceil(num_samples · w_i · 1.005)` (weights normalized)."""
    total = sum(weights)
    return [int(math.ceil(num_samples * (w / total) * HEADROOM)) for w in weights]


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index uint8 [size], dataset_sample_index int64 [size]) by the largest-deficit rule."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / np.sum(w)
    if len(w) > MAX_DATASETS:
        raise UserError(f"a blend holds at most {MAX_DATASETS} datasets, got {len(w)}; merge some prefixes")
    dataset_index = np.empty(size, dtype=np.uint8)
    done, counts = _speculate(w, dataset_index)
    dataset_index[done:] = np.frombuffer(step_choices(w.tolist(), counts.tolist(), done, size), dtype=np.uint8)
    # the j-th time dataset i is chosen it serves its sample j
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    for i in range(len(w)):
        chosen = dataset_index == i
        dataset_sample_index[chosen] = np.arange(int(np.count_nonzero(chosen)), dtype=np.int64)
    return dataset_index, dataset_sample_index


def step_choices(w: list[float], counts: list[int], start: int, size: int) -> bytearray:
    """The rule step by step for samples `[start, size)` from per-dataset `counts`, as Megatron's C++ loop.

    An int times a float is the same float64 product as in C++; `list.index(max)` is the lowest tied index.
    """
    choice = bytearray(size - start)
    if len(w) == 2:  # the common case, unrolled (~3x faster)
        (w0, w1), (c0, c1) = w, counts
        for k in range(start, size):
            kd = k if k > 1 else 1  # max(k, 1)
            if w1 * kd - c1 > w0 * kd - c0:  # strictly greater: ties keep dataset 0
                choice[k - start] = 1
                c1 += 1
            else:
                c0 += 1
        return choice
    datasets = range(len(w))
    for k in range(start, size):
        kd = k if k > 1 else 1
        errors = [w[i] * kd - counts[i] for i in datasets]
        best = errors.index(max(errors))
        choice[k - start] = best
        counts[best] += 1
    return choice


def _speculate(w: np.ndarray, out_D: np.ndarray) -> tuple[int, np.ndarray]:
    """Fill a prefix of `out_D` fast when the choices repeat with a short period; return (filled, counts_K).

    Weights like 0.3/0.7 or 1/3 each repeat their pattern every P samples. Guess the next block by copying
    the block P samples back, then verify the guess in one vectorised step: recompute every decision from the
    guessed counts; up to the first disagreement all decisions are right, and the decision at the
    disagreement is too (its counts only depend on the verified prefix). Gives up, leaving the rest to the
    step-by-step loop, when guesses keep failing (weights without a short period).
    """
    K, size = len(w), len(out_D)
    period = _best_period(w)
    head = min(size, 2 * period)
    out_D[:head] = np.frombuffer(step_choices(w.tolist(), [0] * K, 0, head), dtype=np.uint8)
    counts_K = np.bincount(out_D[:head], minlength=K).astype(np.int64)
    k, block, rounds, eye_KK = head, 256, 0, np.eye(K, dtype=np.int64)
    while k < size:
        rounds += 1
        if rounds >= 16 and (k - head) < rounds * 1024:
            break  # guesses keep failing: the step-by-step loop is faster
        n = min(block, size - k)
        guess_B = np.resize(out_D[k - period : k], n)  # repeat the last period
        onehot_BK = eye_KK[guess_B]
        counts_BK = np.cumsum(onehot_BK, axis=0) - onehot_BK + counts_K
        kd_B = np.maximum(np.arange(k, k + n, dtype=np.float64), 1.0)
        decided_B = np.argmax(w * kd_B[:, None] - counts_BK, axis=1)  # first max = lowest tied index
        wrong = np.flatnonzero(decided_B != guess_B)
        good = n if len(wrong) == 0 else int(wrong[0]) + 1
        out_D[k : k + good] = decided_B[:good]
        counts_K += np.bincount(decided_B[:good], minlength=K)
        k += good
        block = min(2 * block, 1 << 16) if good == n else max(256, 2 * good)
    return k, counts_K


def _best_period(w: np.ndarray, longest: int = 4096) -> int:
    """The period P <= longest for which every w_i·P is closest to a whole number."""
    periods = np.arange(1, longest + 1)
    share_PK = w[None, :] * periods[:, None]
    return int(periods[np.argmin(np.abs(share_PK - np.round(share_PK)).max(axis=1))])


class BlendableDataset:
    """`size` samples drawn from `datasets` in proportion to `weights`; `ds[k]` is the component's sample."""

    def __init__(self, datasets: list, weights: Sequence[float], size: int, data_cache_path: str | None = None,
                 is_builder: bool = True, cache_barrier: Callable[[], None] | None = None):  # fmt: skip
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = list(datasets)
        self.size = int(size)
        self.weights = np.asarray(weights, dtype=np.float64) / np.sum(weights)
        self.desc = _describe(self.datasets, self.weights, self.size)

        def build() -> dict[str, np.ndarray]:
            index, sample_index = build_blending_indices(self.weights, self.size)
            return {"index": index, "sample_index": sample_index}

        if data_cache_path:
            cache = IndexCache(self.desc, ["index", "sample_index"], [data_cache_path])
            arrays = build_or_load(cache, build, is_builder, cache_barrier)
        else:
            arrays = build()
        self.dataset_index, self.dataset_sample_index = arrays["index"], arrays["sample_index"]
        self._check_components()

    def _check_components(self) -> None:
        """Fail now, not mid-training, if a component would be asked for a sample it does not have."""
        for i, dataset in enumerate(self.datasets):
            needed = int(np.count_nonzero(np.asarray(self.dataset_index) == i))
            if needed > len(dataset):
                raise UserError(
                    f"blend component {i} ({getattr(dataset, 'prefix', '?')}) has {len(dataset)} samples but the "
                    f"blend of {self.size} draws {needed}; change the sample count or the weights"
                )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> np.ndarray:
        dataset = int(self.dataset_index[idx])  # IndexError at idx >= size, as Megatron's sanity check expects
        return self.datasets[dataset][int(self.dataset_sample_index[idx])]


def _describe(datasets: list, weights: np.ndarray, size: int) -> str:
    """Megatron's description string of a blend (components' descriptions, weights, size)."""
    parts = "".join(getattr(d, "desc", repr(d)) + "\n\n" for d in datasets)
    return f"Blendable dataset\n\nDatasets:\n{parts}Weights: {weights}\nSize: {size}\n"

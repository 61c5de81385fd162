"""Index build speed: the vectorised `build_sample_idx` against a per-document Python loop (Megatron's C++ walk).

A synthetic corpus (document sizes only, log-normal lengths like web text, mean ~600 tokens) stands in for a
preprocessed dataset: only `.sizes` enters the index. Both builders run on the same corpus in this process and
must return identical arrays; the table prints their time ratio. The vectorised full index build (doc_idx
shuffle, sample_idx, shuffle_idx) then runs on 10x the tokens and is reported as a ratio to the smaller run.

    python benchmarks/index_build.py                      # 1e8 tokens side by side, then 1e9 vectorised
    python benchmarks/index_build.py --tokens 1e7 --scale 10
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from moetron.data.blend import build_blending_indices, step_choices
from moetron.data.sample_index import IndexPlan, build_doc_idx, build_index_mappings, build_sample_idx


def synthetic_sizes(num_tokens: int, seed: int = 0) -> np.ndarray:
    """int32 document lengths (log-normal, 1..100k tokens) summing to about `num_tokens`."""
    rng = np.random.default_rng(seed)
    mean_len = 600
    lengths = rng.lognormal(mean=np.log(mean_len) - 0.5, sigma=1.0, size=int(num_tokens / mean_len * 1.1))
    sizes = np.clip(lengths, 1, 100_000).astype(np.int32)
    keep = np.searchsorted(np.cumsum(sizes, dtype=np.int64), num_tokens) + 1
    return sizes[:keep]


def loop_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch):
    """Megatron's C++ `build_sample_idx`, line for line in Python (one step per document crossed)."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    sample_idx = np.zeros((num_samples + 1, 2), dtype=np.int64)
    sizes, doc_idx = sizes.tolist(), doc_idx.tolist()
    doc_idx_index, doc_offset = 0, 0
    for sample_index in range(1, num_samples + 1):
        remaining = seq_length + 1
        while remaining != 0:
            doc_length = sizes[doc_idx[doc_idx_index]] - doc_offset
            remaining -= doc_length
            if remaining <= 0:
                doc_offset += remaining + doc_length - 1
                remaining = 0
            else:
                doc_idx_index += 1
                doc_offset = 0
        sample_idx[sample_index] = (doc_idx_index, doc_offset)
    return sample_idx


def timed(fn, *args, repeat: int = 3):
    """(result, best-of-`repeat` seconds): the minimum is the least disturbed by other processes."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn(*args)
        best = min(best, time.perf_counter() - start)
    return out, best


def side_by_side(num_tokens: int, seq_length: int, seed: int) -> tuple[float, float]:
    """(loop seconds / vectorised seconds, vectorised full-index seconds) on one corpus."""
    sizes = synthetic_sizes(num_tokens)
    documents = np.arange(len(sizes), dtype=np.int32)
    plan = IndexPlan.make(documents, sizes, (num_tokens - 1) // seq_length, seq_length, seed)
    doc_idx = build_doc_idx(documents, plan.num_epochs, np.random.RandomState(seed), False)
    args = (sizes, doc_idx, seq_length, plan.num_epochs, plan.tokens_per_epoch)
    fast, fast_s = timed(build_sample_idx, *args)
    slow, slow_s = timed(loop_sample_idx, *args)
    assert np.array_equal(fast, slow), "vectorised and loop sample_idx differ"
    _, full_s = timed(build_index_mappings, plan, sizes)
    print(f"| {num_tokens:.0e} | {len(sizes):,} | {fast.shape[0] - 1:,} | {slow_s / fast_s:.1f}x | identical |")
    return slow_s / fast_s, full_s


def full_index(num_tokens: int, seq_length: int, seed: int) -> float:
    sizes = synthetic_sizes(num_tokens)
    plan = IndexPlan.make(np.arange(len(sizes), dtype=np.int32), sizes, (num_tokens - 1) // seq_length, seq_length,
                          seed)  # fmt: skip
    _, seconds = timed(build_index_mappings, plan, sizes)
    return seconds


def blend_ratio(size: int, weights: list[float]) -> None:
    """Blending indices: the period-verified builder vs the plain step-by-step loop, same size and weights."""
    (index, _), fast = timed(build_blending_indices, weights, size, repeat=1)
    steps, slow = timed(step_choices, weights, [0] * len(weights), 0, size, repeat=1)
    assert np.array_equal(index, np.frombuffer(steps, dtype=np.uint8)), "blending builders differ"
    print(f"| {size:.0e} | {weights} | {slow / fast:.1f}x | identical |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=float, default=1e8, help="corpus size for the side-by-side run")
    parser.add_argument("--scale", type=int, default=10, help="the vectorised-only run uses tokens·scale")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--blend-samples", type=float, default=2e6)
    args = parser.parse_args()
    tokens = int(args.tokens)
    print("| tokens | documents | samples | loop / vectorised (sample_idx) | arrays |")
    print("|---|---|---|---|---|")
    ratio, small_full = side_by_side(tokens, args.seq_length, args.seed)
    big_full = full_index(tokens * args.scale, args.seq_length, args.seed)
    print(f"\nfull index (doc_idx + sample_idx + shuffle_idx), vectorised: {tokens * args.scale:.0e} tokens takes "
          f"{big_full / small_full:.1f}x the time of {tokens:.0e} tokens (tokens ratio {args.scale}x)")  # fmt: skip
    print("\n| blend samples | weights | step loop / builder | arrays |\n|---|---|---|---|")
    for weights in ([0.3, 0.7], [0.2, 0.3, 0.5]):
        blend_ratio(int(args.blend_samples), weights)


if __name__ == "__main__":
    main()

"""Blending: Megatron's per-dataset targets, the largest-deficit order against a slow reference, caching."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from data_helpers import FakeIndexed

from moetron.data import blend
from moetron.data.blend import BlendableDataset, blend_num_samples, build_blending_indices
from moetron.data.config import DataConfig
from moetron.data.gpt_dataset import build_gpt_datasets


def random_docs(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 50000, size=int(rng.integers(1, 40)), dtype=np.int32) for _ in range(n)]


def reference_blend(weights, size):
    """§3.4 step by step: largest w_i·max(k,1) − count_i, ties to the lowest index."""
    total = sum(weights)
    w = [x / total for x in weights]
    counts, index, sample = [0] * len(w), [], []
    for k in range(size):
        errors = [w[i] * max(float(k), 1.0) - float(counts[i]) for i in range(len(w))]
        best = 0
        for i in range(1, len(w)):
            if errors[i] > errors[best]:
                best = i
        index.append(best)
        sample.append(counts[best])
        counts[best] += 1
    return np.array(index, dtype=np.uint8), np.array(sample, dtype=np.int64)


WEIGHTS = [
    [0.3, 0.7],
    [0.5, 0.5],  # exact ties at every other step
    [1.0, 1.0, 1.0],
    [0.2, 0.3, 0.5],
    [0.618, 0.382],
    list(np.random.RandomState(0).dirichlet(np.ones(4))),  # no short period: the step-by-step path
]


@pytest.mark.parametrize("weights", WEIGHTS)
def test_blending_indices_match_reference(weights):
    size = 30000
    index, sample = build_blending_indices(weights, size)
    ref_index, ref_sample = reference_blend(weights, size)
    assert index.dtype == np.uint8 and sample.dtype == np.int64
    np.testing.assert_array_equal(index, ref_index)
    np.testing.assert_array_equal(sample, ref_sample)
    # proportions: every dataset within one sample of its share
    w = np.asarray(weights) / np.sum(weights)
    assert np.all(np.abs(np.bincount(index, minlength=len(w)) - w * size) <= 1.0)


def test_blend_num_samples():
    assert blend_num_samples([0.3, 0.7], 1000) == [302, 704]  # ceil(301.5), ceil(703.5)
    assert blend_num_samples([1, 1, 2], 400) == [math.ceil(100.5), math.ceil(100.5), 201]


def _fakes(tmp_path):
    docs = {"a": random_docs(40, 1), "b": random_docs(30, 2)}
    prefixes = {str(tmp_path / name): FakeIndexed(d) for name, d in docs.items()}
    return prefixes, lambda p: prefixes[p]


def test_blended_split_datasets(tmp_path):
    prefixes, opener = _fakes(tmp_path)
    a, b = prefixes
    cfg = DataConfig(data_path=["0.25", a, "0.75", b], split="8,2,0")
    train, valid, test = build_gpt_datasets(cfg, 8, 3, (100, 20, 5), open_dataset=opener)
    assert test is None  # no documents in either test split
    assert len(train) == sum(blend_num_samples([0.25, 0.75], 100)) == 26 + 76
    ref_index, ref_sample = reference_blend([0.25, 0.75], len(train))
    np.testing.assert_array_equal(train.dataset_index, ref_index)
    for k in range(len(train)):
        np.testing.assert_array_equal(train[k], train.datasets[ref_index[k]][ref_sample[k]])
    assert [d.name for d in valid.datasets] == ["valid", "valid"]
    with pytest.raises(IndexError):
        train[len(train)]
    cached = os.listdir(tmp_path / "index-cache")  # components cached beside the data; the blend is not
    assert len(cached) == 4 * 4 and not any(n.endswith("_sample_index.npy") for n in cached)


def test_blend_cache_only_with_data_cache_path(tmp_path, monkeypatch):
    prefixes, opener = _fakes(tmp_path)
    a, b = prefixes
    cache = tmp_path / "cache"
    builds = []  # the blend's index is built (not loaded from the cache) once per description
    monkeypatch.setattr(
        blend, "build_blending_indices", lambda *args: builds.append(args) or build_blending_indices(*args)
    )
    cfg = DataConfig(train_data_path=["1", a, "2", b], data_cache_path=str(cache))
    first = build_gpt_datasets(cfg, 8, 3, (60, 0, 0), open_dataset=opener)[0]
    assert len(builds) == 1
    again = build_gpt_datasets(cfg, 8, 3, (60, 0, 0), open_dataset=opener)[0]
    assert isinstance(first, BlendableDataset) and len(builds) == 1
    assert len([n for n in os.listdir(cache) if n.endswith("_sample_index.npy")]) == 1
    np.testing.assert_array_equal(first.dataset_sample_index, again.dataset_sample_index)
    # components' caches: data_cache_path given, so built there (the last directory searched)
    assert len([n for n in os.listdir(cache) if n.endswith("_doc_idx.npy")]) == 2
    other = build_gpt_datasets(cfg, 8, 4, (60, 0, 0), open_dataset=opener)[0]
    assert len(builds) == 2 and other.desc != first.desc


@pytest.mark.parametrize("weights", WEIGHTS)
def test_blending_indices_match_megatron_core_helpers(weights):
    """Against Megatron's compiled C++ helper itself (int16 dataset index there), when megatron-core is installed."""
    helpers = pytest.importorskip("megatron.core.datasets.helpers_cpp", reason="megatron-core not installed")
    w = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    size = 50000
    expected_index, expected_sample = np.zeros(size, dtype=np.int16), np.zeros(size, dtype=np.int64)
    helpers.build_blending_indices(expected_index, expected_sample, w, len(w), size, False)
    index, sample = build_blending_indices(w, size)
    np.testing.assert_array_equal(index, expected_index)
    np.testing.assert_array_equal(sample, expected_sample)

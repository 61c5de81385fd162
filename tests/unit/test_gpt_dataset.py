"""GPT dataset: splits, Megatron's sample order against a slow independent reference, epochs, caches, config."""

from __future__ import annotations

import os

import numpy as np
import pytest
from data_helpers import FakeIndexed

from moetron.config import RunConfig
from moetron.data import gpt_dataset
from moetron.data.config import DataConfig
from moetron.data.gpt_dataset import GPTDataset, build_gpt_datasets
from moetron.data.sample_index import (
    IndexPlan,
    build_doc_idx,
    build_index_mappings,
    build_sample_idx,
    get_train_valid_test_split,
    shuffle_dtype,
)
from moetron.errors import UserError
from moetron.train.run import sample_counts


def random_docs(n: int, seed: int, max_len: int = 40, empty_every: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    docs = [list(rng.integers(0, 50000, size=int(rng.integers(1, max_len)))) for _ in range(n)]
    if empty_every:
        for i in range(0, n, empty_every):
            docs[i] = []
    return docs


def reference_samples(docs, documents, num_samples, seq_length, seed):
    """§3.3 written out slowly: shuffled document stream, samples every seq_length tokens, shuffled order."""
    tokens_per_epoch = sum(len(docs[d]) for d in documents)
    epochs = 1
    while (epochs * tokens_per_epoch - 1) // seq_length < num_samples:
        epochs += 1
    separate, before = False, 0
    if epochs > 1:
        before = ((epochs - 1) * tokens_per_epoch - 1) // seq_length
        separate = num_samples - before < int(0.8 * ((tokens_per_epoch - 1) // seq_length))
    rng = np.random.RandomState(seed)

    def shuffled(items):
        items = list(items)
        rng.shuffle(items)  # a Python list: numpy's generic swap loop, the same draws as for an array
        return items

    documents = [int(d) for d in documents]
    if separate:
        order = shuffled(documents * (epochs - 1)) + shuffled(documents)
    else:
        order = shuffled(documents * epochs)
    stream = [tok for d in order for tok in docs[d]]
    total = (epochs * tokens_per_epoch - 1) // seq_length
    perm = shuffled(range(before)) + shuffled(range(before, total)) if separate else shuffled(range(total))
    return [stream[j * seq_length : j * seq_length + seq_length + 1] for j in perm], epochs, separate


def loop_sample_idx(sizes, doc_idx, seq_length, num_samples):
    """Megatron's C++ walk, document by document."""
    rows, d, offset = [(0, 0)], 0, 0
    while len(rows) <= num_samples:
        remaining = seq_length + 1
        while remaining:
            length = int(sizes[doc_idx[d]]) - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                d, offset = d + 1, 0
        rows.append((d, offset))
    return np.array(rows, dtype=np.int64)


@pytest.mark.parametrize(
    "split,size,expected",
    [
        ("98,2,0", 1000, [0, 980, 1000, 1000]),
        ("969, 30, 1", 1000, [0, 969, 999, 1000]),
        ("969, 30, 1", 10, [0, 10, 10, 10]),
        ("98/2/0", 1000, [0, 980, 1000, 1000]),
        ("1,1,1", 10, [0, 4, 7, 10]),  # 3+3+3 = 9: every boundary shifts up by one
        ("1,1", 3, [0, 1, 3, 3]),  # round(1.5) = 2 twice = 4: boundaries shift down by one
        ("1", 7, [0, 7, 7, 7]),
    ],
)
def test_split_boundaries(split, size, expected):
    assert get_train_valid_test_split(split, size) == expected


CONFIGS = [  # (docs seed, n docs, seq_length, num_samples, seed, empty_every)
    (0, 60, 16, 50, 1234, 0),  # one epoch
    (1, 30, 8, 120, 7, 5),  # several epochs, empty documents
    (2, 25, 32, 40, 99, 0),  # documents shorter than a sample
]


@pytest.mark.parametrize("docs_seed,n,seq_length,num_samples,seed,empty_every", CONFIGS)
def test_samples_match_reference(docs_seed, n, seq_length, num_samples, seed, empty_every):
    docs = random_docs(n, docs_seed, empty_every=empty_every)
    indexed = FakeIndexed(docs)
    documents = np.arange(3, n, dtype=np.int32)
    ds = GPTDataset("train", "p", documents, indexed, "1,0,0", num_samples, seq_length, seed, [], True, None)
    expected, _, _ = reference_samples(docs, documents, num_samples, seq_length, seed)
    assert len(ds) == len(expected) >= num_samples
    for i, sample in enumerate(expected):
        got = ds[i]
        assert got.dtype == np.int64 and got.shape == (seq_length + 1,)
        np.testing.assert_array_equal(got, sample)


def _ds_for(docs, num_samples, seq_length, tmp_path, seed=5):
    return GPTDataset("train", "p", np.arange(len(docs), dtype=np.int32), FakeIndexed(docs), "1", num_samples,
                      seq_length, seed, [str(tmp_path)])  # fmt: skip


@pytest.mark.parametrize("num_samples,separate", [(60, True), (105, False)])
def test_epochs_with_and_without_separate_last_epoch(tmp_path, num_samples, separate):
    # 110 tokens per epoch, seq 2: 54 samples per epoch, 109 in two; the second epoch is separate when it
    # supplies fewer than int(0.8 · 54) = 43 samples, i.e. for fewer than 97 samples in all
    docs = [[i * 100 + t for t in range(11)] for i in range(10)]
    seq_length = 2
    ds = _ds_for(docs, num_samples, seq_length, tmp_path)
    expected, epochs, ref_separate = reference_samples(docs, range(10), num_samples, seq_length, 5)
    assert (epochs, ref_separate, ds.plan.num_epochs, ds.plan.separate_last_epoch) == (2, separate, 2, separate)
    for i, sample in enumerate(expected):
        np.testing.assert_array_equal(ds[i], sample)
    if separate:  # the separately shuffled last epoch comes after all samples of the first
        assert {int(x) for x in ds.shuffle_idx[:54]} == set(range(54))


def test_sample_idx_matches_document_walk():
    docs = random_docs(200, 3, max_len=30, empty_every=7)
    sizes = np.array([len(d) for d in docs], dtype=np.int32)
    doc_idx = np.random.RandomState(0).permutation(np.tile(np.arange(200, dtype=np.int32), 3))
    tokens = int(sizes.sum())
    for seq_length in (2, 5, 29, 64):
        got = build_sample_idx(sizes, doc_idx, seq_length, 3, tokens)
        np.testing.assert_array_equal(got, loop_sample_idx(sizes, doc_idx, seq_length, got.shape[0] - 1))


def test_index_dtypes():
    docs = random_docs(20, 4)
    plan = IndexPlan.make(np.arange(20), FakeIndexed(docs).sizes, 30, 8, 1)
    arrays = build_index_mappings(plan, FakeIndexed(docs).sizes)
    assert (arrays["doc"].dtype, arrays["sample"].dtype, arrays["shuffle"].dtype) == (np.int32, np.int64, np.uint32)
    assert shuffle_dtype(2**32 - 3) == np.uint32 and shuffle_dtype(2**32 - 2) == np.int64


def counted_index_builds(monkeypatch) -> list:
    """The index mappings the GPT dataset builds (rather than loads from its cache), one entry per build."""
    builds = []
    monkeypatch.setattr(gpt_dataset, "build_index_mappings", lambda *a: builds.append(a) or build_index_mappings(*a))
    return builds


def test_cache_reused_and_keyed_by_description(tmp_path, monkeypatch):
    docs, builds = random_docs(30, 5), counted_index_builds(monkeypatch)
    first = _ds_for(docs, 40, 8, tmp_path)
    assert len(builds) == 1
    again = _ds_for(docs, 40, 8, tmp_path)
    assert len(builds) == 1
    _ds_for(docs, 40, 8, tmp_path, seed=6)
    assert len(builds) == 2
    assert isinstance(again.shuffle_idx, np.memmap)
    for i in range(len(first)):
        np.testing.assert_array_equal(first[i], again[i])
    names = sorted(os.listdir(tmp_path))
    assert len([n for n in names if n.endswith(".dsc")]) == 2 and not any(n.endswith(".tmp") for n in names)


def test_barrier_lets_other_ranks_load_what_rank0_built(tmp_path, monkeypatch):
    docs, calls, builds = random_docs(30, 6), [], counted_index_builds(monkeypatch)
    args = ("train", "p", np.arange(30, dtype=np.int32), FakeIndexed(docs), "1", 40, 8, 3, [str(tmp_path)])
    with pytest.raises(UserError, match="index cache"):
        GPTDataset(*args, is_builder=False, cache_barrier=lambda: calls.append("wait"))
    built = GPTDataset(*args, is_builder=True, cache_barrier=lambda: calls.append("built"))
    follower = GPTDataset(*args, is_builder=False, cache_barrier=lambda: calls.append("wait"))
    assert calls == ["wait", "built", "wait"] and len(builds) == 1  # the follower loaded the builder's index
    np.testing.assert_array_equal(built.sample_idx, follower.sample_idx)


def _write_prefix(prefix, docs):
    from moetron.data.indexed import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(prefix), np.uint16)
    for doc in docs:
        builder.add_document(np.asarray(doc, dtype=np.uint16))
    builder.finalize()


def test_build_from_real_files_with_split(tmp_path):
    pytest.importorskip("moetron.data.indexed")
    docs = [[t % 60000 for t in d] for d in random_docs(100, 7)]
    _write_prefix(tmp_path / "corpus_text_document", docs)
    cfg = DataConfig(data_path=[str(tmp_path / "corpus_text_document")], split="90,8,2", mmap_warmup=True)
    train, valid, test = build_gpt_datasets(cfg, seq_length=16, seed=11, num_samples=(70, 10, 3))
    for ds, docs_range, n in [(train, range(0, 90), 70), (valid, range(90, 98), 10), (test, range(98, 100), 3)]:
        expected, _, _ = reference_samples(docs, docs_range, n, 16, 11)
        assert len(ds) == len(expected)
        for i in range(len(expected)):
            np.testing.assert_array_equal(ds[i], expected[i])
    assert len(os.listdir(tmp_path / "index-cache")) == 12  # 3 splits × (dsc + 3 arrays)


def test_separate_split_paths(tmp_path):
    docs = {"a": random_docs(20, 8), "b": random_docs(15, 9)}
    cfg = DataConfig(train_data_path=[str(tmp_path / "a")], test_data_path=[str(tmp_path / "b")])
    train, valid, test = build_gpt_datasets(cfg, 8, 1, (30, 5, 6), open_dataset=lambda p: FakeIndexed(docs[p[-1]]))
    assert valid is None and train.name == "train" and test.name == "test"
    expected, _, _ = reference_samples(docs["b"], range(15), 6, 8, 1)
    np.testing.assert_array_equal(test[0], expected[0])


def test_unwritable_cache_dir_names_the_flag(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(UserError, match="--data-cache-path"):
        _ds_for(random_docs(10, 1), 5, 4, blocker / "sub")


def test_too_few_tokens_is_a_user_error():
    with pytest.raises(UserError, match="holds 1 tokens"):
        GPTDataset("valid", "p", np.arange(1, 2, dtype=np.int32), FakeIndexed([[5, 6], [7]]), "1", 3, 4, 1)


def test_sample_counts_cover_the_run_and_the_fixed_validation_batches():
    """The samples each split indexes: every iteration of the run (its first stopping criterion), and `eval_iters`
    global batches for validation and test (every evaluation reads the same fixed batches)."""
    cfg = RunConfig()
    t = cfg.train
    t.micro_batch_size, t.global_batch_size, t.train_iters, t.eval_iters = 2, 8, 1000, 10
    assert sample_counts(cfg, dp=2) == (8000, 80, 80)
    t.train_iters, t.train_samples = None, 4001  # ceil(4001 / 8) = 501 iterations
    assert sample_counts(cfg, dp=2) == (4008, 80, 80)
    t.global_batch_size = None  # one micro-batch per data-parallel rank: 2 · 4 = 8
    assert sample_counts(cfg, dp=4) == (4008, 80, 80)


def test_data_config_problems(tmp_path):
    assert "--data-path PREFIX" in DataConfig().problems()[0]
    both = DataConfig(data_path=["x"], valid_data_path=["y"]).problems()
    assert any("--data-path and --valid-data-path" in p for p in both)
    assert any("no dataset at prefix 'x'" in p for p in both) and any("--valid-data-path" in p for p in both)
    odd = DataConfig(data_path=["0.3", "a", "0.7"]).problems()
    assert odd == ["--data-path has 3 values; a blend needs weight/prefix pairs 'W1 PREFIX1 W2 PREFIX2 ...'"]
    bad_weight = DataConfig(data_path=["heavy", "a", "0.7", "b"]).problems()
    assert len(bad_weight) == 1 and "weight 'heavy'" in bad_weight[0]
    _write_prefix(tmp_path / "ok", [[1, 2, 3]]) if _has_indexed() else _touch(tmp_path / "ok")
    bad_split = DataConfig(data_path=[str(tmp_path / "ok")], split="90,x").problems()
    assert len(bad_split) == 1 and "--split '90,x' does not parse" in bad_split[0]
    assert DataConfig(data_path=["1", str(tmp_path / "ok"), "2", str(tmp_path / "ok")]).problems() == []


def _has_indexed() -> bool:
    try:
        import moetron.data.indexed  # noqa: F401
    except ImportError:
        return False
    return True


def _touch(prefix) -> None:
    for ext in (".bin", ".idx"):
        open(str(prefix) + ext, "wb").close()


def test_sample_idx_matches_megatron_core_helpers():
    """Against Megatron's compiled C++ helper itself, when megatron-core is installed."""
    helpers = pytest.importorskip("megatron.core.datasets.helpers_cpp", reason="megatron-core not installed")
    rng = np.random.default_rng(0)
    for trial in range(10):
        sizes = rng.integers(trial % 2, 200, size=int(rng.integers(5, 2000))).astype(np.int32)
        sizes[0] = max(int(sizes[0]), 1)
        epochs, seq_length = int(rng.integers(1, 4)), int(rng.integers(2, 300))
        documents = np.arange(len(sizes), dtype=np.int32)
        doc_idx = build_doc_idx(documents, epochs, np.random.RandomState(trial), trial % 3 == 0)
        tokens = int(sizes.sum())
        expected = helpers.build_sample_idx_int64(sizes, doc_idx, seq_length, epochs, tokens, True, 1)
        np.testing.assert_array_equal(build_sample_idx(sizes, doc_idx, seq_length, epochs, tokens), expected)


@pytest.mark.parametrize("num_samples", [40, 130, 170])  # one epoch; two with a separate last; two together
def test_index_matches_megatron_core_functions(num_samples):
    """doc/sample/shuffle arrays against megatron-core's own builders, called in its order, when installed."""
    pytest.importorskip("megatron.core.datasets.helpers_cpp", reason="megatron-core not installed")
    mcore = pytest.importorskip("megatron.core.datasets.gpt_dataset")
    from megatron.core.datasets import helpers

    sizes = FakeIndexed(random_docs(40, 12)).sizes
    plan = IndexPlan.make(np.arange(5, 40), sizes, num_samples, 8, 77)
    rng = np.random.RandomState(77)
    doc_idx = mcore._build_document_index(plan.documents, plan.num_epochs, rng, plan.separate_last_epoch)
    sample_idx = helpers.build_sample_idx(sizes, doc_idx, 8, plan.num_epochs, plan.tokens_per_epoch, True, True)
    total = sample_idx.shape[0] - 1
    together = ((plan.num_epochs - 1) * plan.tokens_per_epoch - 1) // 8 if plan.separate_last_epoch else total
    shuffle_idx = mcore._build_shuffle_index(together, total, rng)
    ours = build_index_mappings(plan, sizes)
    np.testing.assert_array_equal(ours["doc"], doc_idx)
    np.testing.assert_array_equal(ours["sample"], sample_idx)
    np.testing.assert_array_equal(ours["shuffle"], shuffle_idx)
    assert ours["shuffle"].dtype == shuffle_idx.dtype

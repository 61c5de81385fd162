"""GPT dataset indices against megatron-core 0.16.1's GPTDataset, recorded once (runs in CI, without megatron).

`tests/fixtures/megatron_indices.npz` was written by `tests/fixtures/record_megatron_indices.py`: a synthetic
97-document corpus written with megatron-core's own IndexedDatasetBuilder (its SHA-256 recorded) and, for six
(split, seq_length, samples, seed) cases, the document, sample and shuffle indices megatron-core's GPTDataset
builds for each split. Here the corpus is rebuilt with moetron's writer (the bytes must hash the same) and
moetron's `build_gpt_datasets` must produce the same arrays, shuffle dtype included, through the real path
(`--data-path` prefix, `--split`, on-disk index cache); and the blend indices must equal megatron-core's
compiled `build_blending_indices` for the recorded weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import record_megatron_indices as recorder  # the corpus recipe lives with the recording script

from moetron.data.blend import build_blending_indices
from moetron.data.config import DataConfig
from moetron.data.gpt_dataset import build_gpt_datasets
from moetron.data.indexed import IndexedDatasetBuilder
from moetron.data.sample_index import get_train_valid_test_split

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

RECORDED = dict(np.load(FIXTURES / "megatron_indices.npz"))
META = json.loads(str(RECORDED.pop("meta")))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    prefix = str(tmp_path_factory.mktemp("megatron") / "synthetic_text_document")
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        for doc in recorder.synthetic_documents():
            builder.add_document(doc)
        builder.finalize()
    return prefix


def test_fixture_comes_from_megatron_core():
    assert META["megatron_core"] == "0.16.1" and len(META["cases"]) == len(recorder.CASES)
    assert (FIXTURES / "megatron_indices.npz").stat().st_size < 256 * 1024


def test_corpus_bytes_equal_megatron_core_writer(corpus):
    assert recorder.file_hash(corpus) == META["data_sha256"]


@pytest.mark.parametrize("case", range(len(recorder.CASES)), ids=lambda c: "-".join(map(str, recorder.CASES[c][:2])))
def test_indices_equal_megatron_core(corpus, case):
    split, seq_length, samples, seed = META["cases"][case]
    train_valid_test = build_gpt_datasets(DataConfig(data_path=[corpus], split=split), seq_length, seed, samples)
    bounds = get_train_valid_test_split(split, META["num_documents"])
    compared = 0
    for k, (name, ds) in enumerate(zip(("train", "valid", "test"), train_valid_test, strict=True)):
        key = f"{case}.{name}"
        if f"{key}.doc_idx" not in RECORDED:
            assert ds is None or samples[k] == 0, f"{name}: megatron had no documents for this split"
            continue
        assert bounds[k : k + 2] == RECORDED[f"{key}.bounds"].tolist()
        np.testing.assert_array_equal(ds.doc_idx, RECORDED[f"{key}.doc_idx"])
        np.testing.assert_array_equal(ds.sample_idx, RECORDED[f"{key}.sample_idx"])
        np.testing.assert_array_equal(ds.shuffle_idx, RECORDED[f"{key}.shuffle_idx"])
        assert ds.shuffle_idx.dtype == RECORDED[f"{key}.shuffle_idx"].dtype
        compared += 1
    assert compared >= 2


@pytest.mark.parametrize("blend", range(len(recorder.BLENDS)))
def test_blending_indices_equal_megatron_core(blend):
    dataset_index, sample_index = build_blending_indices(META["blends"][blend], META["blend_size"])
    np.testing.assert_array_equal(dataset_index, RECORDED[f"blend{blend}.dataset_index"])
    np.testing.assert_array_equal(sample_index, RECORDED[f"blend{blend}.sample_index"])

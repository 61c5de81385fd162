import pickle
import struct

import numpy as np
import pytest
from data_helpers import megatron_reference

from moetron.data.indexed import IndexedDataset, IndexedDatasetBuilder, best_dtype, dataset_exists
from moetron.errors import UserError

DOCS = [[5, 6, 7], [8], [9, 10, 11, 12], [65000, 1]]


def build(prefix, docs=DOCS, dtype=np.uint16):
    builder = IndexedDatasetBuilder(prefix, dtype)
    for doc in docs:
        builder.add_document(doc)
    builder.finalize()
    return IndexedDataset(prefix)


def test_best_dtype_follows_megatron():
    assert best_dtype(50257) == np.uint16
    assert best_dtype(65499) == np.uint16
    assert best_dtype(65500) == np.int32
    assert best_dtype(128256) == np.int32


@pytest.mark.parametrize("dtype", ["uint16", "int32"])
def test_bytes_equal_an_independent_megatron_writer(tmp_path, dtype):
    build(tmp_path / "ours", dtype=np.dtype(dtype))
    megatron_reference(tmp_path / "ref", DOCS, dtype)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"ref{ext}").read_bytes()


def test_reader_round_trip(tmp_path):
    ds = build(tmp_path / "d")
    assert len(ds) == 4 and ds.num_documents == 4
    assert ds.dtype == np.uint16 and ds.sizes.dtype == np.int32
    assert ds.sizes.tolist() == [3, 1, 4, 2]
    assert ds.pointers.tolist() == [0, 6, 8, 16]
    assert ds.doc_idx.tolist() == [0, 1, 2, 3, 4]
    assert [ds[i].tolist() for i in range(len(ds))] == DOCS
    assert ds[-1].tolist() == [65000, 1]
    assert [a.tolist() for a in ds[1:3]] == DOCS[1:3]
    assert ds.get(2, offset=1, length=2).tolist() == [10, 11]
    assert ds.get(2, offset=3).tolist() == [12]
    assert ds.num_tokens == ds.bin_length_tokens == 10 and ds.sizes_consistent
    with pytest.raises(IndexError):
        ds.get(2, offset=2, length=5)
    with pytest.raises(IndexError):
        ds[4]


def test_builder_writes_under_temporary_names(tmp_path):
    builder = IndexedDatasetBuilder(tmp_path / "d", np.uint16)
    builder.add_documents(np.array([1, 2, 3]), [2, 1])
    assert not dataset_exists(tmp_path / "d")
    builder.finalize()
    assert dataset_exists(tmp_path / "d")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.bin", "d.idx"]


def test_failure_leaves_nothing(tmp_path):
    with pytest.raises(UserError, match="token id 70000 does not fit the uint16"):
        with IndexedDatasetBuilder(tmp_path / "d", np.uint16) as builder:
            builder.add_document([1, 70000])
    assert list(tmp_path.iterdir()) == []


def test_empty_dataset(tmp_path):
    ds = build(tmp_path / "e", docs=[])
    assert len(ds) == 0 and ds.num_tokens == 0 and ds.sizes_consistent


def test_drifted_megatron_file_is_read_as_stored(tmp_path):
    # Megatron-DeepSpeed --append-eod: the EOD (50256) is in the .bin but not in the sizes, pointers follow sizes.
    docs = [[1, 2, 50256], [3, 50256], [4, 5, 6, 50256]]
    megatron_reference(tmp_path / "drift", docs, "uint16", sizes=[2, 1, 3])
    ds = IndexedDataset(tmp_path / "drift")
    assert not ds.sizes_consistent
    assert ds.num_tokens == 6 and ds.bin_length_tokens == 9
    assert ds.pointers.tolist() == [0, 4, 6]
    assert ds[1].tolist() == [50256]  # where the index points, exactly as Megatron reads it
    assert ds[2].tolist() == [3, 50256, 4]


def test_megatron_empty_document_entries_are_readable(tmp_path):
    # Megatron-DeepSpeed's add_doc records an empty document as a repeated doc_idx entry.
    build(tmp_path / "d", docs=[[1, 2], [3]])
    idx = bytearray((tmp_path / "d.idx").read_bytes())
    header, arrays = idx[:34], idx[34:]
    header[26:34] = struct.pack("<Q", 4)
    (tmp_path / "d.idx").write_bytes(bytes(header) + arrays[:-16] + struct.pack("<3q", 1, 1, 2))
    ds = IndexedDataset(tmp_path / "d")
    assert ds.doc_idx.tolist() == [0, 1, 1, 2] and ds.num_documents == 3


def test_missing_files_name_the_file(tmp_path):
    with pytest.raises(UserError, match=r"dataset file '.*nothing.idx' does not exist"):
        IndexedDataset(tmp_path / "nothing")
    build(tmp_path / "d")
    (tmp_path / "d.bin").unlink()
    with pytest.raises(UserError, match=r"'.*d.bin' does not exist"):
        IndexedDataset(tmp_path / "d")


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda b: b[:20], r"d.idx' is truncated: 20 bytes"),
        (lambda b: b[:-8], r"d.idx' is truncated or corrupt: its header announces 4 sequences"),
        (lambda b: b"PK\x03\x04" + b[4:], r"d.idx' is not a Megatron .idx file"),
        (lambda b: b"TNTIDX\x00\x00" + b[8:], r"legacy 'cached' format"),
        (lambda b: b[:9] + struct.pack("<Q", 2) + b[17:], r"index version 2"),
        (lambda b: b[:17] + b"\x09" + b[18:], r"unknown dtype code 9"),
    ],
)
def test_bad_idx_is_a_one_line_error(tmp_path, corrupt, message):
    build(tmp_path / "d")
    (tmp_path / "d.idx").write_bytes(corrupt((tmp_path / "d.idx").read_bytes()))
    with pytest.raises(UserError, match=message):
        IndexedDataset(tmp_path / "d")


def test_mismatched_bin_is_an_error(tmp_path):
    build(tmp_path / "d")
    (tmp_path / "d.bin").write_bytes((tmp_path / "d.bin").read_bytes()[:-4])
    with pytest.raises(UserError, match=r"d.bin' is too short for its index"):
        IndexedDataset(tmp_path / "d")
    (tmp_path / "d.bin").write_bytes(b"\x00" * 21)
    with pytest.raises(UserError, match=r"not a whole number of uint16 tokens"):
        IndexedDataset(tmp_path / "d")


def test_pickles_as_its_prefix(tmp_path):
    ds = build(tmp_path / "d")
    payload = pickle.dumps(ds)
    assert len(payload) < 500  # the token data is not copied into the pickle
    again = pickle.loads(payload)
    assert [again[i].tolist() for i in range(len(again))] == DOCS


def test_megatron_lm_sequence_modes_are_tolerated(tmp_path):
    # Megatron-LM's multimodal writer appends one int8 mode per sequence after doc_idx.
    build(tmp_path / "d")
    (tmp_path / "d.idx").write_bytes((tmp_path / "d.idx").read_bytes() + bytes(len(DOCS)))
    assert [a.tolist() for a in IndexedDataset(tmp_path / "d")[:]] == DOCS

"""Data under faults: impossible .bin/.idx pairs, full disks, unwritable outputs, corrupt caches, empty outputs,
killed preprocess runs, file modes — each a one-line error (or a clean recovery), nothing half-written left."""

from __future__ import annotations

import builtins
import os
from pathlib import Path

import numpy as np
import pytest
from data_helpers import CORPUS, make_tiny_tokenizer, megatron_reference, tiny_tokenizer_flags, write_jsonl
from dead_pid import dead_pid
from fs_faults import FailingFile, enospc, full_disk, read_only_dir, snapshot

import moetron.data.indexed as indexed_module
from moetron.cli import main
from moetron.data.config import DataConfig, parse_blend
from moetron.data.gpt_dataset import build_gpt_datasets
from moetron.data.indexed import IndexedDataset, IndexedDatasetBuilder
from moetron.errors import UserError
from moetron.fileio import current_umask, publish_mode

VOCAB = 96
TINY = (
    f"--num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 8 --vocab-size {VOCAB} "
    "--micro-batch-size 2 --global-batch-size 2 --train-iters 2 --log-interval 1 --eval-iters 1 --eval-interval 1"
).split()


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def write_dataset(prefix, documents: int = 40, length: int = 30, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        for _ in range(documents):
            builder.add_document(rng.integers(0, VOCAB, length))
        builder.finalize()
    return str(prefix)


def mixed_pair(tmp_path) -> str:
    """The .idx of a 10-document corpus beside the .bin of a 40-document one."""
    small = write_dataset(tmp_path / "small_text_document", documents=10)
    large = write_dataset(tmp_path / "large_text_document", documents=40)
    mixed = tmp_path / "mixed_text_document"
    Path(f"{mixed}.idx").write_bytes(Path(f"{small}.idx").read_bytes())
    Path(f"{mixed}.bin").write_bytes(Path(f"{large}.bin").read_bytes())
    return str(mixed)


def one_error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def preprocess_argv(tok_dir, inputs, prefix, *extra) -> list[str]:
    argv = ["preprocess", "--input", *map(str, inputs), "--output-prefix", str(prefix), *tiny_tokenizer_flags(tok_dir)]
    return [*argv, "--log-interval", "0", *extra]


# ---------------------------------------------------------------------------- defect 3: impossible pairs
def test_impossible_pair_is_an_error_not_a_drift_warning(tmp_path, capsys):
    mixed = mixed_pair(tmp_path)
    with pytest.raises(UserError, match="come from different datasets"):
        IndexedDataset(mixed)
    assert main(["inspect", mixed]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"{mixed}.bin' holds 1200 tokens but '{mixed}.idx' indexes 300 in 10 documents" in line
    assert "Megatron-LM" not in line  # not blamed on the EOD bug


def test_the_eod_drift_is_still_accepted_with_its_warning(tmp_path, capsys):
    megatron_reference(tmp_path / "drift", [[1, 2, 0], [3, 0]], "uint16", sizes=[2, 1])
    assert main(["inspect", str(tmp_path / "drift")]) == 0
    assert "Megatron-LM#431" in capsys.readouterr().err


def test_train_rejects_an_impossible_pair(tmp_path, capsys):
    mixed = mixed_pair(tmp_path)
    assert main(["train", *TINY, "--data-path", mixed, "--save", str(tmp_path / "run")]) == 2
    assert "come from different datasets" in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_eval_rejects_an_impossible_pair(tmp_path, capsys):
    good = write_dataset(tmp_path / "corpus_text_document")
    run = tmp_path / "run"
    assert main(["train", *TINY, "--data-path", good, "--save", str(run)]) == 0
    capsys.readouterr()
    assert main(["eval", "--load", str(run), "--data-path", mixed_pair(tmp_path)]) == 2
    assert "come from different datasets" in one_error_line(capsys.readouterr().err)


# ---------------------------------------------------------------------------- defect 4: full disks
def test_preprocess_on_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, tok_dir, capsys, monkeypatch):
    source = write_jsonl(tmp_path / "in.jsonl", CORPUS * 50)
    out = tmp_path / "out"
    out.mkdir()

    def failing_open(path, mode="r", *args, **kwargs):
        handle = builtins.open(path, mode, *args, **kwargs)
        return FailingFile(handle, allowed=100) if "w" in mode and ".bin.tmp-" in str(path) else handle

    monkeypatch.setattr(indexed_module, "open", failing_open, raising=False)
    assert main(preprocess_argv(tok_dir, [source], out / "corpus")) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"cannot write the dataset '{out}/corpus_text_document'" in line
    assert "No space left on device: the disk is full; free some space" in line
    assert list(out.iterdir()) == []


def test_preprocess_on_a_real_full_tmpfs(tmp_path, tok_dir, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", CORPUS * 400)
    with full_disk(tmp_path / "full", "32k") as full:
        assert main(preprocess_argv(tok_dir, [source], full / "corpus")) == 2
        line = one_error_line(capsys.readouterr().err)
        assert "No space left on device" in line and "the disk is full" in line
        assert list(full.iterdir()) == []


def test_index_cache_on_a_full_disk_is_one_line(tmp_path, monkeypatch):
    prefix = write_dataset(tmp_path / "corpus_text_document")
    monkeypatch.setattr(np, "save", enospc)
    cfg = DataConfig(data_path=[prefix], data_cache_path=str(tmp_path / "cache"))
    with pytest.raises(UserError) as err:
        build_gpt_datasets(cfg, 8, 1, (50, 5, 5))
    assert "cannot write the dataset index cache" in str(err.value) and "the disk is full" in str(err.value)
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.endswith(".tmp")]


def test_index_cache_on_a_real_full_tmpfs_names_the_full_disk(tmp_path, capsys):
    prefix = write_dataset(tmp_path / "corpus_text_document", documents=400)
    with full_disk(tmp_path / "full", "16k") as full:
        argv = ["train", *TINY, "--train-iters", "20000", "--data-path", prefix, "--data-cache-path", str(full)]
        assert main(argv) == 2
        line = one_error_line(capsys.readouterr().err)
        assert "cannot write the dataset index cache" in line and "the disk is full" in line
        assert not [p for p in full.iterdir() if p.name.endswith(".tmp")]


# ---------------------------------------------------------------------------- defect 4: unwritable outputs
@pytest.mark.parametrize("blocker", ["file", "read-only"])
def test_preprocess_output_prefix_that_cannot_be_written(tmp_path, tok_dir, capsys, blocker):
    source = write_jsonl(tmp_path / "in.jsonl", CORPUS)
    if blocker == "file":
        (tmp_path / "out_text_document.bin").mkdir()  # a directory where the .bin must go
        assert main(preprocess_argv(tok_dir, [source], tmp_path / "out")) == 2
        assert "out_text_document.bin' is a directory" in one_error_line(capsys.readouterr().err)
        return
    with read_only_dir(tmp_path / "ro") as ro:
        assert main(preprocess_argv(tok_dir, [source], ro / "out")) == 2
        assert f"directory '{ro}' is not writable" in one_error_line(capsys.readouterr().err)


def test_train_tokenizer_output_dir_that_cannot_be_written(tmp_path, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", CORPUS)
    with read_only_dir(tmp_path / "ro") as ro:
        argv = ["train-tokenizer", "--input", str(source), "--vocab-size", "300", "--output-dir", str(ro / "tok")]
        assert main(argv) == 2
        assert f"--output-dir {ro / 'tok'}:" in one_error_line(capsys.readouterr().err)
    (tmp_path / "plain").write_text("x")
    argv = ["train-tokenizer", "--input", str(source), "--vocab-size", "300", "--output-dir", str(tmp_path / "plain")]
    assert main(argv) == 2
    assert "exists and is not a directory" in one_error_line(capsys.readouterr().err)


def test_train_tokenizer_on_a_full_disk_changes_nothing(tmp_path, capsys, monkeypatch):
    source = write_jsonl(tmp_path / "in.jsonl", CORPUS)
    out = tmp_path / "tok"
    out.mkdir()
    (out / "vocab.json").write_text("{}")  # an earlier tokenizer stays as it was
    before = snapshot(out)
    from tokenizers import Tokenizer

    monkeypatch.setattr(Tokenizer, "save", enospc)
    argv = ["train-tokenizer", "--input", str(source), "--vocab-size", "300", "--output-dir", str(out)]
    assert main(argv) == 2
    assert "the disk is full" in one_error_line(capsys.readouterr().err)
    assert snapshot(out) == before


def test_quickstart_output_dir_that_cannot_be_written(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert main(["quickstart", "--output-dir", str(tmp_path / "file" / "run"), "--nproc", "1"]) == 2
    assert "is a file, so the directory" in one_error_line(capsys.readouterr().err)
    with read_only_dir(tmp_path / "ro") as ro:
        assert main(["quickstart", "--output-dir", str(ro / "run"), "--nproc", "1"]) == 2
        assert "is not writable" in one_error_line(capsys.readouterr().err)


# ---------------------------------------------------------------------------- defect 4: weights, caches
@pytest.mark.parametrize("weight", ["nan", "inf", "NaN"])
def test_non_finite_blend_weights_are_config_problems(tmp_path, weight, capsys):
    prefix = write_dataset(tmp_path / "a_text_document")
    with pytest.raises(ValueError, match="is not a finite number"):
        parse_blend([weight, prefix, "1", prefix])
    assert main(["train", *TINY, "--data-path", weight, prefix, "1", prefix, "--print-config"]) == 2
    assert f"--data-path: weight '{weight}'" in one_error_line(capsys.readouterr().err)


def test_truncated_index_cache_file_is_rebuilt_with_a_warning(tmp_path, capsys):
    prefix = write_dataset(tmp_path / "corpus_text_document")
    cfg = DataConfig(data_path=[prefix])
    expected = np.array(build_gpt_datasets(cfg, 8, 1, (50, 5, 5))[0].sample_idx)
    cache = tmp_path / "index-cache"
    victim = next(p for p in cache.iterdir() if p.name.endswith("_sample_idx.npy"))
    head = victim.read_bytes()[:100]
    victim.unlink()  # a new file (the first datasets still map the old one)
    victim.write_bytes(head)  # a copy cut short
    again = build_gpt_datasets(cfg, 8, 1, (50, 5, 5))[0]
    assert "is corrupt or truncated; rebuilding it" in capsys.readouterr().err
    np.testing.assert_array_equal(again.sample_idx, expected)


def test_truncated_index_cache_file_is_one_line_for_a_reader(tmp_path):
    prefix = write_dataset(tmp_path / "corpus_text_document")
    cfg = DataConfig(data_path=[prefix])
    build_gpt_datasets(cfg, 8, 1, (50, 5, 5))
    victim = next(p for p in (tmp_path / "index-cache").iterdir() if p.name.endswith("_doc_idx.npy"))
    victim.unlink()
    victim.write_bytes(b"\x93NUMPY garbage")
    with pytest.raises(UserError, match="is corrupt or truncated .*delete it"):
        build_gpt_datasets(cfg, 8, 1, (50, 5, 5), is_builder=False, cache_barrier=lambda: None)


# ---------------------------------------------------------------------------- defect 5: no documents
@pytest.mark.parametrize("case", ["empty-input", "wrong-json-key"])
def test_preprocess_with_zero_documents_is_an_error_and_writes_nothing(tmp_path, tok_dir, capsys, case):
    source = tmp_path / "in.jsonl"
    if case == "empty-input":
        source.write_text("")
        extra = []
    else:
        write_jsonl(source, CORPUS)
        extra = ["--json-keys", "content"]
    assert main(preprocess_argv(tok_dir, [source], tmp_path / "out", *extra)) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "gave no document for key" in line and "nothing was written" in line
    if case == "wrong-json-key":
        assert "4 bad record(s)" in line and "missing key 'content'" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


# ---------------------------------------------------------------------------- defect 6: killed preprocess
def test_stale_temporaries_of_a_dead_writer_are_removed(tmp_path, tok_dir, capsys):
    pid = dead_pid()
    stale = [tmp_path / f".out_text_document.bin.tmp-{pid}", tmp_path / f".out_text_document.idx.tmp-{pid}"]
    alive = tmp_path / f".out_text_document.bin.tmp-{os.getppid()}"  # a live process: not ours to delete
    for path in [*stale, alive]:
        path.write_bytes(b"partial")
    source = write_jsonl(tmp_path / "in.jsonl", CORPUS)
    assert main(preprocess_argv(tok_dir, [source], tmp_path / "out")) == 0
    assert "removed 2 temporary file(s) of a killed earlier run" in capsys.readouterr().err
    assert not any(p.exists() for p in stale) and alive.exists()


# ---------------------------------------------------------------------------- defect 9: file modes
def test_index_cache_files_follow_the_umask(tmp_path):
    prefix = write_dataset(tmp_path / "corpus_text_document")
    previous = os.umask(0o002)  # a team's shared-group umask
    try:
        build_gpt_datasets(DataConfig(data_path=[prefix]), 8, 1, (50, 5, 5))
    finally:
        os.umask(previous)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "index-cache").iterdir()}
    assert modes and set(modes.values()) == {0o664}, modes


def test_publish_mode_gives_a_temporary_file_the_umask_mode(tmp_path):
    import tempfile

    fd, name = tempfile.mkstemp(dir=tmp_path)
    os.close(fd)
    assert os.stat(name).st_mode & 0o777 == 0o600
    publish_mode(name)
    assert os.stat(name).st_mode & 0o777 == 0o666 & ~current_umask()
    publish_mode(tmp_path, 0o777)
    assert tmp_path.stat().st_mode & 0o777 == 0o777 & ~current_umask()


# ---------------------------------------------------------------------------- the output prefix's directories
def test_the_output_prefixs_missing_directories_are_made_and_removed_again_on_an_error(tmp_path, tok_dir, capsys):
    """Every README example writes under data/, which a fresh clone lacks: preprocess makes it. A run that fails
    leaves none of the directories it made."""
    source = write_jsonl(tmp_path / "in.jsonl", CORPUS)
    assert main(preprocess_argv(tok_dir, [source], tmp_path / "data" / "sub" / "corpus")) == 0
    assert (tmp_path / "data" / "sub" / "corpus_text_document.bin").is_file()
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    assert main(preprocess_argv(tok_dir, [empty], tmp_path / "new" / "corpus")) == 2
    assert "no document" in one_error_line(capsys.readouterr().err) and not (tmp_path / "new").exists()
    (tmp_path / "file").write_text("not a directory")
    assert main(preprocess_argv(tok_dir, [source], tmp_path / "file" / "x" / "corpus")) == 2
    assert "is a file, not a directory" in one_error_line(capsys.readouterr().err)

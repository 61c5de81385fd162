"""`fileio.write_atomic` / `atomic_writer`: the one way a published file is written (all or nothing)."""

import os

import pytest

from moetron.fileio import atomic_writer, current_umask, write_atomic


def test_write_atomic_publishes_text_and_bytes_with_the_open_mode(tmp_path):
    write_atomic(tmp_path / "a.txt", "héllo\n")
    write_atomic(tmp_path / "b.bin", b"\x00\x01", durable=True)
    assert (tmp_path / "a.txt").read_bytes() == "héllo\n".encode()
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    assert (tmp_path / "a.txt").stat().st_mode & 0o777 == 0o666 & ~current_umask()  # not mkstemp's 0600
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "b.bin"]  # no temporaries left


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("old\n")
    with pytest.raises(OSError, match="simulated"), atomic_writer(path) as f:
        f.write("half of the new")
        raise OSError("disk full (simulated)")
    assert path.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["metrics.jsonl"]


def test_the_old_file_stays_whole_until_the_block_ends(tmp_path):
    path = tmp_path / "latest"
    path.write_text("iter_0000001\n")
    with atomic_writer(path, durable=True) as f:
        f.write("iter_0000002\n")
        f.flush()
        assert path.read_text() == "iter_0000001\n"  # a reader meanwhile sees the old contents
    assert path.read_text() == "iter_0000002\n"

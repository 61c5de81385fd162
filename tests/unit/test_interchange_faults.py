"""`moetron export` / `moetron import` on damaged inputs and failing disks: one `error:` line, no traceback, and
nothing half-written left behind (export writes into a hidden sibling directory renamed into place at the end)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from fs_faults import full_disk, read_only_dir, snapshot
from interchange_support import tiny_checkpoint

from moetron.cli import main

MDS = Path(__file__).resolve().parents[1] / "fixtures" / "megatron_deepspeed" / "moe_top1_ep2" / "checkpoint"


def one_error_line(argv: list[str], capsys) -> str:
    """Run the CLI; it must fail with exactly one `error:` line on stderr and no traceback. Returns that line."""
    code = main(argv)
    out, err = capsys.readouterr()
    assert code not in (0, None), out + err
    assert "Traceback" not in err + out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny GPT-2 run directory (its tokenizer beside it); tests copy it before damaging it."""
    run, _, _ = tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "gpt2")
    return run


def export_argv(run: Path, output: Path, *extra: str) -> list[str]:
    return ["export", "--load", str(run), "--output", str(output), *extra]


def test_export_of_a_truncated_shard_leaves_no_directory(checkpoint, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(checkpoint, run)
    shard = next(run.glob("iter_*/*.distcp"))
    truncate(shard)
    before = snapshot(tmp_path)
    line = one_error_line(export_argv(run, tmp_path / "hf"), capsys)
    assert f"is corrupt or truncated ({shard.name}: its sha256 differs" in line and str(run) in line
    assert snapshot(tmp_path) == before  # neither `hf` nor its staging directory
    # a checkpoint saved without checksums: DCP's read of the shard fails, in one line too
    shutil.rmtree(shard.parent / "checksums")
    before = snapshot(tmp_path)
    line = one_error_line(export_argv(run, tmp_path / "hf"), capsys)
    assert "is corrupt or truncated (reading model." in line and str(run) in line
    assert snapshot(tmp_path) == before


def test_export_of_a_truncated_metadata_file_is_one_line(checkpoint, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(checkpoint, run)
    truncate(next(run.glob("iter_*/.metadata")))
    before = snapshot(tmp_path)
    assert "is corrupt or truncated (.metadata:" in one_error_line(export_argv(run, tmp_path / "hf"), capsys)
    assert snapshot(tmp_path) == before


def test_export_to_a_full_disk_leaves_nothing(checkpoint, tmp_path, capsys):
    with full_disk(tmp_path / "disk", size="64k") as disk:  # the model's weights alone are larger
        line = one_error_line(export_argv(checkpoint, disk / "hf"), capsys)
        assert line.startswith(f"error: cannot write --output {disk / 'hf'}: ") and "the disk is full" in line
        assert list(disk.iterdir()) == []


def test_export_to_a_read_only_directory_is_refused_before_work(checkpoint, tmp_path, capsys):
    with read_only_dir(tmp_path / "ro") as ro:
        line = one_error_line(export_argv(checkpoint, ro / "hf"), capsys)
        assert f"--output {ro / 'hf'}: " in line and "not writable" in line


def test_export_output_under_a_file_names_the_file(checkpoint, tmp_path, capsys):
    (tmp_path / "afile").write_text("in the way")
    line = one_error_line(export_argv(checkpoint, tmp_path / "afile" / "sub"), capsys)
    assert f"--output {tmp_path / 'afile' / 'sub'}: '{tmp_path / 'afile'}' exists and is not a directory" in line


@pytest.mark.parametrize("size", ["0", "0KB", "0.1"])
def test_a_max_shard_size_below_one_byte_is_refused(checkpoint, tmp_path, capsys, size):
    line = one_error_line(export_argv(checkpoint, tmp_path / "hf", "--max-shard-size", size), capsys)
    assert f"--max-shard-size '{size}' is less than one byte" in line
    assert not (tmp_path / "hf").exists()


def test_export_into_an_existing_empty_directory_publishes_there(checkpoint, tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    assert main(export_argv(checkpoint, tmp_path / "hf", "--max-shard-size", "20KB")) == 0
    assert "in 5 shard(s)" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no staging directory left
    assert (tmp_path / "hf" / "model-00005-of-00005.safetensors").is_file()
    assert (tmp_path / "hf").stat().st_mode & 0o777 == 0o777 & ~_umask()


def _umask() -> int:
    from moetron.fileio import current_umask

    return current_umask()


@pytest.fixture(scope="module")
def hf_dir(checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "hf"
    assert main(export_argv(checkpoint, out)) == 0
    return out


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_import_of_damaged_safetensors_is_one_line(hf_dir, tmp_path, capsys, damage):
    source = tmp_path / "hf"
    shutil.copytree(hf_dir, source)
    weights = next(source.glob("*.safetensors"))
    if damage == "truncated":
        truncate(weights)
    else:
        weights.write_bytes(b"\xff" * 8 + b"not a safetensors header" * 4)
    line = one_error_line(["import", "--hf", str(source), "--save", str(tmp_path / "run")], capsys)
    assert f"--hf {source}: {weights.name} is not a readable safetensors file" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "name",
    [
        "mp_rank_00_model_states.pt",
        "layer_0_expert_1_mp_rank_00_model_states.pt",
        "expp_rank_1_mp_rank_00_optim_states.pt",
    ],
)
def test_import_of_a_truncated_megatron_deepspeed_file_is_one_line(tmp_path, capsys, name):
    source = tmp_path / "mds"
    shutil.copytree(MDS, source)
    truncate(source / "global_step3" / name)
    line = one_error_line(["import", "--megatron-deepspeed", str(source), "--save", str(tmp_path / "run")], capsys)
    assert f"{source / 'global_step3' / name}: cannot be read (" in line and "truncated or damaged" in line
    assert not (tmp_path / "run").exists()

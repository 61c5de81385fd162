"""Checkpoint checksums (`checkpoint/integrity.py`): every file a save writes is recorded; a damaged file — random
bytes in the middle of a shard, one flipped byte anywhere — is refused before a load reads it, in one line naming
it; `moetron inspect RUN` reports the checkpoint's integrity."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from trainer_support import build_trainer, tiny_config

from moetron.checkpoint import integrity, open_run, resolve_checkpoint
from moetron.checkpoint.state import load_rng_file, verify_shared
from moetron.cli import main
from moetron.errors import SaidByAnotherRank, UserError
from moetron.parallel.env import DistEnv


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A run directory with one checkpoint (weights, Adam state, RNG, state.json, config.yaml) of a tiny MoE run."""
    run = tmp_path_factory.mktemp("integrity") / "run"
    assert build_trainer(tiny_config(save=str(run), save_interval=2, train_iters=2)).train() == 0
    return run


def damaged_copy(trained: Path, tmp_path: Path) -> tuple[Path, Path]:
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    return run, resolve_checkpoint(str(run))


def scribble(path: Path, offset: int, data: bytes) -> None:
    """Overwrite bytes in place (size and the other bytes unchanged), as a bad disk sector or a stray write would."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_every_file_of_a_save_is_recorded_and_verifies(trained):
    path = resolve_checkpoint(str(trained))
    recorded = integrity.recorded_checksums(path)
    assert sorted(recorded) == integrity.checkpoint_files(path)
    assert {".metadata", "state.json", "config.yaml", "rng/rank_00000.safetensors"} <= set(recorded)
    assert any(name.endswith(".distcp") for name in recorded)
    assert integrity.verify_checkpoint(path) == len(recorded)
    # the shares of a distributed load together hash every file once
    shares = [integrity.verify_checkpoint(path, part=(rank, 3)) for rank in range(3)]
    assert sum(shares) == len(recorded)


def test_random_bytes_in_the_middle_of_a_shard_are_refused_by_every_loader(trained, tmp_path, capsys):
    run, path = damaged_copy(trained, tmp_path)
    shard = max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)
    scribble(shard, shard.stat().st_size // 2 - 2048, os.urandom(4096))
    why = f"is corrupt or truncated ({shard.name}: its sha256 differs from the one recorded when it was saved)"
    with pytest.raises(UserError) as err:
        open_run(str(run))  # export, eval, generate, upcycle, eval-harness open checkpoints this way
    assert f"checkpoint {path} {why}" in str(err.value)
    resumed = build_trainer(tiny_config(train_iters=4))
    with pytest.raises(UserError, match=shard.name):
        resumed.load(path)  # train --load
    assert main(["export", "--load", str(run), "--output", str(tmp_path / "hf")]) == 2
    assert shard.name in capsys.readouterr().err and not (tmp_path / "hf").exists()
    assert main(["inspect", str(run)]) == 1
    out = capsys.readouterr().out
    assert "integrity: FAILED" in out and shard.name in out


@pytest.mark.parametrize("name", [".metadata", "state.json", "config.yaml", "rng/rank_00000.safetensors", "shard"])
def test_one_flipped_byte_in_any_file_is_refused_in_one_line(trained, tmp_path, name):
    run, path = damaged_copy(trained, tmp_path)
    target = next(path.glob("*.distcp")) if name == "shard" else path / name
    data = bytearray(target.read_bytes())
    digit = next(i for i in range(len(data) // 2, len(data)) if chr(data[i]).isdigit() or name != "state.json")
    data[digit] = data[digit] ^ (0x01 if name == "state.json" else 0x40)  # state.json: a digit stays a digit
    target.write_bytes(bytes(data))
    with pytest.raises(UserError) as err:
        open_run(str(run))
    assert target.name in str(err.value) and len(str(err.value).splitlines()) == 1


def test_a_file_missing_or_unrecorded_is_refused(trained, tmp_path):
    run, path = damaged_copy(trained, tmp_path)
    shutil.copy(next(path.glob("*.distcp")), path / "__7_0.distcp")
    with pytest.raises(UserError, match=r"__7_0.distcp: no checksum was recorded for it"):
        integrity.verify_checkpoint(path)
    (path / "__7_0.distcp").unlink()
    (path / "rng" / "rank_00000.safetensors").unlink()
    with pytest.raises(UserError, match=r"missing rng/rank_00000.safetensors"):
        integrity.verify_checkpoint(path)
    (path / "checksums" / "rank_00000.json").write_text('{"algorithm": "md5", "files": {}}')
    with pytest.raises(UserError, match=r"checksums/rank_00000.json: not a sha256 manifest"):
        integrity.verify_checkpoint(path)


def test_a_checkpoint_saved_without_checksums_loads_and_inspect_says_so(trained, tmp_path, capsys):
    run, path = damaged_copy(trained, tmp_path)
    shutil.rmtree(path / "checksums")
    assert integrity.verify_checkpoint(path) is None
    open_run(str(run))
    build_trainer(tiny_config(train_iters=4)).load(path)  # train --load
    assert main(["inspect", str(run)]) == 0
    assert "integrity: not recorded" in capsys.readouterr().out
    assert main(["inspect", str(trained)]) == 0
    out = capsys.readouterr().out
    recorded = len(
        json.loads((resolve_checkpoint(str(trained)) / "checksums" / "rank_00000.json").read_text())["files"]
    )
    assert f"integrity: ok — {recorded} files match" in out and "iteration: 2" in out


class _TwoRanks(DistEnv):
    """Rank 1 of 2, whose all-reduce (MAX) adds what rank 0 found in its share: `peer_failed` or nothing."""

    peer_failed = False

    def all_reduce_(self, tensor: torch.Tensor, op=None) -> torch.Tensor:
        return tensor.clamp_(min=float(self.peer_failed))


class _PeerFoundADamagedFile(_TwoRanks):
    peer_failed = True


def test_a_distributed_load_stops_every_rank_when_one_finds_a_damaged_file(trained, tmp_path):
    run, path = damaged_copy(trained, tmp_path)
    with pytest.raises(SaidByAnotherRank, match="another rank found a file that does not match its checksum"):
        verify_shared(path, _PeerFoundADamagedFile(rank=1, world_size=2))
    verify_shared(path, _TwoRanks(rank=1, world_size=2))  # no mismatch anywhere: every share passes


def test_a_missing_rng_file_of_a_saving_rank_is_refused_and_a_new_rank_starts_from_the_seed(trained, tmp_path, capsys):
    """Without checksums too: a checkpoint saved by one process has rank 0's RNG file; rank 1 of a larger run has
    none to load (a warning). Saved by two, rank 0's missing is damage, refused in one line; a converter's checkpoint
    (no RNG file at all) starts every rank from the seed."""
    _, path = damaged_copy(trained, tmp_path)
    shutil.rmtree(path / "checksums")
    load_rng_file(path, rank=1)
    assert "the checkpoint was saved by 1 process(es)); rank 1's RNG continues from the seed" in capsys.readouterr().out
    rng = path / "rng"
    shutil.copy(rng / "rank_00000.safetensors", rng / "rank_00001.safetensors")  # as two processes save
    (rng / "rank_00000.safetensors").unlink()
    with pytest.raises(UserError, match=r"missing rng/rank_00000.safetensors, which rank 0 of the 2 processes"):
        load_rng_file(path, rank=0)
    (rng / "rank_00001.safetensors").unlink()  # `import` / `upcycle` write none
    load_rng_file(path, rank=0)
    assert "holds no RNG states (written by a converter)" in capsys.readouterr().out

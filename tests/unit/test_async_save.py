"""`--async-save`: the checkpoints are the synchronous save's files, a resumed run is the uninterrupted one, `latest`
moves only after the background write, one write at a time, and a failed write is the synchronous save's one line.
(kill -9 and SIGTERM during an asynchronous write: tests/integration/test_fault_injection.py.)"""

from __future__ import annotations

import errno
import json
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.checkpoint.staging import StagingOptions
from trainer_support import build_trainer, run_losses, tiny_config

from moetron.checkpoint import files as ckpt
from moetron.checkpoint import load_weights
from moetron.checkpoint.async_save import _GilFreeStager
from moetron.config import RunConfig
from moetron.errors import UserError
from moetron.validate import validate


def checkpoint_contents(path: Path) -> dict[str, object]:
    """Every file's bytes, but two that differ between any two saves, even synchronous ones: DCP's `.metadata`
    (compared without the random `save_id` each save draws) and the RNG files (safetensors writes the metadata
    keys in a random order: compared as their tensors and metadata), and with them their recorded checksums."""
    out: dict[str, object] = {}
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        key = str(file.relative_to(path))
        out[key] = file.read_bytes()
        if file.suffix == ".safetensors":
            tensors, metadata = ckpt.read_tensors(file)
            out[key] = ({name: t.tolist() for name, t in tensors.items()}, metadata)
        if file.parent.name == "checksums":  # the same checksums but of those two files'
            recorded = json.loads(file.read_bytes())["files"]
            out[key] = {name: c for name, c in recorded.items() if name != ".metadata" and not name.startswith("rng/")}
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    out[".metadata"] = (metadata.state_dict_metadata, metadata.planner_data, metadata.storage_data, metadata.version)
    return out


def losses(run: Path) -> dict[int, float]:
    return {r["iteration"]: r["lm_loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def config(run: Path, **train) -> RunConfig:
    return tiny_config(save=str(run), save_interval=2, train_iters=4, **train)


def test_async_checkpoints_are_the_synchronous_ones_and_a_resumed_run_the_uninterrupted_one(tmp_path):
    assert build_trainer(config(tmp_path / "sync")).train() == 0
    assert build_trainer(config(tmp_path / "async", async_save=True)).train() == 0
    for name in ("iter_0000002", "iter_0000004"):
        sync = checkpoint_contents(tmp_path / "sync" / name)
        assert checkpoint_contents(tmp_path / "async" / name) == sync, name
    assert (tmp_path / "async" / "latest").read_text() == "iter_0000004\n"
    # stopped after the asynchronous save of iteration 2 (the run waits for it), then resumed from it
    stopped = tmp_path / "resumed"
    assert build_trainer(config(stopped, async_save=True, exit_interval=2)).train() == 0
    resumed = build_trainer(config(stopped, async_save=True))
    resumed.load(ckpt.resolve_checkpoint(str(stopped)))
    assert resumed.progress.iteration == 2 and resumed.train() == 0
    assert losses(stopped) == losses(tmp_path / "sync")
    assert checkpoint_contents(stopped / "iter_0000004") == checkpoint_contents(tmp_path / "sync" / "iter_0000004")


def test_latest_moves_after_the_background_write_which_holds_the_step_it_copied(tmp_path, monkeypatch):
    """The copy and the write are both held back: training goes on, its optimizer update waiting for the copy."""
    trainer = build_trainer(tiny_config(save=str(tmp_path), async_save=True))
    run_losses(trainer, 2)
    weights_at_2 = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    release, events = threading.Event(), []
    real_write, real_publish, real_staging = dcp.FileSystemWriter.write_data, ckpt.publish, ckpt.prepare_staging

    def held_write(self, plan, planner):
        assert release.wait(60), "the test never released the write"
        return real_write(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", held_write)
    copied, real_stage = threading.Event(), StateDictStager.stage

    def held_copy(self, state_dict, **kwargs):  # the staging copy, in its thread, starts only once `copied` is set
        assert copied.wait(60), "the test never released the copy"
        return real_stage(self, state_dict, **kwargs)

    monkeypatch.setattr(StateDictStager, "stage", held_copy)

    def publish(run, it, keep):
        events.append(f"publish {it}")
        return real_publish(run, it, keep)

    def prepare_staging(run, it):
        events.append(f"stage {it}")
        return real_staging(run, it)

    monkeypatch.setattr(ckpt, "publish", publish)
    monkeypatch.setattr(ckpt, "prepare_staging", prepare_staging)
    trainer.save()  # returns with the copy and the write held in the background (every file is the thread's)
    assert trainer.async_saver.in_flight
    assert not (tmp_path / "latest").exists() and not (tmp_path / "iter_0000002").exists()
    threading.Timer(0.2, copied.set).start()  # the next step's optimizer update waits for the copy
    run_losses(trainer, 1)  # training goes on, changing the weights the write was given a copy of
    threading.Timer(0.2, release.set).start()
    trainer.save()  # waits for the write of iteration 2 before it starts the one of 3
    trainer.async_saver.wait()
    assert events == ["stage 2", "publish 2", "stage 3", "publish 3"]
    assert (tmp_path / "latest").read_text() == "iter_0000003\n" and not list(tmp_path.glob(".tmp_*"))
    saved = build_trainer(tiny_config(save=str(tmp_path))).model
    load_weights(tmp_path / "iter_0000002", saved)
    for name, tensor in saved.state_dict().items():
        assert torch.equal(tensor, weights_at_2[name]), name


def test_a_failed_background_write_is_the_one_line_of_the_next_wait_and_keeps_the_previous_checkpoint(
    tmp_path, monkeypatch
):
    trainer = build_trainer(tiny_config(save=str(tmp_path), async_save=True))
    run_losses(trainer, 2)
    trainer.save()
    trainer.async_saver.wait()
    run_losses(trainer, 1)

    def disk_full(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", disk_full)
    trainer.save()  # the failure happens in the background ...
    with pytest.raises(UserError) as err:  # ... and is said when the run next waits for it
        trainer.async_saver.wait()
    message = str(err.value)
    assert "\n" not in message and "iteration 3" in message and "No space left on device" in message
    assert "the previous checkpoint iter_0000002 is intact" in message
    assert (tmp_path / "latest").read_text() == "iter_0000002\n" and not list(tmp_path.glob(".tmp_*"))
    trainer.async_saver.wait()  # said once: nothing is in flight any more


def test_async_save_needs_save():
    cfg = tiny_config(async_save=True)
    assert any("--async-save is set without --save" in problem for problem in validate(cfg, 1))


def test_the_stagers_later_copies_reuse_its_buffers_and_keep_shared_storages_shared():
    """The GIL-free copy (`Tensor.copy_` into the buffers of the first save) gives what DCP's own copy gives: the
    values at the save, in the same CPU buffers, a view still a view of its base's copy."""
    stager = _GilFreeStager(StagingOptions(False, False, True, False))  # pinned, shared, async, non-blocking
    weight = torch.randn(64)
    state = {"w": weight, "view": weight[8:16], "nested": {"step": torch.tensor(3)}}
    first = stager.stage(state).result()
    weight.add_(1.0)
    state["nested"]["step"].fill_(4)
    second = stager.stage(state).result()
    assert second["w"].untyped_storage().data_ptr() == first["w"].untyped_storage().data_ptr()  # no new buffer
    assert torch.equal(second["w"], weight) and torch.equal(second["view"], weight[8:16])
    assert second["view"].untyped_storage().data_ptr() == second["w"].untyped_storage().data_ptr()
    assert second["nested"]["step"].item() == 4 and second["w"].untyped_storage().data_ptr() != weight.data_ptr()
    stager.close()

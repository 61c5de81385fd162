"""Checkpoints: atomic publish under a crash, corrupt files, keep-last-n, layout-free expert keys, finetune."""

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from trainer_support import build_trainer, run_losses, tiny_config

from moetron.checkpoint import files as ckpt
from moetron.checkpoint import load_weights
from moetron.errors import UserError


def trained(tmp_path, steps=2, **kw):
    trainer = build_trainer(tiny_config(save=str(tmp_path), **kw))
    run_losses(trainer, steps)
    trainer.save()
    return trainer


@pytest.mark.parametrize("crash_in", ["write_json", "write_text_atomic"])
def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch, crash_in):
    trainer = trained(tmp_path)
    run_losses(trainer, 1)

    def boom(*args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(ckpt, crash_in, boom)
    with pytest.raises(UserError, match="iteration 3 .* failed .*simulated.*; the previous checkpoint iter_0000002 is"):
        trainer.save()
    monkeypatch.undo()
    assert (tmp_path / "latest").read_text().strip() == "iter_0000002"
    assert ckpt.resolve_checkpoint(str(tmp_path)) == tmp_path / "iter_0000002"
    fresh = build_trainer(tiny_config(save=str(tmp_path)))
    fresh.load(ckpt.resolve_checkpoint(str(tmp_path)))
    assert fresh.progress.iteration == 2
    trainer.save()  # the next save cleans the crashed save's temporaries and publishes
    assert (tmp_path / "latest").read_text().strip() == "iter_0000003"
    assert not list(tmp_path.glob(".tmp_*"))


def test_corrupt_or_truncated_checkpoint_is_one_line_error(tmp_path):
    trained(tmp_path)
    data_file = next((tmp_path / "iter_0000002").glob("*.distcp"))
    data_file.write_bytes(data_file.read_bytes()[: data_file.stat().st_size // 2])
    fresh = build_trainer(tiny_config())
    with pytest.raises(UserError, match="iter_0000002 is corrupt or truncated") as err:
        fresh.load(tmp_path / "iter_0000002")
    assert "\n" not in str(err.value)
    metadata = tmp_path / "iter_0000002" / ".metadata"
    metadata.write_bytes(b"garbage")
    with pytest.raises(UserError, match="corrupt or truncated .*metadata"):
        fresh.load(tmp_path / "iter_0000002")
    (tmp_path / "iter_0000002" / "state.json").write_text("{not json")
    with pytest.raises(UserError, match="state.json"):
        fresh.load(tmp_path / "iter_0000002")
    (tmp_path / "latest").write_text("iter_0000099\n")
    with pytest.raises(UserError, match="points to iter_0000099"):
        ckpt.resolve_checkpoint(str(tmp_path))


def test_keep_last_n_and_missing_dir(tmp_path):
    trainer = build_trainer(tiny_config(save=str(tmp_path), keep_last_n=2))
    for _ in range(4):
        run_losses(trainer, 1)
        trainer.save()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["iter_0000003", "iter_0000004"]
    assert ckpt.resolve_checkpoint(str(tmp_path / "nothing-here")) is None


def test_tensors_are_stored_layout_free_under_global_names(tmp_path):
    trainer = trained(tmp_path)
    saved = dcp.FileSystemReader(str(tmp_path / "iter_0000002")).read_metadata().state_dict_metadata
    layer = trainer.cfg.model.moe_layer_indices()[0]
    w1 = trainer.model.get_parameter(f"layers.{layer}.mlp.experts.w1_EDF")
    key = f"model.layers.{layer}.mlp.experts.w1_EDF"
    assert tuple(saved[key].size) == tuple(w1.shape)  # every expert, global id = row
    assert tuple(saved[f"optim.layers.{layer}.mlp.experts.w1_EDF.exp_avg"].size) == tuple(w1.shape)
    assert f"model.layers.{layer}.mlp.router.expert_bias" in saved  # buffers travel too
    assert "optim.word_embeddings.weight.exp_avg_sq" in saved and "optim.word_embeddings.weight.step" in saved
    stored = {key: torch.empty_like(w1)}
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(stored, checkpoint_id=str(tmp_path / "iter_0000002"), no_dist=True)
    assert torch.equal(stored[key], w1.detach())


def test_moetron_0_1_checkpoints_get_a_one_line_conversion_hint(tmp_path):
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "v1_checkpoints" / "modern"
    shutil.copytree(fixture, tmp_path / "old")
    fresh = build_trainer(tiny_config())
    with pytest.raises(UserError, match="moetron 0.1 .*moetron convert-checkpoint --load"):
        fresh.load(ckpt.resolve_checkpoint(str(tmp_path / "old")))


def test_finetune_and_no_load_optim(tmp_path):
    source = trained(tmp_path, steps=3)
    ft = build_trainer(tiny_config(load=str(tmp_path), finetune=True))
    ft.load(tmp_path / "iter_0000003")
    assert ft.progress.iteration == 0 and not ft.optimizer.state
    assert all(torch.equal(a, b) for a, b in zip(ft.model.parameters(), source.model.parameters(), strict=True))
    no_optim = build_trainer(tiny_config(load=str(tmp_path), no_load_optim=True))
    no_optim.load(tmp_path / "iter_0000003")
    assert no_optim.progress.iteration == 3 and not no_optim.optimizer.state


def test_loading_into_a_different_model_names_the_mismatch(tmp_path):
    trained(tmp_path)
    other = build_trainer(tiny_config(hidden_size=64))
    with pytest.raises(UserError, match="has shape .* the model expects"):
        load_weights(tmp_path / "iter_0000002", other.model)


def test_crash_between_the_renames_of_a_resave_leaves_a_loadable_checkpoint(tmp_path, monkeypatch):
    trainer = trained(tmp_path)  # iter_0000002 published
    renames, real_rename = [], ckpt.os.rename

    def rename_then_crash(src, dst):
        if Path(dst).parent == tmp_path:  # the run directory's renames (not DCP's own inside the staging dir)
            renames.append((src, dst))
            if len(renames) == 2:  # the final → .tmp_old_ rename happened; the staging → final one never does
                raise OSError("killed mid-swap (simulated)")
        real_rename(src, dst)

    monkeypatch.setattr(ckpt.os, "rename", rename_then_crash)
    with pytest.raises(UserError, match="mid-swap"):
        trainer.save()  # the same iteration again: the swap path
    monkeypatch.undo()
    assert not (tmp_path / "iter_0000002").exists() and (tmp_path / ".tmp_old_iter_0000002").is_dir()
    assert (tmp_path / "latest").read_text().strip() == "iter_0000002"  # dangling

    parked = ckpt.resolve_checkpoint(str(tmp_path))
    assert parked == tmp_path / ".tmp_old_iter_0000002"
    fresh = build_trainer(tiny_config(save=str(tmp_path)))
    fresh.load(parked)
    assert fresh.progress.iteration == 2
    run_losses(fresh, 1)
    fresh.save()  # puts the parked copy back, cleans the temporaries, publishes iteration 3
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["iter_0000002", "iter_0000003"]
    assert not list(tmp_path.glob(".tmp_*"))
    assert ckpt.resolve_checkpoint(str(tmp_path)) == tmp_path / "iter_0000003"


def test_first_save_crashed_before_latest_is_still_found(tmp_path):
    trained(tmp_path)
    (tmp_path / "latest").unlink()  # as if the process died right after renaming staging → iter_0000002
    assert ckpt.resolve_checkpoint(str(tmp_path)) == tmp_path / "iter_0000002"


def test_checkpoint_files_follow_the_umask(tmp_path):
    import os

    old = os.umask(0o022)
    try:
        trained(tmp_path)
    finally:
        os.umask(old)
    paths = [tmp_path / "latest", *(tmp_path / "iter_0000002").rglob("*")]
    assert len(paths) > 5
    for path in paths:
        mode = path.stat().st_mode & 0o777
        assert mode == (0o755 if path.is_dir() else 0o644), (path.name, oct(mode))


def test_exit_interval_saves_and_stops_at_the_first_multiple(tmp_path):
    trainer = build_trainer(tiny_config(train_iters=50, save=str(tmp_path), exit_interval=3))
    assert trainer.train() == 0
    assert trainer.progress.iteration == 3 and (tmp_path / "latest").read_text().strip() == "iter_0000003"


def test_exit_duration_stops_after_the_step_that_crossed_it(tmp_path, monkeypatch):
    from moetron.train import trainer as trainer_module

    clock = iter(range(0, 10_000, 50))  # each reading 50 s later: 1 minute passes every other step
    monkeypatch.setattr(trainer_module.time, "perf_counter", lambda: float(next(clock)))
    trainer = build_trainer(tiny_config(train_iters=50, save=str(tmp_path), exit_duration_in_mins=1.0))
    assert trainer.train() == 0
    assert 1 <= trainer.progress.iteration < 50 and (tmp_path / "latest").is_file()


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import errno

    trainer = trained(tmp_path)
    run_losses(trainer, 1)
    real_write = dcp.FileSystemWriter.write_data

    def disk_full(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", disk_full)
    with pytest.raises(UserError) as err:
        trainer.save()
    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", real_write)
    message = str(err.value)
    assert "\n" not in message and "No space left on device" in message and "iter_0000002 is intact" in message
    assert (tmp_path / "latest").read_text().strip() == "iter_0000002" and not list(tmp_path.glob(".tmp_*"))
    fresh = build_trainer(tiny_config(save=str(tmp_path)))
    fresh.load(ckpt.resolve_checkpoint(str(tmp_path)))
    assert fresh.progress.iteration == 2


def test_a_missing_shard_file_is_one_line(tmp_path):
    trained(tmp_path)
    for shard in (tmp_path / "iter_0000002").glob("*.distcp"):
        shard.unlink()
    with pytest.raises(UserError, match="iter_0000002 is corrupt or truncated") as err:
        build_trainer(tiny_config()).load(tmp_path / "iter_0000002")
    assert "\n" not in str(err.value)

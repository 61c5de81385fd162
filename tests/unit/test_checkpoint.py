"""Checkpoints: atomic publish under a crash, corrupt files, keep-last-n, layout-free expert keys, finetune."""

import pytest
import torch
from safetensors.torch import load_file
from trainer_support import build_trainer, run_losses, tiny_config

from moetron.errors import UserError
from moetron.train import checkpoint as ckpt
from moetron.train import checkpoint_state


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
    with pytest.raises(OSError, match="simulated"):
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
    model_file = tmp_path / "iter_0000002" / "model.safetensors"
    model_file.write_bytes(model_file.read_bytes()[: model_file.stat().st_size // 2])
    fresh = build_trainer(tiny_config())
    with pytest.raises(UserError, match="iter_0000002 is corrupt or truncated") as err:
        fresh.load(tmp_path / "iter_0000002")
    assert "\n" not in str(err.value) and "model.safetensors" in str(err.value)
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


def test_expert_tensors_are_stored_per_global_expert(tmp_path):
    trainer = trained(tmp_path)
    model_keys = load_file(str(tmp_path / "iter_0000002" / "model.safetensors"))
    optim_keys = load_file(str(tmp_path / "iter_0000002" / "optim.safetensors"))
    layer = trainer.cfg.model.moe_layer_indices()[0]
    w1 = trainer.model.layers[layer].mlp.experts.w1_EDF
    for e in range(4):
        stored = model_keys[f"layers.{layer}.mlp.experts.w1_EDF/expert_{e}"]
        assert torch.equal(stored, w1[e].detach())
        assert f"layers.{layer}.mlp.experts.w1_EDF/exp_avg/expert_{e}" in optim_keys
    assert f"layers.{layer}.mlp.experts.w1_EDF" not in model_keys
    assert f"layers.{layer}.mlp.router.expert_bias" in model_keys  # buffers travel too
    assert "word_embeddings.weight/exp_avg_sq" in optim_keys


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
        checkpoint_state.load_checkpoint(tmp_path / "iter_0000002", other.model)


def test_crash_between_the_renames_of_a_resave_leaves_a_loadable_checkpoint(tmp_path, monkeypatch):
    trainer = trained(tmp_path)  # iter_0000002 published
    renames, real_rename = [], ckpt.os.rename

    def rename_then_crash(src, dst):
        renames.append((src, dst))
        if len(renames) == 2:  # the final → .tmp_old_ rename happened; the staging → final one never does
            raise OSError("killed mid-swap (simulated)")
        real_rename(src, dst)

    monkeypatch.setattr(ckpt.os, "rename", rename_then_crash)
    with pytest.raises(OSError, match="mid-swap"):
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

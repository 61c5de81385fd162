"""`moetron convert-checkpoint`: moetron 0.1 run directories (recorded fixtures) load after conversion with the
logits 0.1 computed, continue training from their iteration, and bad input is one line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moetron.checkpoint import load_weights, resolve_checkpoint
from moetron.checkpoint.legacy import convert
from moetron.cli import main
from moetron.config_cli import load_config
from moetron.errors import UserError
from moetron.model.gpt import create_model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "v1_checkpoints"
EXPECTED = load_file(str(FIXTURES / "expected.safetensors"))


@pytest.mark.parametrize("kind", ["modern", "ep2"])  # GQA + SwiGLU + RoPE, one process; GELU MoE saved at EP 2
def test_converted_checkpoint_gives_the_logits_moetron_0_1_gave(tmp_path, kind):
    assert main(["convert-checkpoint", "--load", str(FIXTURES / kind), "--save", str(tmp_path / "new")]) == 0
    path = resolve_checkpoint(str(tmp_path / "new"))
    assert path.name == "iter_0000002"
    cfg, _ = load_config(str(path / "config.yaml"), {})
    model = create_model(cfg.model, "cpu", seed=99).eval()  # other weights until loaded
    state = load_weights(path, model)
    assert state["iteration"] == 2 and state["format_version"] == 2
    with torch.no_grad():
        logits = model(EXPECTED["batch"]).logits
    torch.testing.assert_close(logits, EXPECTED[kind], rtol=1e-5, atol=1e-6)


def test_converted_checkpoint_resumes_with_its_optimizer_and_position(tmp_path):
    from trainer_support import build_trainer, run_losses

    convert(str(FIXTURES / "modern"), str(tmp_path / "new"))
    path = resolve_checkpoint(str(tmp_path / "new"))
    cfg, _ = load_config(str(path / "config.yaml"), {})
    cfg.train.save = str(tmp_path / "new")
    trainer = build_trainer(cfg)
    trainer.load(path)
    assert trainer.progress.iteration == 2 and trainer.train_loader.consumed_samples == 8
    moments = [s["exp_avg"] for s in trainer.optimizer.state.values()]
    assert moments and all(m.abs().sum() > 0 for m in moments)  # AdamW's moments came along, not zeros
    assert all(float(s["step"]) == 2 for s in trainer.optimizer.state.values())
    assert all(torch.isfinite(torch.tensor(run_losses(trainer, 2))))


def test_conversion_refuses_bad_input_in_one_line(tmp_path):
    with pytest.raises(UserError, match="no checkpoint there"):
        convert(str(tmp_path / "missing"), str(tmp_path / "out"))
    shutil.copytree(FIXTURES / "modern", tmp_path / "old")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="exists and is not empty"):
        convert(str(tmp_path / "old"), str(tmp_path / "taken"))
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"
    convert(str(tmp_path / "old"), str(tmp_path / "v2"))
    with pytest.raises(UserError, match="needs no conversion"):
        convert(str(tmp_path / "v2"), str(tmp_path / "v3"))

"""Where a run writes: a recipe's relative `save` / `tensorboard_dir` are from the current directory, said in the
banner as absolute paths, and stored absolute in the saved config.yaml (which then works from any directory)."""

from __future__ import annotations

import yaml

from moetron.config_cli import load_config, to_yaml
from moetron.train.startup import startup_banner


def test_relative_outputs_are_absolute_in_the_saved_config_and_the_banner(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    overrides = {"save": "checkpoints/moe", "tensorboard_dir": "tensorboard/moe", "train_iters": 2, "vocab_size": 64}
    cfg, _ = load_config(None, overrides)
    train = yaml.safe_load(to_yaml(cfg))["train"]
    assert train["save"] == str(tmp_path / "checkpoints/moe")
    assert train["tensorboard_dir"] == str(tmp_path / "tensorboard/moe")
    assert cfg.train.save == "checkpoints/moe"  # the run's own config is left as given
    output = [line for line in startup_banner(cfg, 1).splitlines() if line.startswith("output ")]
    assert output == [
        f"output     run directory {tmp_path / 'checkpoints/moe'}, TensorBoard {tmp_path / 'tensorboard/moe'} "
        f"(relative paths are from {tmp_path})"
    ]

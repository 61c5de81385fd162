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


class Board:
    def __init__(self):
        self.tags: list[str] = []

    def add_scalar(self, tag, value, step):
        self.tags.append(tag)


def test_tensorboard_names_moe_layers_by_their_transformer_layer_index():
    """As the routing report and the alarms: layer 3 of an --expert-interval 2 model is `layer 3`, not `layer 1`."""
    from moetron.train.metrics import write_tensorboard_train

    record = {"iteration": 1, "consumed_tokens": 16, "consumed_samples": 2, "tokens_per_sec": 1.0, "lm_loss": 4.0}
    record |= {"lr": 1e-3, "grad_norm": 1.0, "loss_scale": 1.0, "moe_loss": 0.0, "skipped_steps": 0}
    record |= {"expert_load_max_over_mean": [1.5, 1.2], "dropped_fraction": [0.1, 0.0], "moe_ep_load_routed": None}
    board = Board()
    write_tensorboard_train(board, record, [1, 3])
    moe = sorted(tag for tag in board.tags if tag.startswith("moe/"))
    assert moe == [
        "moe/dropped-fraction layer 1",
        "moe/dropped-fraction layer 3",
        "moe/load-max-over-mean layer 1",
        "moe/load-max-over-mean layer 3",
    ]

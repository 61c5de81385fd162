"""`--load` refuses a checkpoint whose saved model differs from the run's in what the weights compute (every
ModelConfig field classified), allows layout/implementation changes, and allows training knobs with --finetune."""

from __future__ import annotations

import dataclasses

import pytest

from moetron.checkpoint.architecture import (
    EFFECTIVE,
    FREE,
    FUNCTION,
    FUNCTION_RULES,
    KINDS,
    TRAINING,
    checkpoint_model_problems,
    load_problems,
)
from moetron.config import RunConfig
from moetron.config_cli import load_config, to_yaml
from moetron.model.config import ModelConfig

TINY = {"num_layers": 2, "hidden_size": 16, "num_attention_heads": 2, "seq_length": 8, "vocab_size": 300}


def model(**changes) -> ModelConfig:
    return dataclasses.replace(ModelConfig(**TINY), **changes)


def problems(saved: ModelConfig, run: ModelConfig, finetune: bool = False) -> list[str]:
    return load_problems(saved, run, "runs/x", finetune, "runs/x/iter_0000002/config.yaml")


def test_every_model_field_is_classified():
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    assert set(KINDS) == names, f"classify these ModelConfig fields in KINDS: {sorted(names ^ set(KINDS))}"
    assert set(KINDS.values()) == {FUNCTION, TRAINING, FREE}
    assert set(EFFECTIVE) <= names and set(FUNCTION_RULES) <= names


@pytest.mark.parametrize(
    "saved, run, saved_text, run_text",
    [
        # fewer layers: the MoE layer (layer 2 of 2) would be dropped
        (model(num_experts=[2]), model(num_layers=1, num_experts=[2]), "--num-layers 2", "--num-layers 1"),
        (model(), model(position_embedding_type="rope"), "learned_absolute", "--position-embedding-type rope"),
        (model(), model(normalization="rmsnorm"), "--normalization layernorm", "--normalization rmsnorm"),
        # 4 heads of 8 channels vs 8 heads of 4: every tensor has the same shape
        (
            model(hidden_size=32, num_attention_heads=4),
            model(hidden_size=32, num_attention_heads=8),
            "heads 4",
            "heads 8,",
        ),
    ],
    ids=["fewer-layers", "rope-vs-learned", "rmsnorm-vs-layernorm", "8-vs-4-heads"],
)
def test_the_issue_examples_are_refused_with_both_values_and_the_fix(saved, run, saved_text, run_text):
    for finetune in (False, True):
        (line,) = problems(saved, run, finetune)
        trained, this_run = line.split("; this run has ")
        assert trained.startswith("--load runs/x: the checkpoint was trained with ") and trained.endswith(saved_text)
        assert run_text in this_run and "--config runs/x/iter_0000002/config.yaml" in this_run
        assert "\n" not in line


def test_several_differences_are_named_in_one_line():
    (line,) = problems(model(), model(num_layers=1, position_embedding_type="rope"))
    assert "trained with --num-layers 2 --position-embedding-type learned_absolute; this run has --num-layers 1 " \
        "--position-embedding-type rope" in line  # fmt: skip


def test_defaults_compare_as_the_model_uses_them():
    assert problems(model(), model(ffn_hidden_size=64, num_key_value_heads=2, kv_channels=8)) == []
    assert problems(model(num_experts=[2]), model(num_experts=[2])) == []
    assert problems(model(num_layers=4, num_experts=[2]), model(num_layers=4, num_experts=[2, 2])) == []
    assert problems(model(), model(rotary_base=500000.0)) == []  # learned positions: no rotary base
    assert problems(model(make_vocab_size_divisible_by=128), model(make_vocab_size_divisible_by=192)) == []  # both 384
    (line,) = problems(model(), model(swiglu=True))  # the default ffn size follows: only the flag given is named
    assert "trained with --no-swiglu; this run has --swiglu," in line
    (line,) = problems(model(), model(ffn_hidden_size=48))
    assert "trained with --ffn-hidden-size 64; this run has --ffn-hidden-size 48," in line


def test_learned_positions_fix_the_table_size_rope_does_not():
    (function, training) = problems(model(), model(seq_length=16))
    assert "--max-position-embeddings 8 (--seq-length's); this run has --max-position-embeddings 16 (" in function
    assert "--seq-length 8" in training and "--finetune" in training
    assert len(problems(model(), model(seq_length=16), finetune=True)) == 1  # the table still does not fit
    rope = model(position_embedding_type="rope")
    assert problems(rope, dataclasses.replace(rope, seq_length=16), finetune=True) == []


def test_training_knobs_are_refused_on_resume_and_allowed_with_finetune():
    saved, run = model(num_experts=[2]), model(num_experts=[2], hidden_dropout=0.0, moe_train_capacity_factor=2.0)
    (line,) = problems(saved, run)
    assert "a resume continues the checkpoint's training, which used --moe-train-capacity-factor 1.0 " \
        "--hidden-dropout 0.1; this run has --moe-train-capacity-factor 2.0 --hidden-dropout 0.0;" in line  # fmt: skip
    assert "add --finetune" in line
    assert problems(saved, run, finetune=True) == []
    bias = problems(saved, dataclasses.replace(saved, moe_router_bias_update_rate=1e-3), finetune=True)
    assert len(bias) == 1 and "--moe-router-bias-update-rate 0.0" in bias[0]  # the bias would start picking experts


def test_routing_settings_of_a_dense_model_are_not_compared():
    assert problems(model(), model(moe_train_capacity_factor=2.0, moe_loss_coeff=0.0, topk=2)) == []


def test_implementation_and_initialisation_are_free():
    run = model(checkpoint_activations=True, moe_expert_backend="loop", init_method_std=0.006)
    assert problems(model(), dataclasses.replace(run, moe_identical_expert_init=True)) == []


def write_checkpoint(directory, **model_fields) -> None:
    cfg, _ = load_config(None, {**TINY, **model_fields})
    directory.mkdir(parents=True)
    (directory / "state.json").write_text("{}")
    (directory / "config.yaml").write_text(to_yaml(cfg))


def test_the_checkpoint_config_is_read_from_the_load_path(tmp_path):
    write_checkpoint(tmp_path / "run" / "iter_0000002", num_experts=[2])
    (tmp_path / "run" / "latest").write_text("iter_0000002")
    cfg = RunConfig(model=model(num_layers=1))
    cfg.train.load = str(tmp_path / "run")
    (line,) = checkpoint_model_problems(cfg)
    assert "--num-layers 2 --num-experts 2; this run has --num-layers 1 --num-experts 1" in line
    assert str(tmp_path / "run" / "iter_0000002" / "config.yaml") in line
    cfg.model = model(num_experts=[2])
    assert checkpoint_model_problems(cfg) == []
    cfg.train.load = str(tmp_path / "nothing_yet")  # no checkpoint: nothing to compare (a fresh start)
    assert checkpoint_model_problems(cfg) == []

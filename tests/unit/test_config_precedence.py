"""Flags beat the YAML (also across the warmup/decay/run-length spellings), the tokenizer fixes the vocabulary,
startup warnings and banner, the new stop fields, MoE no-ops, output locations and absolute paths in saved
configs — all seen from the command line (`moetron train --print-config`) where they can be."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from data_helpers import make_tiny_tokenizer, tiny_tokenizer_flags
from fs_faults import read_only_dir

from moetron.cli import main
from moetron.config_cli import load_config, to_yaml
from moetron.train.startup import startup_banner, startup_warnings
from moetron.validate import validate

SCALED_DOWN = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
    "--micro-batch-size 2 --global-batch-size 4 --moe-expert-parallel-size 1 --train-iters 50"
).split()


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))  # 300 tokens


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """A working directory with an (empty) dataset: validation only checks that the files exist."""
    monkeypatch.chdir(tmp_path)
    for ext in (".bin", ".idx"):
        (tmp_path / f"corpus{ext}").write_bytes(b"")
    return tmp_path


def print_config(capsys, *argv) -> dict:
    assert main(["train", *argv, "--print-config"]) == 0, capsys.readouterr().err
    return yaml.safe_load(capsys.readouterr().out)


def seed_flags(tok: Path) -> list[str]:
    return [*SCALED_DOWN, "--data-path", "corpus", *tiny_tokenizer_flags(tok), "--vocab-size", "512"]


# ---------------------------------------------------------------------------- defect 1: flags beat the YAML
def test_explicit_warmup_iters_beats_the_recipes_warmup_tokens(workdir, tok, capsys):
    printed = print_config(capsys, "--config", "gpt-125M-moe64", *seed_flags(tok), "--lr-warmup-iters", "1")
    train = printed["train"]
    assert train["lr_warmup_iters"] == 1 and train["lr_warmup_tokens"] is None  # the recipe's 375M is dropped
    assert train["train_iters"] == 50 and train["train_tokens"] is None  # --train-iters replaces the run length
    assert train["lr_decay_tokens"] == 300_000_000_000  # no decay flag given: the recipe's decay stays


def test_explicit_token_options_beat_the_yamls_step_options(workdir, tmp_path, capsys):
    config = tmp_path / "steps.yaml"
    config.write_text("lr_warmup_iters: 100\nlr_decay_iters: 1000\ntrain_iters: 2000\nlr_warmup_fraction: null\n")
    printed = print_config(
        capsys, "--config", str(config), "--data-path", "corpus", "--lr-warmup-tokens", "4096",
        "--lr-decay-tokens", "640000",
    )  # fmt: skip
    train = printed["train"]
    assert train["lr_warmup_tokens"] == 4096 and train["lr_warmup_iters"] == 0
    assert train["lr_decay_tokens"] == 640000 and train["lr_decay_iters"] is None
    assert train["train_iters"] == 2000  # untouched: no run-length flag was given


def test_replaced_yaml_values_are_named_in_the_banner(workdir, tok):
    cfg, explicit = load_config("gpt-125M-moe64", {"lr_warmup_iters": 1, "train_iters": 50, "num_layers": 2})
    assert explicit.replaced == {"lr_warmup_tokens": 375_000_000, "train_tokens": 300_000_000_000}
    assert "lr_warmup_tokens" not in explicit and "lr_warmup_iters" in explicit.cli
    banner = startup_banner(cfg, 8, "cuda", explicit)
    assert "replaced the config file's lr_warmup_tokens: 375000000, train_tokens: 300000000000" in banner


def test_a_saved_configs_unset_fields_are_not_replaced_values(workdir, tok, tmp_path):
    """A run's config.yaml writes `train_samples: null`; a resume with --train-iters replaces nothing there."""
    config = tmp_path / "config.yaml"
    config.write_text("train:\n  train_iters: 10\n  train_samples: null\n  train_tokens: null\n")
    cfg, explicit = load_config(str(config), {"train_iters": 20})
    assert cfg.train.train_iters == 20 and explicit.replaced == {}
    assert "flags      replaced" not in startup_banner(cfg, 1, "cpu", explicit)


def test_output_dir_on_the_command_line_beats_the_recipes_save(workdir, tok):
    """`--save` wins over `--output-dir` when both are set; a recipe's `save` must not silently win over an
    `--output-dir` the user typed: the flag replaces the file's run directory (and the banner says so)."""
    cfg, explicit = load_config("gpt-125M-moe64", {"output_dir": "runs/mine", "train_iters": 50})
    assert cfg.run_dir() == "runs/mine" and cfg.train.save is None
    assert explicit.replaced["save"] == "checkpoints/gpt-125M-moe64"
    assert "save: checkpoints/gpt-125M-moe64 (a flag of the same kind" in startup_banner(cfg, 8, "cuda", explicit)
    cfg, _ = load_config("gpt-125M-moe64", {"save": "runs/saved", "output_dir": "runs/mine"})
    assert cfg.run_dir() == "runs/saved"  # both typed: --save, as documented


# ---------------------------------------------------------------------------- startup warnings and banner
def test_seed_case_warns_about_fp16_on_cpu_and_a_decay_longer_than_the_run(workdir, tok):
    overrides = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, max_position_embeddings=64)
    overrides |= dict(micro_batch_size=2, global_batch_size=4, moe_expert_parallel_size=1, train_iters=50)
    cfg, _ = load_config("gpt-125M-moe64", overrides | {"lr_warmup_iters": 1})
    warnings = startup_warnings(cfg, "cpu")
    assert all(w.startswith("warning: ") and "\n" not in w for w in warnings)
    assert any("--fp16 on a CPU" in w and "--no-fp16" in w for w in warnings)
    decay = [w for w in warnings if "decay horizon" in w]
    assert len(decay) == 1 and "--lr-decay-tokens 300000000000" in decay[0] and "--lr-decay-iters 50" in decay[0]
    assert not any("LR warmup" in w for w in warnings)  # --lr-warmup-iters 1 fits in the run
    assert not any("fp16" in w for w in startup_warnings(cfg, "cuda"))
    # without the flag, the recipe's token warmup is longer than the 50 iterations
    cfg, _ = load_config("gpt-125M-moe64", overrides)
    warmup = [w for w in startup_warnings(cfg, "cpu") if "LR warmup" in w]
    assert len(warmup) == 1 and "--lr-warmup-tokens 375000000 = 1,464,844 iterations" in warmup[0]


def test_shadowed_step_option_and_dense_experts_are_warned(workdir):
    cfg, _ = load_config(None, {"lr_warmup_tokens": 1000, "lr_warmup_iters": 5, "train_iters": 100})
    assert any("--lr-warmup-iters 5 is ignored: --lr-warmup-tokens 1000 takes precedence" in w
               for w in startup_warnings(cfg, "cuda"))  # fmt: skip
    cfg, _ = load_config(None, {"num_layers": 1, "num_experts": [8], "train_iters": 10})
    assert any("--num-experts 8 has no effect" in w for w in startup_warnings(cfg, "cuda"))


def test_a_sane_config_has_no_warnings_and_a_full_banner(workdir):
    cfg, explicit = load_config("quickstart", {"train_iters": 600})
    assert startup_warnings(cfg, "cpu", world_size=2) == []
    banner = startup_banner(cfg, 2, "cpu", explicit).splitlines()
    assert banner[0].startswith("model      ") and "active per token" in banner[0] and "2 MoE layers of 4" in banner[0]
    assert "data parallel 2, tensor parallel 1, pipeline parallel 1, expert parallel 2" in banner[1]
    assert "= 8 samples = 1,024 tokens per step" in banner[2]
    assert banner[3] == "run        600 iterations = 614.40K tokens (stops at --train-iters)"
    assert banner[4].startswith("lr         cosine 0.002 → 0.0002; warmup 20 iterations (--lr-warmup-iters 20)")
    assert banner[5] == "precision  fp32 on cpu"


# ---------------------------------------------------------------------------- defect 2: the vocabulary
def test_yaml_vocab_size_that_differs_from_the_tokenizer_is_an_error(workdir, tok, capsys):
    argv = ["train", "--config", "gpt-125M-moe64", *SCALED_DOWN, "--data-path", "corpus", *tiny_tokenizer_flags(tok)]
    assert main([*argv, "--print-config"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --config gpt-125M-moe64: vocab_size 50257 differs from the tokenizer's 300 tokens")
    assert "pass --vocab-size 300 (a flag wins" in err and "delete vocab_size" in err and len(err.splitlines()) == 1
    assert print_config(capsys, *argv[1:], "--vocab-size", "300")["model"]["vocab_size"] == 300  # the fix it names


def test_explicit_vocab_size_below_the_tokenizers_is_an_error(workdir, tok, capsys):
    argv = ["train", "--data-path", "corpus", "--train-iters", "1", *tiny_tokenizer_flags(tok)]
    assert main([*argv, "--vocab-size", "200", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "--vocab-size 200 is smaller than the tokenizer's 300 tokens" in err and "give >= 300" in err
    assert print_config(capsys, *argv[1:], "--vocab-size", "512")["model"]["vocab_size"] == 512
    assert print_config(capsys, *argv[1:])["model"]["vocab_size"] == 300


def test_yaml_vocab_size_equal_to_the_tokenizers_is_fine(workdir, tok, tmp_path, capsys):
    config = tmp_path / "v.yaml"
    config.write_text("vocab_size: 300\ntrain_iters: 1\n")
    assert print_config(capsys, "--config", str(config), "--data-path", "corpus", *tiny_tokenizer_flags(tok))


# ---------------------------------------------------------------------------- defect 10: fields and no-ops
def test_topk_above_one_on_a_dense_model_is_an_error(workdir, capsys):
    assert main(["train", "--data-path", "corpus", "--train-iters", "1", "--topk", "2", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "--topk 2 has no effect: no layer is MoE (--num-experts 1" in err and "give --num-experts N" in err


def test_exit_interval_and_duration_are_validated_config_fields(workdir, capsys):
    printed = print_config(
        capsys, "--data-path", "corpus", "--train-iters", "9", "--exit-interval", "100",
        "--exit-duration-in-mins", "230",
    )  # fmt: skip
    assert printed["train"]["exit_interval"] == 100 and printed["train"]["exit_duration_in_mins"] == 230.0
    argv = ["train", "--data-path", "corpus", "--train-iters", "9", "--exit-interval", "0", "--exit-duration-in-mins"]
    assert main([*argv, "-5", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "--exit-interval must be > 0, got 0" in err and "--exit-duration-in-mins must be > 0, got -5.0" in err
    help_text = _help_text(capsys)
    assert "--exit-interval" in help_text and "--exit-duration-in-mins" in help_text


def _help_text(capsys) -> str:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    return capsys.readouterr().out


# ---------------------------------------------------------------------------- defect 4: output locations
def test_unwritable_outputs_are_config_problems_reported_together(workdir, tmp_path, capsys):
    (tmp_path / "a_file").write_text("not a directory")
    with read_only_dir(tmp_path / "ro") as ro:
        argv = ["train", "--data-path", "corpus", "--train-iters", "1", "--save", "a_file"]
        argv += ["--tensorboard-dir", str(ro / "tb"), "--data-cache-path", "a_file/cache", "--print-config"]
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: 3 configuration problem(s):")
    assert "--save a_file: 'a_file' exists and is not a directory" in err
    assert f"--tensorboard-dir {ro / 'tb'}: '{ro / 'tb'}' cannot be created: '{ro}' is not writable" in err
    assert "--data-cache-path a_file/cache:" in err and "is a file" in err
    assert not (tmp_path / "ro" / "tb").exists()


def test_validate_checks_outputs_without_creating_them(workdir, tmp_path):
    cfg, _ = load_config(None, {"data_path": ["corpus"], "train_iters": 1, "save": "runs/a/b/c"})
    assert validate(cfg, 1) == [] and not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------- defect 7: absolute paths
def test_saved_config_holds_absolute_paths(workdir, tok, tmp_path, capsys):
    (tmp_path / "v.json").write_bytes((tok / "vocab.json").read_bytes())
    (tmp_path / "m.txt").write_bytes((tok / "merges.txt").read_bytes())
    argv = ["--data-path", "0.5", "corpus", "0.5", "corpus", "--train-iters", "1", "--data-cache-path", "cache"]
    printed = print_config(capsys, *argv, "--vocab-file", "v.json", "--merge-file", "m.txt")
    data = printed["data"]
    assert data["data_path"] == ["0.5", str(tmp_path / "corpus"), "0.5", str(tmp_path / "corpus")]
    assert data["vocab_file"] == str(tmp_path / "v.json") and data["merge_file"] == str(tmp_path / "m.txt")
    assert data["data_cache_path"] == str(tmp_path / "cache")
    cfg, _ = load_config(None, {"train_data_path": ["corpus"], "valid_data_path": ["1", "corpus"]})
    again = yaml.safe_load(to_yaml(cfg))["data"]
    assert again["train_data_path"] == [str(tmp_path / "corpus")] and again["valid_data_path"] == [
        "1",
        str(tmp_path / "corpus"),
    ]

"""Config: YAML + flags generated from the dataclasses, every problem at once, did-you-mean for typos."""

import argparse

import pytest
import yaml

from moetron.config import RunConfig
from moetron.config_cli import add_config_arguments, cli_overrides, field_specs, load_config, to_yaml
from moetron.errors import ConfigError, UserError
from moetron.validate import check, validate


def parse(argv):
    parser = argparse.ArgumentParser(prog="moetron train")
    parser.add_argument("--config")
    add_config_arguments(parser)
    args = parser.parse_args(argv)
    return load_config(args.config, cli_overrides(args))


def write(tmp_path, text):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return str(path)


def test_every_field_is_a_flag_with_megatron_name():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    flags = {s for a in parser._actions for s in a.option_strings}
    for name in field_specs():
        assert "--" + name.replace("_", "-") in flags
    for flag in ("--num-layers", "--lr-warmup-tokens", "--moe-train-capacity-factor", "--data-path", "--fp16"):
        assert flag in flags
    for negative in ("--disable-moe-token-dropping", "--disable-moe-top2-2nd-expert-sampling", "--no-bf16"):
        assert negative in flags


def test_yaml_then_flags_precedence_and_types(tmp_path):
    path = write(
        tmp_path,
        "num-layers: 6\nmodel:\n  hidden_size: 64\n  num_experts: 8\ntrain:\n  lr: 3e-4\n  train_iters: 10\n",
    )
    cfg, explicit = parse(["--config", path, "--num-layers", "4", "--num-experts", "2", "2", "--bf16"])
    assert cfg.model.num_layers == 4  # the flag wins over the YAML
    assert cfg.model.hidden_size == 64 and cfg.model.num_experts == [2, 2]
    assert cfg.train.lr == 3e-4 and cfg.train.bf16 is True
    assert {"num_layers", "hidden_size", "lr", "bf16"} <= explicit and "vocab_size" not in explicit
    cfg2, _ = parse(["--config", path, "--disable-moe-token-dropping", "--untie-embeddings-and-output-weights"])
    assert cfg2.model.num_experts == [8]  # a single YAML value becomes the one-element list
    assert cfg2.model.moe_token_dropping is False and cfg2.model.untie_embeddings_and_output_weights is True


def test_resolved_yaml_roundtrips(tmp_path):
    cfg, _ = parse(["--num-layers", "2", "--train-iters", "7", "--lr-decay-style", "cosine"])
    again, _ = load_config(write(tmp_path, to_yaml(cfg)), {})
    assert again == cfg
    assert set(yaml.safe_load(to_yaml(cfg))) == set(RunConfig.SECTIONS)


def test_unknown_yaml_key_suggests_the_right_one(tmp_path):
    with pytest.raises(ConfigError) as err:
        parse(["--config", write(tmp_path, "num_layer: 4\nhiden_size: 64\nlr: fast\n")])
    text = str(err.value)
    assert "unknown key 'num_layer'; did you mean num_layers?" in text
    assert "did you mean hidden_size?" in text
    assert "lr: 'fast' is not a float" in text
    assert len(err.value.problems) == 3  # all at once


def test_unknown_flag_suggests_the_right_one(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(["--num-layer", "4"])  # no silent prefix match either
    assert exit_info.value.code == 2
    assert "did you mean --num-layers?" in capsys.readouterr().err


def test_missing_or_malformed_config_file(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        parse(["--config", str(tmp_path / "nope.yaml")])
    with pytest.raises(UserError, match="not valid YAML"):
        parse(["--config", write(tmp_path, "a: [1,\n")])


def test_validate_reports_every_problem_at_once():
    cfg, _ = parse(
        [
            "--hidden-size", "30", "--num-attention-heads", "4",  # not divisible
            "--num-layers", "4", "--expert-interval", "2", "--num-experts", "4", "4", "4",  # 3 values, 2 slots
            "--seq-length", "64", "--max-position-embeddings", "32",
            "--micro-batch-size", "3", "--global-batch-size", "8",
            "--fp16", "--bf16",
            "--save-interval", "10",
            "--tensor-model-parallel-size", "2",
        ]
    )  # fmt: skip
    problems = validate(cfg, world_size=1)
    text = "\n".join(problems)
    for fragment in [
        "--hidden-size 30 is not divisible by --num-attention-heads 4",
        "--num-experts has 3 values",
        "--seq-length 64 exceeds --max-position-embeddings 32",
        "--global-batch-size 8 is not divisible by --micro-batch-size 3",
        "--fp16 and --bf16 are both set",
        "no stopping criterion",
        "--save-interval 10 is set without --save",
        "world size 1 is not divisible by --tensor-model-parallel-size 2",
        "--data-path",
    ]:
        assert fragment in text, fragment
    with pytest.raises(ConfigError) as err:
        check(cfg, world_size=1)
    assert len(err.value.problems) == len(problems) >= 9


def test_data_parallel_size_enters_batch_checks():
    cfg, _ = parse(["--micro-batch-size", "2", "--global-batch-size", "6", "--train-iters", "1"])
    batch_problems = [p for p in validate(cfg, world_size=2) if "global-batch-size" in p]
    assert batch_problems and "data-parallel size 2" in batch_problems[0]
    assert RunConfig().num_micro_batches(1) == 1 and cfg.num_micro_batches(1) == 3


def test_print_config_shows_the_resolved_yaml(tmp_path, capsys):
    from moetron.cli import main

    prefix = tmp_path / "corpus"
    for ext in (".bin", ".idx"):
        prefix.with_suffix(ext).write_bytes(b"")  # existence is all validation checks
    argv = ["train", "--print-config", "--num-layers", "2", "--train-iters", "3", "--data-path", str(prefix)]
    assert main(argv) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["num_layers"] == 2 and printed["train"]["train_iters"] == 3
    assert printed["data"]["data_path"] == [str(prefix)]
    assert main(["train", "--fp16", "--bf16", "--data-path", str(prefix), "--train-iters", "1"]) == 2
    assert "--fp16 and --bf16 are both set" in capsys.readouterr().err


@pytest.mark.parametrize(
    "tokenizer_type, checked",
    [
        ("GPT2BPETokenizer", ["--vocab-file", "--merge-file"]),
        ("HFTokenizer", ["--tokenizer-model"]),
        ("SentencePieceTokenizer", ["--vocab-file", "--merge-file", "--tokenizer-model"]),  # unknown: every file
    ],
)
def test_only_the_files_a_tokenizer_type_reads_are_checked(tmp_path, tokenizer_type, checked):
    from moetron.data.config import DataConfig

    missing = {flag: str(tmp_path / flag.strip("-")) for flag in ("--vocab-file", "--merge-file", "--tokenizer-model")}
    d = DataConfig(tokenizer_type=tokenizer_type, vocab_file=missing["--vocab-file"])
    d.merge_file, d.tokenizer_model = missing["--merge-file"], missing["--tokenizer-model"]
    assert d.tokenizer_file_problems() == [
        f"{flag} {missing[flag]}: no such file; give the path of the tokenizer file (see --tokenizer-type)"
        for flag in checked
    ]
    (tmp_path / "vocab-file").touch()  # a file that is there is never a problem
    assert "--vocab-file" not in " ".join(d.tokenizer_file_problems())

"""`moetron plan` refuses what `moetron train` refuses (same problems, same words, all at once), apart from this
machine's files; and every command `plan --search` prints runs exactly the layout of its row."""

from __future__ import annotations

import argparse
import functools
import json
import shlex
from pathlib import Path

import pytest
import yaml
from test_plan_search import TINY_MOE as SEARCH_TINY_MOE

from moetron.cli import main
from moetron.commands import train
from moetron.config_cli import cli_overrides, load_config
from moetron.plan.estimate import make_plan
from moetron.plan.hardware import accelerator
from moetron.plan.measure import random_corpus
from moetron.validate import validate

# the file's layout differs from the defaults: a row at ZeRO 0 must say so
TINY_MOE = {**SEARCH_TINY_MOE, "zero_stage": 1}
DEVICE = ["--gpu-type", "cpu", "--gpu-memory", "4GB"]


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> Path:
    """A tiny MoE on a real (random-token) corpus: `validate` has nothing to say about its files."""
    directory = tmp_path_factory.mktemp("plan-vs-train")
    config = directory / "tiny.yaml"
    config.write_text(yaml.safe_dump({**TINY_MOE, "data_path": [random_corpus(directory, 512, 1 << 14)]}))
    return config


def errors_of(capsys, argv: list[str]) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "layout",
    [
        ["--use-distributed-optimizer", "--zero-stage", "3"],  # two ZeRO stages asked for
        ["--tensor-model-parallel-size", "3", "--zero-stage", "5"],  # two problems
        ["--use-distributed-optimizer", "--zero-stage", "2", "--tensor-model-parallel-size", "2"],
        ["--tensor-model-parallel-size", "3"],  # heads 4 do not divide
    ],
)
def test_plan_refuses_every_layout_train_refuses_with_trains_words(tiny_config, capsys, monkeypatch, layout):
    monkeypatch.setenv("WORLD_SIZE", "4")  # what torchrun --nproc-per-node 4 tells `moetron train`
    train_code, train_err = errors_of(capsys, ["train", "--config", str(tiny_config), *layout])
    plan_code, plan_err = errors_of(capsys, ["plan", "--config", str(tiny_config), "--gpus", "4", *DEVICE, *layout])
    assert train_code == plan_code == 2
    assert plan_err == train_err and plan_err.startswith("error: ")


def test_only_this_machines_files_are_left_to_train(tmp_path, tiny_config, capsys):
    """Missing data, tokenizer files and unwritable outputs: plannable (a plan reads and writes nothing); how the
    data flags are written is the config's business and refused as train refuses it."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    elsewhere = ["--data-path", str(tmp_path / "not_here"), "--vocab-file", str(tmp_path / "vocab.json")]
    elsewhere += ["--save", str(blocker / "run")]
    cfg, _ = load_config(str(tiny_config), overrides(elsewhere))
    assert len(validate(cfg, 2)) >= 3  # train would refuse all three here
    assert main(["plan", "--config", str(tiny_config), "--gpus", "2", *DEVICE, *elsewhere]) == 0
    no_data = tmp_path / "no-data.yaml"
    no_data.write_text(yaml.safe_dump(TINY_MOE))
    assert any(p.startswith("no data given") for p in validate(load_config(str(no_data), {})[0], 2))
    assert main(["plan", "--config", str(no_data), "--gpus", "2", *DEVICE]) == 0
    capsys.readouterr()
    corpus = load_config(str(tiny_config), {})[0].data.data_path[0]  # there
    for written_wrong in (["--split", "most,some"], ["--train-data-path", corpus], ["--data-path", "0.5", corpus, "x"]):
        cfg, _ = load_config(str(tiny_config), overrides(written_wrong))
        (problem,) = validate(cfg, 2)
        code, err = errors_of(capsys, ["plan", "--config", str(tiny_config), "--gpus", "2", *DEVICE, *written_wrong])
        assert code == 2 and err == f"error: {problem}\n"


@functools.cache
def train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    return parser


def overrides(flags: list[str]) -> dict:
    return cli_overrides(train_parser().parse_args(flags))


def command_config(command: str, gpus: int):
    """The config a printed `torchrun ... moetron train ...` line runs: argv parsed as `moetron train` parses it."""
    words = shlex.split(command)
    assert words[words.index("--nproc-per-node") + 1] == str(gpus)  # the world size the row was planned for
    args = train_parser().parse_args(words[words.index("train") + 1 :])
    return load_config(args.config, cli_overrides(args))[0]


FIXED = [  # each kind of layout flag, and flags that are not about the layout (planned with, so run with)
    ["--zero-stage", "2"],
    ["--zero-stage", "0", "--bf16", "--seq-length", "32", "--lr", "0.001"],  # ZeRO 0: the default, not the file's
    ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    ["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"],
    ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
    ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "gpipe"],
    ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1"],
    ["--moe-expert-parallel-size", "2", "--checkpoint-activations"],
    ["--micro-batch-size", "1", "--global-batch-size", "8"],
    ["--use-distributed-optimizer"],
    ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zero-bubble"],
    ["--context-parallel-size", "2", "--cp-comm-type", "a2a"],
]


@pytest.mark.parametrize("fixed", FIXED, ids=lambda flags: " ".join(flags))
def test_every_printed_command_runs_its_rows_layout(tiny_config, capsys, fixed):
    gpus = 4
    code = main(["plan", "--config", str(tiny_config), "--gpus", str(gpus), *DEVICE, "--search", "--json", "--top",
                 "20", *fixed])  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["rows"]
    wanted, _ = load_config(str(tiny_config), overrides(fixed))  # the flags the search was asked to keep
    for row in report["rows"]:
        cfg = command_config(row["command"], gpus)
        assert validate(cfg, gpus) == [], row["command"]
        p, t, layout, dims = cfg.parallel, cfg.train, row["layout"], cfg.dims(gpus)
        ran = {
            "tp": p.tensor_model_parallel_size,
            "sp": p.sequence_parallel,
            "cp": p.context_parallel_size,
            "cp_comm": p.cp_comm_type,
            "pp": p.pipeline_model_parallel_size,
            "virtual_layers": p.num_layers_per_virtual_pipeline_stage,
            "ep": p.moe_expert_parallel_size,
            "etp": p.expert_tensor_parallel_size,
            "zero": p.zero_stage,
            "mbs": t.micro_batch_size,
            "ckpt": cfg.model.checkpoint_activations,
            "schedule": p.pipeline_schedule,
            "first_layers": p.decoder_first_pipeline_num_layers,
            "last_layers": p.decoder_last_pipeline_num_layers,
            "distributed_optimizer": p.use_distributed_optimizer,
            "dp": dims.dp,
            "edp": dims.edp,
        }
        assert ran == layout, row["command"]
        assert cfg.global_batch(dims.dp) == row["global_batch_size"]
        assert make_plan(cfg, gpus, accelerator("cpu", "4GB")).needed_bytes == row["needed_bytes"]  # same config
        for name in overrides(fixed):  # each fixed flag holds in every row
            section = next(s for s in cfg.SECTIONS if hasattr(getattr(cfg, s), name))
            assert getattr(getattr(cfg, section), name) == getattr(getattr(wanted, section), name), name

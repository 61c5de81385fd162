"""`moetron plan` fits a recipe's expert parallelism to the GPUs given, and its exit status says fits / does not fit."""

from __future__ import annotations

import json

import pytest

from moetron.cli import main
from moetron.commands.plan import EXIT_DOES_NOT_FIT, EXIT_FITS
from moetron.config_cli import load_config
from moetron.plan.estimate import adapted_expert_parallel


def test_the_seed_users_case_plans_ep_2_and_exits_non_zero_when_it_does_not_fit(capsys):
    assert main(["plan", "--config", "gpt-1.3B-moe128", "--gpus", "2", "--gpu-memory", "24GB"]) == EXIT_DOES_NOT_FIT
    out, err = capsys.readouterr()
    notes = err.strip().splitlines()
    assert len(notes) == 1 and notes[0].startswith("note: the config's --moe-expert-parallel-size 64 cannot run on 2")
    assert "planning with 2" in notes[0] and "128 experts per MoE layer" in notes[0]
    assert "expert parallel 2 (64 experts per GPU)" in out and "DOES NOT FIT" in out
    assert "error:" not in err


def test_json_is_scriptable_and_fits_exits_zero(capsys):
    assert main(["plan", "--config", "gpt-125M-moe64", "--gpus", "4", "--gpu-type", "A100-80GB", "--json"]) == EXIT_FITS
    out, err = capsys.readouterr()
    plan = json.loads(out)  # the note went to stderr, so stdout is pure JSON
    assert plan["fits"] and plan["parallel"]["ep"] == 4 and "planning with 4" in err


def test_an_explicit_expert_parallel_size_is_planned_as_given(capsys):
    argv = ["plan", "--config", "gpt-1.3B-moe128", "--gpus", "2", "--moe-expert-parallel-size", "64"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: data-parallel size 2 is not divisible by --moe-expert-parallel-size 64")


@pytest.mark.parametrize(
    "recipe, gpus, expected",
    [
        ("gpt-1.3B-moe128", 6, 2),  # gcd(6, 128) = 2
        ("gpt-1.3B-moe128", 64, None),  # the recipe's 64 runs as it is
        ("gpt-350M-pr-moe-32x10-64x2", 8, 8),  # pyramid: 32 and 64 experts, EP 32 → 8
        ("gpt-350M-pr-moe-32x10-64x2", 1, 1),
        ("gpt-1.3B", 3, None),  # dense: EP 1 runs anywhere
    ],
)
def test_adapted_expert_parallel_size(recipe, gpus, expected):
    cfg, _ = load_config(recipe, {})
    assert adapted_expert_parallel(cfg, gpus) == expected


def test_plan_help_documents_the_exit_status(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "exit status" in capsys.readouterr().out.lower()


def test_plan_ignores_output_locations_it_never_writes(tmp_path, monkeypatch, capsys):
    (tmp_path / "checkpoints").write_text("a file where the recipe's save directory would go")
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--config", "gpt-125M-moe64", "--gpus", "8", "--gpu-type", "A100-80GB"]) == EXIT_FITS
    assert "error" not in capsys.readouterr().err

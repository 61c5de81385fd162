"""Every command that uses a checkpoint opens it the one way (`moetron.checkpoint.open_run`): the same one-line
error for the same broken checkpoint, whichever command met it; and training never imports the eval package."""

from __future__ import annotations

import json

import pytest
import torch
from interchange_support import tiny_checkpoint

from moetron.checkpoint import open_run
from moetron.checkpoint.files import resolve_checkpoint
from moetron.errors import UserError


def openers(tmp_path):
    """(command, a function opening `load` the way that command does)."""
    from moetron.eval.evaluate import evaluate_checkpoint
    from moetron.eval.generate import load_model
    from moetron.interchange.hf_export import export_hf
    from moetron.interchange.upcycle import dense_source

    found = [
        ("generate", lambda load: load_model(load, "cpu")),
        ("eval", lambda load: evaluate_checkpoint(load)),
        ("export", lambda load: export_hf(load, str(tmp_path / "hf"))),
        ("upcycle", lambda load: dense_source(load, None)),
    ]
    try:
        from moetron.eval.harness import load_for_evaluation
    except ImportError:  # lm-eval is an extra; the others still agree
        return found
    return [*found, ("eval-harness", lambda load: load_for_evaluation(load, None, torch.device("cpu")))]


def _no_config(iteration):
    (iteration / "config.yaml").unlink()


def _garbage_config(iteration):
    (iteration / "config.yaml").write_text("\x00\x01 not yaml: [")


def _format_1(iteration):
    state = json.loads((iteration / "state.json").read_text())
    (iteration / "state.json").write_text(json.dumps({**state, "format_version": 1}))


def _no_metadata(iteration):
    (iteration / ".metadata").unlink()


BREAKAGES = {
    "nothing there": (None, "no checkpoint there"),
    "no config.yaml": (_no_config, "config.yaml is missing; the checkpoint is incomplete"),
    "garbage config.yaml": (_garbage_config, "config.yaml cannot be used"),
    "moetron 0.1 state.json": (_format_1, "moetron convert-checkpoint"),
    "no .metadata": (_no_metadata, "is corrupt or truncated (missing .metadata"),
}


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_every_command_gives_the_same_line_for_the_same_broken_checkpoint(tmp_path, breakage):
    run, _, _ = tiny_checkpoint(tmp_path, "gpt2")
    break_it, expected = BREAKAGES[breakage]
    if break_it is None:
        load = str(tmp_path / "no_run")
    else:
        load = str(run)
        break_it(resolve_checkpoint(load))
    with pytest.raises(UserError) as reference:
        open_run(load)
    line = str(reference.value)
    assert expected in line and "\n" not in line
    if breakage in ("nothing there", "no config.yaml", "garbage config.yaml"):
        assert line.startswith(f"--load {load}: ")
    for command, opener in openers(tmp_path):
        with pytest.raises(UserError) as err:
            opener(load)
        assert str(err.value) == line, command
    assert not (tmp_path / "hf").exists()  # export wrote nothing


def test_a_model_opened_by_open_run_holds_the_checkpoints_weights(tmp_path):
    run, cfg, saved = tiny_checkpoint(tmp_path, "gpt2")
    opened = open_run(str(run))
    model = opened.model("cpu")
    assert opened.path == resolve_checkpoint(str(run)) and opened.cfg.model == cfg.model
    assert not model.training
    for (name, got), (_, want) in zip(model.state_dict().items(), saved.state_dict().items(), strict=True):
        assert torch.equal(got, want), name

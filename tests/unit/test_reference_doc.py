"""docs/reference.md is generated from the commands' parsers (`python -m moetron.reference`): a command or flag
added, renamed or re-documented without regenerating it fails here."""

from __future__ import annotations

from pathlib import Path

from moetron.cli import COMMANDS
from moetron.reference import render

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference.md"


def test_the_reference_is_what_the_parsers_say():
    written = REFERENCE.read_text()
    assert written == render(), "docs/reference.md is stale: run `python -m moetron.reference > docs/reference.md`"
    assert all(f"## moetron {command}\n" in written for command in COMMANDS)
    assert "--moe-expert-parallel-size" in written and "--gpu-memory SIZE" in written  # train's and plan's flags

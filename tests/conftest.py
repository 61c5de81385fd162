"""Shared fixtures: paths to ../shared data (tests that need it skip when it is absent)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def pytest_configure(config: pytest.Config) -> None:
    """Child processes (torchrun workers that run a test file as their script, CLI children) import test helpers
    too: hand them pytest's `pythonpath` setting (pyproject.toml) through the environment, as pytest hands it to
    this process."""
    paths = [str(path) for path in config.getini("pythonpath")]
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in paths]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + inherited)


def _require(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"needs {path} (the ../shared checkout beside the repository); not present")
    return path


@pytest.fixture
def gpt2_files() -> tuple[Path, Path]:
    """(vocab.json, merges.txt) of GPT-2 from ../shared/data/gpt2."""
    base = SHARED_DATA / "gpt2"
    return _require(base / "gpt2-vocab.json"), _require(base / "gpt2-merges.txt")


@pytest.fixture
def shakespeare() -> Path:
    return _require(SHARED_DATA / "tinyshakespeare" / "input.txt")

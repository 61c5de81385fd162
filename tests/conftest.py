"""Shared fixtures: paths to ../shared data (tests that need it skip when it is absent)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


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

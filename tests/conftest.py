"""Shared fixtures: paths to ../shared data (tests that need it skip when it is absent), one intra-op thread."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from isa_dependent import ISA_DEPENDENT_FILES  # tests/support

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def pytest_configure(config: pytest.Config) -> None:
    """Child processes (torchrun workers that run a test file as their script, CLI children) import test helpers
    too: hand them pytest's `pythonpath` setting (pyproject.toml) through the environment, as pytest hands it to
    this process."""
    paths = [str(path) for path in config.getini("pythonpath")]
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in paths]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + inherited)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build (or load) the CPU expert kernel once, here, before any test runs: otherwise the first test to use it
    would pay the ~30 s build, and every rank of a first distributed group would build its own copy at once. And
    run every test's CPU model through the CPU backends, as `build` does for a training run: a test that builds
    its model directly then computes what a run computes, whichever test ran first."""
    from moetron.cpu import use_cpu_backends
    from moetron.cpu.compiled_kernels import compiled_cpu_kernels

    compiled_cpu_kernels()
    use_cpu_backends()


# `python -m pytest -m quick`: the README's quick subset (README.md, "The quick subset"), a few minutes on 2 cores:
# the config layer, the CLI, the recipes and --scale-down, the README's own commands, and the core model, routing,
# data and planner unit tests. Their slow tests stay out.
QUICK_FILES = {
    "tests/unit/test_config.py",
    "tests/unit/test_config_precedence.py",
    "tests/unit/test_recipes.py",
    "tests/unit/test_cli.py",
    "tests/unit/test_architecture.py",
    "tests/unit/test_parallel_dims.py",
    "tests/unit/test_router.py",
    "tests/unit/test_router_vs_deepspeed_fixture.py",
    "tests/unit/test_moe_layer.py",
    "tests/unit/test_gpt.py",
    "tests/unit/test_tokenizer.py",
    "tests/unit/test_indexed.py",
    "tests/unit/test_schedule.py",
    "tests/unit/test_plan.py",
    "tests/unit/test_dry_run_parts.py",
    "tests/integration/test_dry_run.py",  # the real step on fake GPUs: every layout as one rank of 8 (~1 min)
    "tests/integration/test_scale_down.py",
    "tests/integration/test_readme_commands.py",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(str(item.fspath)).resolve()
        relative = path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else ""
        if relative in QUICK_FILES and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.quick)
        if relative in ISA_DEPENDENT_FILES:
            item.add_marker(pytest.mark.isa_dependent)


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


@pytest.fixture(scope="module")
def one_thread():
    """Tiny shapes in this process: one intra-op thread is fastest and steadiest (a second thread only adds wake-up
    latency, and on a busy 2-core machine OpenMP's spinning threads make small ops ~100x slower). Every unit test
    (tests/unit/conftest.py) and the in-process training of the integration tests use it."""
    import torch  # here, not at the top: collecting the tests that need no torch stays light

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)

"""The CLI's CPU allocator default: transparent huge pages for large CPU tensors (`THP_MEM_ALLOC_ENABLE=1`) when no GPU
is present, never over the user's own setting, and only while torch is not imported yet (it reads it once)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moetron import cli

SRC = str(Path(__file__).resolve().parents[2] / "src")


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(cli, "GPU_DEVICE_NODES", ("/nonexistent/nvidiactl",))


def test_set_on_a_cpu_machine(no_gpu):
    env: dict = {}
    assert cli.cpu_allocator_defaults(env, torch_imported=False)
    assert env == {"THP_MEM_ALLOC_ENABLE": "1"}


def test_the_users_value_wins(no_gpu):
    env = {"THP_MEM_ALLOC_ENABLE": "0"}
    assert not cli.cpu_allocator_defaults(env, torch_imported=False)
    assert env == {"THP_MEM_ALLOC_ENABLE": "0"}


def test_not_once_torch_is_imported(no_gpu):
    env: dict = {}
    assert not cli.cpu_allocator_defaults(env, torch_imported=True)
    assert env == {}


def test_gpu_machines_keep_pytorchs_default_unless_gpus_are_hidden(monkeypatch, tmp_path):
    node = tmp_path / "nvidiactl"
    node.touch()
    monkeypatch.setattr(cli, "GPU_DEVICE_NODES", (str(node),))
    env: dict = {}
    assert not cli.cpu_allocator_defaults(env, torch_imported=False)
    env = {"CUDA_VISIBLE_DEVICES": ""}
    assert cli.cpu_allocator_defaults(env, torch_imported=False)
    assert env["THP_MEM_ALLOC_ENABLE"] == "1"


def test_the_cli_sets_it_before_the_command_imports_torch():
    """A real `moetron` process: main() runs the rule before importing the command (which imports torch)."""
    code = (
        "import os, sys; from moetron import cli; "
        "cli.GPU_DEVICE_NODES = (); "
        "assert 'torch' not in sys.modules; "
        "rc = cli.main(['train', '--print-config', '--num-layers', '2']); "
        "assert 'torch' in sys.modules; "
        "print('THP=' + os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset'), file=sys.stderr)"
    )
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    env["PYTHONPATH"] = SRC
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "THP=1" in out.stderr

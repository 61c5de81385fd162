"""The CLI's CPU thread default: OpenMP threads wait passively (`OMP_WAIT_POLICY=PASSIVE`) when no GPU is present and
the user chose nothing, only while torch is not imported yet; the banner says what the run uses."""

from __future__ import annotations

import pytest

from moetron import cli
from moetron.config_cli import load_config
from moetron.train.startup import startup_banner


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(cli, "GPU_DEVICE_NODES", ("/nonexistent/nvidiactl",))


def test_passive_wait_on_a_cpu_machine(no_gpu):
    env: dict = {}
    assert cli.cpu_thread_defaults(env, torch_imported=False)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}


@pytest.mark.parametrize("users", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_NUM_THREADS": "2"}])
def test_the_users_setting_wins(no_gpu, users):
    env = dict(users)
    assert not cli.cpu_thread_defaults(env, torch_imported=False)
    assert env == users


def test_not_once_torch_is_imported_nor_with_a_gpu(monkeypatch, no_gpu):
    env: dict = {}
    assert not cli.cpu_thread_defaults(env, torch_imported=True) and env == {}
    monkeypatch.setattr(cli, "GPU_DEVICE_NODES", (__file__,))  # a path that exists: a GPU driver is present
    assert not cli.cpu_thread_defaults(env, torch_imported=False) and env == {}


def test_the_banner_says_the_thread_settings(monkeypatch):
    cfg, explicit = load_config("quickstart", {"train_iters": 10})
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = [line for line in startup_banner(cfg, 1, "cpu", explicit).splitlines() if line.startswith("threads")]
    assert len(threads) == 1 and "(torch's default), OMP_WAIT_POLICY=PASSIVE" in threads[0]
    assert not any(line.startswith("threads") for line in startup_banner(cfg, 1, "cuda", explicit).splitlines())

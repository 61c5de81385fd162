"""benchmarks/e2e.py's driver logic: which environment each side starts with, the round order, the rates."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def e2e(monkeypatch):
    monkeypatch.syspath_prepend(REPO / "benchmarks")  # the benchmark under test, not a helper
    import e2e

    return e2e


def test_moetron_and_the_same_environment_peer_start_with_what_the_cli_sets(e2e):
    user = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": ""}  # no GPU visible (on any machine): the CPU defaults apply
    cli = {"THP_MEM_ALLOC_ENABLE": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    # moetron's process gets both variables `moetron train` sets (the old driver gave it huge pages only)
    assert e2e.side_environment("moetron", "shipped", user) == user | cli
    assert e2e.side_environment("nanogpt", "same", user) == user | cli
    assert e2e.side_environment("nanogpt", "shipped", user) == user  # as its users run it: PyTorch's defaults
    # the user's own choice wins on every side, as in the CLI; nothing leaks into the driver's environment
    mine = user | {"THP_MEM_ALLOC_ENABLE": "0", "OMP_NUM_THREADS": "2"}
    assert e2e.side_environment("moetron", "same", mine) == mine
    assert user == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": ""}
    assert set(e2e.CLI_VARIABLES) == set(cli)


def test_each_round_runs_every_side_once_in_alternating_order(e2e):
    names = ["moetron", "shipped", "same"]
    assert e2e.round_order(names, 0) == names and e2e.round_order(names, 1) == names[::-1]
    assert e2e.peer_envs("both") == ["shipped", "same"] and e2e.peer_envs("same") == ["same"]


def test_rates_and_ratio_lines_read_the_summed_iteration_times(e2e):
    times = {"moetron": [1.0, 2.0], "shipped": [3.0, 3.0], "same": [2.0, 2.0]}
    rate = e2e.rates(times, 600)
    assert rate == {"moetron": 400.0, "shipped": 200.0, "same": 300.0}
    line, ratio = e2e.ratio_line("dense", "nanogpt", "same", rate, times)
    assert ratio == pytest.approx(4 / 3)
    assert line == "dense [same environment]: moetron 400 tok/s, nanogpt 300 tok/s, ratio 1.33 (rounds 2.00 1.00)"


def test_floor_lines_put_each_step_against_its_own_and_the_lower_gemm_floor(e2e):
    class FakeWorker:
        def __init__(self, floor: float):
            self.floor = floor

        def ask(self, command: str) -> dict:
            assert command.startswith("floor ")
            return {"floor": self.floor, "flops": 33.3e9, "calls": 57}

    sides = {"moetron": FakeWorker(0.2), "same": FakeWorker(0.25)}
    times = {"moetron": [1.5, 1.5], "same": [3.0, 3.0]}  # 2 rounds × 5 steps: 0.3 and 0.6 s per step
    args = e2e.parse_args(["--rounds", "2", "--steps", "5", "--threads", "1", "--clock", "cpu"])
    floor, multiples = e2e.floor_lines(sides, "nanogpt", "dense", times, args)
    assert "moetron 200 ms (57 GEMMs, 33.3 GFLOP), nanogpt same environment 250 ms" in floor
    assert (
        "moetron 1.50× its own, 1.50× the lower, nanogpt same environment 2.40× its own, 3.00× the lower" in multiples
    )
    assert multiples.endswith("needs moetron at ≤ 2.00× the lower floor (1.50× now)")  # 3.00 / 1.5

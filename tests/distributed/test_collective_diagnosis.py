"""A stalled rank (alive, stuck) under EP = 2 on 2 gloo processes: the other rank's collective times out after
`--distributed-timeout-minutes`, and it prints ONE line naming its rank, its mesh coordinates and the collective
it was in (the all-to-all of a given MoE layer; the checkpoint barrier), then exits non-zero: no hang, no
traceback.

The fault is injected from outside the product, by this file acting as the worker (`python THIS train ...`):
MOETRON_TEST_STALL=<where>:<rank>:<iteration>[:<layer>] makes global rank <rank> sleep STALL_SECONDS
  moe     in iteration <iteration>, just before MoE layer <layer>'s all-to-all dispatch
  save    just before the checkpoint save of iteration <iteration>
The two ranks are started like torchrun starts them (its environment variables), each with its own output.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
STALL_SECONDS = 300  # far beyond the timeout: the test ends the stalled rank itself
TIMEOUT_MINUTES = 0.1  # 6 s


def install(spec: str) -> None:
    where, rank, iteration, *layer = spec.split(":")
    if os.environ.get("RANK") != rank:
        return
    iteration = int(iteration)
    from moetron.parallel import expert_parallel
    from moetron.train import trainer as trainer_module

    current = [0]
    original_step = trainer_module.Trainer.train_step

    def train_step(self):
        current[0] = self.progress.iteration + 1
        return original_step(self)

    trainer_module.Trainer.train_step = train_step
    if where == "moe":
        original_dispatch = expert_parallel.AllToAllDispatcher.dispatch

        label = f"the all-to-all of MoE layer {layer[0]} "

        def dispatch(self, x_TD, routing):
            if current[0] == iteration and self.forward_site.what.startswith(label):
                time.sleep(STALL_SECONDS)
            return original_dispatch(self, x_TD, routing)

        expert_parallel.AllToAllDispatcher.dispatch = dispatch
        return
    original_save = trainer_module.save_checkpoint

    def save_checkpoint(run_dir, it, *args, **kwargs):
        if it == iteration:
            time.sleep(STALL_SECONDS)
        return original_save(run_dir, it, *args, **kwargs)

    trainer_module.save_checkpoint = save_checkpoint


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], stall: str, log_dir: Path) -> tuple[subprocess.CompletedProcess, float]:
    """Start 2 ranks; wait for rank 0 (the survivor); end rank 1 (the stalled one). (rank 0's result, seconds)."""
    port = free_port()
    procs, logs = [], []
    for rank in range(2):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MOETRON_TEST_STALL": stall}
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        out, err = (open(log_dir / f"rank{rank}.{kind}", "w+") for kind in ("out", "err"))  # noqa: SIM115
        logs.append((out, err))
        command = [sys.executable, __file__, "train", *args]
        procs.append(subprocess.Popen(command, env=env, stdout=out, stderr=err, text=True))
    started = time.monotonic()
    try:
        returncode = procs[0].wait(timeout=600)
        elapsed = time.monotonic() - started
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    out, err = logs[0]
    out.seek(0), err.seek(0)
    result = subprocess.CompletedProcess(procs[0].args, returncode, out.read(), err.read())
    for files in logs:
        for f in files:
            f.close()
    return result, elapsed


@pytest.fixture(scope="module")
def data_flags(tmp_path_factory) -> list[str]:
    sys.path.insert(0, str(HERE.parent / "unit"))
    from test_train_guards import TINY, write_dataset

    prefix = write_dataset(tmp_path_factory.mktemp("diag") / "corpus_text_document", documents=60)
    return [*TINY, "--num-layers", "2", "--data-path", prefix, "--global-batch-size", "4", "--eval-iters", "0"]


def assert_one_line(result: subprocess.CompletedProcess, *parts: str) -> str:
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith("error: "), result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    for part in parts:
        assert part in errors[0], errors[0]
    return errors[0]


@pytest.mark.distributed
@pytest.mark.slow
def test_a_stalled_rank_is_named_in_one_line_by_the_rank_waiting_for_it(data_flags, tmp_path, record_property):
    flags = [*data_flags, "--moe-expert-parallel-size", "2", "--train-iters", "4"]
    flags += ["--distributed-timeout-minutes", str(TIMEOUT_MINUTES)]
    result, seconds = launch(flags, "moe:1:2:1", tmp_path)
    line = assert_one_line(
        result,
        "rank 0 (pp 0, dp 0, tp 0, ep 0): ",
        "the all-to-all of MoE layer 1 (forward) timed out after 0.1 min",
        "expert-parallel peers [0, 1]",
    )
    assert " iteration       1/4 |" in result.stdout and " iteration       2/4 |" not in result.stdout
    record_property("seconds_to_exit", round(seconds, 1))
    print(f"\nrank 0 exited {seconds:.1f} s after the start: {line}")

    # the checkpoint barrier: rank 1 stalls before the save of iteration 2
    save = tmp_path / "run"
    flags = [*data_flags, "--train-iters", "4", "--save", str(save), "--save-interval", "2"]
    flags += ["--distributed-timeout-minutes", str(TIMEOUT_MINUTES)]
    result, seconds = launch(flags, "save:1:2", tmp_path)
    line = assert_one_line(
        result, "rank 0 (pp 0, dp 0, tp 0, ep 0): ", "the checkpoint barrier of the save of iteration 2 timed out"
    )
    assert not (save / "latest").exists()
    print(f"rank 0 exited {seconds:.1f} s after the start: {line}")


if __name__ == "__main__":
    if os.environ.get("MOETRON_TEST_STALL"):
        install(os.environ["MOETRON_TEST_STALL"])
    from moetron.cli import main

    sys.exit(main(sys.argv[1:]))

"""A stalled rank (alive, stuck) or a killed one, under 2 gloo processes: the other rank's collective times out after
`--distributed-timeout-minutes` (or fails at once on the dead peer), and it prints ONE line naming its rank, its mesh
coordinates and the collective it was in (the all-to-all of a given MoE layer, the gradient reduction, the
checkpoint barrier), then exits non-zero: no hang, no traceback. The stalled rank, once released, says so too.

The fault is injected from outside the product, by this file acting as the worker (`python THIS train ...`):
MOETRON_TEST_STALL=<where>:<rank>:<iteration>[:<layer>] makes global rank <rank> stop, in iteration <iteration>,
  moe       just before MoE layer <layer>'s all-to-all dispatch (moe-kill: SIGKILL itself there instead)
  backward  just before the backward of the step's (last) micro-batch
  save      just before the checkpoint save of iteration <iteration>
A stopped rank waits until the file MOETRON_TEST_RELEASE exists. The two ranks are started like torchrun starts them
(its environment variables), each with its own output.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
TIMEOUT_MINUTES = 0.1  # 6 s


def stall() -> None:
    release = Path(os.environ["MOETRON_TEST_RELEASE"])
    release.with_name("stalled_at").write_text(repr(time.time()))  # for the reported time to exit
    while not release.exists():
        time.sleep(0.1)


def install(spec: str) -> None:
    where, rank, iteration, *layer = spec.split(":")
    if os.environ.get("RANK") != rank:
        return
    iteration = int(iteration)
    import torch

    from moetron.parallel.ep import all_to_all as expert_parallel
    from moetron.train import trainer as trainer_module

    current = [0]
    original_step = trainer_module.Trainer.train_step

    def train_step(self):
        current[0] = self.progress.iteration + 1
        return original_step(self)

    trainer_module.Trainer.train_step = train_step
    if where in ("moe", "moe-kill"):
        original_dispatch = expert_parallel.AllToAllDispatcher.dispatch
        label = f"the all-to-all of MoE layer {layer[0]} "

        def dispatch(self, x_TD, routing):
            if current[0] == iteration and self.forward_site.what.startswith(label):
                os.kill(os.getpid(), signal.SIGKILL) if where == "moe-kill" else stall()
            return original_dispatch(self, x_TD, routing)

        expert_parallel.AllToAllDispatcher.dispatch = dispatch
    elif where == "backward":
        original_backward = torch.Tensor.backward

        def backward(self, *args, **kwargs):
            if current[0] == iteration:
                stall()
            return original_backward(self, *args, **kwargs)

        torch.Tensor.backward = backward
    else:
        original_save = trainer_module.save_checkpoint

        def save_checkpoint(run_dir, it, *args, **kwargs):
            if it == iteration:
                stall()
            return original_save(run_dir, it, *args, **kwargs)

        trainer_module.save_checkpoint = save_checkpoint


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], stall: str, log_dir: Path) -> tuple[list[subprocess.CompletedProcess], float | None]:
    """Start 2 ranks; wait for rank 0 (the survivor), then release rank 1 and wait for it too.
    (each rank's result, seconds from the stall's start to rank 0's exit: None without a stall)."""
    port, release = free_port(), log_dir / "release"
    procs, logs = [], []
    for rank in range(2):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MOETRON_TEST_STALL": stall}
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), MOETRON_TEST_RELEASE=str(release))
        out, err = (open(log_dir / f"rank{rank}.{kind}", "w+") for kind in ("out", "err"))  # noqa: SIM115
        logs.append((out, err))
        command = [sys.executable, __file__, "train", *args]
        procs.append(subprocess.Popen(command, env=env, stdout=out, stderr=err, text=True))
    try:
        procs[0].wait(timeout=600)
        exited = time.time()
        release.touch()
        procs[1].wait(timeout=600)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = []
    for proc, (out, err) in zip(procs, logs, strict=True):
        out.seek(0), err.seek(0)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read()))
        out.close(), err.close()
    release.unlink()
    stalled_at = log_dir / "stalled_at"
    elapsed = exited - float(stalled_at.read_text()) if stalled_at.exists() else None
    stalled_at.unlink(missing_ok=True)
    return results, elapsed


@pytest.fixture(scope="module")
def data_flags(tmp_path_factory) -> list[str]:
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


RANK0, RANK1 = "rank 0 (pp 0, dp 0, tp 0, ep 0): ", "rank 1 (pp 0, dp 1, tp 0, ep 1): "
TIMED_OUT = f"timed out after {TIMEOUT_MINUTES:g} min waiting for its"


def group_timeouts(rank: int, world_size: int) -> dict[str, float]:
    """Seconds each mesh group waits, in a world joined with init_distributed(timeout_minutes=2) (`launch.py`)."""
    import torch

    from moetron.parallel.dims import DENSE_DIMS, EXPERT_DIMS, ParallelDims
    from moetron.parallel.env import DistEnv
    from moetron.parallel.mesh import ParallelMesh

    env = DistEnv(rank=rank, world_size=world_size, device=torch.device("cpu"))
    mesh = ParallelMesh.build(ParallelDims(world_size=world_size, dp=world_size, ep=world_size), env)
    backend = {name: mesh.group(name)._get_backend(torch.device("cpu")) for name in DENSE_DIMS + EXPERT_DIMS}
    return {name: b.options._timeout.total_seconds() for name, b in backend.items()}


@pytest.mark.distributed
def test_every_mesh_group_waits_as_long_as_the_flag_says():
    """DeviceMesh gives the groups it creates torch's default (30 min on gloo), not the world's timeout; the size-1
    groups here (pp, tp, edp, etp) are such groups, as every group smaller than the world is."""
    from launch import run_distributed

    for timeouts in run_distributed(group_timeouts, world_size=2):
        assert timeouts == dict.fromkeys(timeouts, 120.0), timeouts


@pytest.mark.distributed
@pytest.mark.slow
def test_a_stalled_or_dead_rank_is_named_in_one_line_by_every_rank_waiting_for_it(data_flags, tmp_path):
    timeout = ["--distributed-timeout-minutes", str(TIMEOUT_MINUTES)]
    ep2 = [*data_flags, "--moe-expert-parallel-size", "2", "--train-iters", "4", *timeout]
    (survivor, stalled), seconds = launch(ep2, "moe:1:2:1", tmp_path)
    line = assert_one_line(
        survivor, RANK0, f"the all-to-all of MoE layer 1 (forward) {TIMED_OUT} expert-parallel peers [0, 1]"
    )
    assert " iteration       1/4 |" in survivor.stdout and " iteration       2/4 |" not in survivor.stdout
    print(f"\nmoe stall: rank 0 exited {seconds:.1f} s after rank 1 stalled: {line}")
    line = assert_one_line(stalled, RANK1, "the all-to-all of MoE layer 1 (forward) lost its expert-parallel peers")
    print(f"moe stall, the stalled rank once released: {line}")

    (survivor, killed), _ = launch(ep2, "moe-kill:1:2:0", tmp_path)
    line = assert_one_line(survivor, RANK0, "the all-to-all of MoE layer 0 (forward) lost its expert-parallel peers")
    assert killed.returncode == -signal.SIGKILL
    print(f"moe kill: {line}")

    ddp = [*data_flags, "--train-iters", "4", *timeout]  # experts replicated: DDP + the expert reducer
    (survivor, _), seconds = launch(ddp, "backward:1:2", tmp_path)
    line = assert_one_line(survivor, "rank 0 (pp 0, dp 0, tp 0, ep 0): the gradient reduction", TIMED_OUT)
    print(f"backward stall: rank 0 exited {seconds:.1f} s after rank 1 stalled: {line}")

    save = tmp_path / "run"
    (survivor, _), seconds = launch([*ddp, "--save", str(save), "--save-interval", "2"], "save:1:2", tmp_path)
    line = assert_one_line(survivor, RANK0, f"the checkpoint barrier of the save of iteration 2 {TIMED_OUT} peers")
    assert not (save / "latest").exists()
    print(f"save stall: rank 0 exited {seconds:.1f} s after rank 1 stalled: {line}")


if __name__ == "__main__":
    if os.environ.get("MOETRON_TEST_STALL"):
        install(os.environ["MOETRON_TEST_STALL"])
    from moetron.cli import main

    sys.exit(main(sys.argv[1:]))

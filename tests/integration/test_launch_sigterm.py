"""`moetron launch` (torchrun for moetron): SIGTERM to the launcher during training saves one checkpoint, at the same
iteration on both ranks, and exits 0 with one line and no traceback — where plain `torchrun` exits 1 with a
`SignalException` traceback (torch's agent re-raises the signal whatever its workers did)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_fault_injection import assert_loadable
from test_train_guards import TINY, write_dataset

HERE = Path(__file__).resolve().parent

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def test_launch_rejects_what_is_not_a_moetron_command_in_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "moetron", "launch", "--nproc-per-node", "2", "trian", "--x"],
        capture_output=True,
        text=True,
        env=ENV,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "error: moetron launch: 'trian' is not a moetron command" in proc.stderr


def test_launch_help_names_torchruns_flags(capsys):
    from moetron.cli import main

    assert main(["launch", "--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: moetron launch [torchrun flags] COMMAND" in out and "--nproc-per-node" in out


def test_a_worker_that_said_its_error_gets_no_second_line_from_the_launcher():
    from moetron.commands.launch import worker_failed

    said = worker_failed(1, 2, None)  # status 2: a UserError the worker printed as its one `error:` line
    assert said.quiet and said.exit_code == 2
    crashed = worker_failed(1, 1, None)
    assert not crashed.quiet and "worker rank 1 exited with status 1 (its error is above)" in str(crashed)


def test_launch_world_size_is_nodes_times_workers_unless_elastic():
    from moetron.commands.launch import launch_world_size, torchrun_args

    assert launch_world_size(torchrun_args(["--nnodes", "2", "--nproc-per-node", "3", "train"])) == 6
    assert launch_world_size(torchrun_args(["--nnodes", "1:4", "--nproc-per-node", "2", "train"])) is None


def wait_for_iterations(run: Path, count: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    metrics = run / "metrics.jsonl"
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before the signal was sent"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= count:
            return
        time.sleep(0.2)
    raise TimeoutError(f"fewer than {count} iterations logged in {timeout}s")


@pytest.mark.distributed
@pytest.mark.slow
def test_sigterm_to_moetron_launch_saves_on_every_rank_and_exits_zero(tmp_path):
    prefix = write_dataset(tmp_path / "corpus_text_document", documents=60)
    run = tmp_path / "run"
    train = [*TINY, "--data-path", prefix, "--global-batch-size", "4", "--eval-iters", "0", "--train-iters", "100000"]
    train += ["--save", str(run), "--save-interval", "100000"]
    command = [sys.executable, "-m", "moetron", "launch", "--standalone", "--nproc-per-node", "2", "train", *train]
    with open(tmp_path / "out", "w+") as out, open(tmp_path / "err", "w+") as err:
        proc = subprocess.Popen(command, env=ENV, stdout=out, stderr=err, text=True)
        try:
            wait_for_iterations(run, 3, proc)
            proc.send_signal(signal.SIGTERM)
            returncode = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    assert returncode == 0, stdout[-2000:] + stderr[-3000:]
    assert "Traceback" not in stderr and "error" not in stderr.lower(), stderr[-3000:]
    said = [line for line in stderr.splitlines() if line.startswith("moetron launch:")]
    assert len(said) == 1 and "received SIGTERM" in said[0], stderr[-3000:]
    stopped = re.findall(r"received SIGTERM: saving at iteration (\d+) and exiting", stdout)
    assert len(stopped) == 1, stdout[-3000:]
    iteration = int(stopped[0])
    checkpoint = run / f"iter_{iteration:07d}"
    assert (run / "latest").read_text().strip() == checkpoint.name
    assert sorted(p.name for p in run.glob("iter_*")) == [checkpoint.name]  # saved once
    assert json.loads((checkpoint / "state.json").read_text())["iteration"] == iteration
    rng_files = sorted(p.name for p in (checkpoint / "rng").iterdir())  # one per rank: both saved this iteration
    assert rng_files == ["rank_00000.safetensors", "rank_00001.safetensors"]
    assert assert_loadable(run) == iteration


@pytest.mark.distributed
@pytest.mark.slow  # the launcher and its workers import torch first (15-25 s on a busy machine)
def test_sigterm_while_the_workers_start_says_they_were_stopped_by_it(tmp_path):
    """Before a worker handles SIGTERM (it is still importing torch) the forwarded signal stops it: no 'its error is
    above' (it printed none), and the launcher exits like a process stopped by SIGTERM."""
    from moetron.commands.launch import worker_pids

    prefix = write_dataset(tmp_path / "corpus_text_document", documents=60)  # the launcher validates the config
    train = [*TINY, "--data-path", prefix, "--global-batch-size", "4", "--train-iters", "2"]
    command = [sys.executable, "-m", "moetron", "launch", "--standalone", "--nproc-per-node", "2", "train", *train]
    proc = subprocess.Popen(command, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(worker_pids(proc.pid)) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in stderr and "its error is above" not in stderr, stderr[-3000:]
    assert "was stopped by the SIGTERM passed on to it while it was still starting" in errors[0], errors


@pytest.mark.distributed
@pytest.mark.slow
def test_workers_of_a_killed_launcher_save_and_stop(tmp_path):
    """`kill -9` of `moetron launch` forwards nothing: each worker gets its SIGTERM from the kernel when its parent
    dies (PR_SET_PDEATHSIG), so the ranks agree to stop after the same step, save one checkpoint and exit, instead
    of training on unsupervised."""
    from moetron.commands.launch import worker_pids

    prefix = write_dataset(tmp_path / "corpus_text_document", documents=60)
    run = tmp_path / "run"
    train = [*TINY, "--data-path", prefix, "--global-batch-size", "4", "--eval-iters", "0", "--train-iters", "100000"]
    train += ["--save", str(run), "--save-interval", "100000"]
    command = [sys.executable, "-m", "moetron", "launch", "--standalone", "--nproc-per-node", "2", "train", *train]
    with open(tmp_path / "out", "w+") as out:
        proc = subprocess.Popen(command, env=ENV, stdout=out, stderr=subprocess.STDOUT, text=True)
        workers: list[int] = []
        try:
            wait_for_iterations(run, 3, proc)
            workers = worker_pids(proc.pid)
            assert len(workers) == 2
            proc.kill()
            proc.wait()
            deadline = time.monotonic() + 300
            while any(Path(f"/proc/{pid}").exists() for pid in workers) and time.monotonic() < deadline:
                time.sleep(0.2)
            alive = [pid for pid in workers if Path(f"/proc/{pid}").exists()]
        finally:
            for pid in workers:
                if Path(f"/proc/{pid}").exists():
                    os.kill(pid, signal.SIGKILL)
        out.seek(0)
        log = out.read()
    assert alive == [], log[-3000:]
    stopped = re.findall(r"received SIGTERM: saving at iteration (\d+) and exiting", log)
    assert len(stopped) == 1, log[-3000:]
    iteration = int(stopped[0])
    assert (run / "latest").read_text().strip() == f"iter_{iteration:07d}"
    assert assert_loadable(run) == iteration

"""The fault suite: SIGKILL at random points of training and inside every phase of a checkpoint save, SIGTERM during
a save, a rank killed under torchrun — each leaves a loadable `latest` checkpoint, and the resumed run reproduces
the uninterrupted loss curve bit for bit. (A full disk during a save: tests/unit/test_checkpoint.py.)

Faults are injected from outside the trainer by `fault_worker.py` (a wrapper that patches functions and signals
its own process); random points come from seeded generators, so a failure names a reproducible case.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_train_guards import TINY, write_dataset

HERE = Path(__file__).resolve().parent

ITERS, SAVE_EVERY = 8, 2
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
SAVE_PHASES = ("staging", "shards", "renamed", "latest")


def flags(prefix: str, run: Path) -> list[str]:
    common = [*TINY, "--data-path", prefix, "--train-iters", str(ITERS), "--save-interval", str(SAVE_EVERY)]
    return [*common, "--eval-iters", "0", "--save", str(run), "--load", str(run)]


def train(
    prefix: str, run: Path, fault: str | None = None, nproc: int = 1, extra: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in ENV.items() if k != "MOETRON_TEST_FAULT"}
    if fault:
        env["MOETRON_TEST_FAULT"] = fault
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    batch = ["--global-batch-size", str(2 * nproc)]  # micro batch 2 on every rank
    cmd = [*launcher, str(HERE / "fault_worker.py"), "train", *flags(prefix, run), *batch, *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def curve(run: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    iterations = [r["iteration"] for r in records]
    assert len(iterations) == len(set(iterations)), f"duplicate iterations in metrics.jsonl: {iterations}"
    return {r["iteration"]: r["lm_loss"] for r in records}


def assert_loadable(run: Path) -> int:
    """The iteration of `latest`, after loading its weights into a fresh model."""
    from moetron.checkpoint import load_weights, resolve_checkpoint
    from moetron.config_cli import load_config
    from moetron.model.gpt import create_model

    path = resolve_checkpoint(str(run))
    assert path is not None and path.is_dir(), f"no loadable checkpoint in {run}"
    cfg, _ = load_config(str(path / "config.yaml"), {})
    return int(load_weights(path, create_model(cfg.model, "cpu", seed=0))["iteration"])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, dict[int, float]]:
    """(dataset prefix, the uninterrupted run's loss curve)."""
    tmp = tmp_path_factory.mktemp("fault")
    prefix = write_dataset(tmp / "corpus_text_document", documents=60)
    straight = train(prefix, tmp / "straight")
    assert straight.returncode == 0, straight.stderr[-2000:]
    return prefix, curve(tmp / "straight")


def kill_then_resume(
    prefix: str, run: Path, fault: str, reference: dict[int, float], nproc: int = 1, extra: tuple[str, ...] = ()
) -> int:
    killed = train(prefix, run, fault, nproc, extra)
    assert killed.returncode != 0, f"{fault}: the injected fault did not stop the run"
    saved = assert_loadable(run) if (run / "latest").exists() or list(run.glob("iter_*")) else 0
    resumed = train(prefix, run, nproc=nproc, extra=extra)
    assert resumed.returncode == 0, f"{fault}: {resumed.stderr[-2000:]}"
    assert curve(run) == reference, f"{fault}: the resumed curve differs from the uninterrupted one"
    assert assert_loadable(run) == ITERS
    return saved


@pytest.mark.slow
def test_sigkill_in_every_phase_of_a_save_and_at_random_steps(corpus, tmp_path):
    prefix, reference = corpus
    cases = [f"{phase}:{2 * random.Random(seed).randint(1, ITERS // 2 - 1)}" for seed, phase in enumerate(SAVE_PHASES)]
    cases += [f"step:{random.Random(100 + seed).randint(2, ITERS)}" for seed in range(3)]
    resumed_from = {}
    for i, fault in enumerate(cases):
        resumed_from[fault] = kill_then_resume(prefix, tmp_path / f"run{i}", fault, reference)
    for fault, saved in resumed_from.items():  # the save being killed never counts; the one before it does
        where, iteration = fault.split(":")
        expected = int(iteration) if where in ("renamed", "latest") else (int(iteration) - 1) // SAVE_EVERY * SAVE_EVERY
        assert saved == expected, (fault, saved, expected)


@pytest.mark.slow
def test_sigterm_during_a_save_saves_once_and_exits_zero(corpus, tmp_path):
    prefix, _ = corpus
    run = tmp_path / "run"
    done = train(prefix, run, "shards:4:TERM")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "received SIGTERM: saving at iteration 4 and exiting" in done.stdout
    assert done.stdout.count("saved checkpoint") == 2  # iterations 2 and 4, the latter once
    assert assert_loadable(run) == 4


@pytest.mark.slow
def test_sigkill_during_an_asynchronous_save_and_sigterm_waiting_for_one(corpus, tmp_path):
    """--async-save: kill -9 while the writer thread writes iteration 4's tensors (training has gone on) or between
    its rename and `latest`; then a SIGTERM during that write: the run finishes it, saves once more, exits 0."""
    prefix, reference = corpus
    asynchronous = ("--async-save",)
    assert kill_then_resume(prefix, tmp_path / "write", "write:4", reference, extra=asynchronous) == 2
    # renamed to iter_0000004 but `latest` not moved yet: the previous checkpoint is the one loaded
    assert kill_then_resume(prefix, tmp_path / "renamed", "renamed:4", reference, extra=asynchronous) == 2
    run = tmp_path / "term"
    done = train(prefix, run, "write:4:TERM", extra=asynchronous)
    assert done.returncode == 0, done.stderr[-2000:]
    stopped_at = int(done.stdout.split("received SIGTERM: saving at iteration ")[1].split()[0])
    # the step during which the signal came or a later one: the writer thread (at a lower CPU priority than the
    # loop) may write its first tensor a few steps on; every save is made once, the SIGTERM's only if not made yet
    assert 4 <= stopped_at <= ITERS, done.stdout
    saves = set(range(SAVE_EVERY, stopped_at + 1, SAVE_EVERY)) | {stopped_at}
    assert done.stdout.count("saving checkpoint (in the background)") == len(saves), done.stdout
    assert assert_loadable(run) == stopped_at and (run / "iter_0000004" / ".metadata").is_file()


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_killed_under_torchrun_leaves_a_checkpoint_the_rerun_resumes_exactly(corpus, tmp_path):
    prefix, _ = corpus
    straight = tmp_path / "straight"
    assert train(prefix, straight, nproc=2).returncode == 0
    saved = kill_then_resume(prefix, tmp_path / "run", "rank1-step:6", curve(straight), nproc=2)
    assert saved == 4


def rank_lines(proc: subprocess.CompletedProcess) -> tuple[list[str], str]:
    """(the `error:` lines of every rank, all the output): torchrun passes each worker's stderr through."""
    log = proc.stdout + proc.stderr
    return [line for line in log.splitlines() if line.startswith("error:")], log


@pytest.mark.slow
@pytest.mark.distributed
def test_an_error_of_rank_1_alone_is_said_once_by_rank_1(tmp_path):
    """An internal error on rank 1 only keeps its traceback, printed by rank 1 (rank 0, left waiting in the gradient
    reduction, adds no line); a corrupt RNG file that only rank 1 reads is one `error: rank 1: …` line."""
    prefix = write_dataset(tmp_path / "corpus_text_document", documents=60)
    run = tmp_path / "run"
    crashed = train(prefix, run, "rank1-step:3:RAISE", nproc=2)  # iteration 2 was saved first
    errors, log = rank_lines(crashed)
    assert crashed.returncode != 0 and errors == [], log[-3000:]
    assert log.count("RuntimeError: injected fault at step 3 on rank 1") == 1 and "[rank0]" not in log, log[-3000:]
    rng = run / "iter_0000002" / "rng" / "rank_00001.safetensors"
    rng.write_bytes(rng.read_bytes()[:20])  # truncated: the header no longer fits
    resumed = train(prefix, run, nproc=2)
    errors, log = rank_lines(resumed)
    assert resumed.returncode != 0 and len(errors) == 1, log[-3000:]
    # refused by its checksum, by the rank whose share of the files it is (rank 1: every second file from the
    # second, sorted), before any rank reads it
    why = "is corrupt or truncated (rng/rank_00001.safetensors: its sha256 differs"
    assert errors[0].startswith(f"error: rank 1: checkpoint {run / 'iter_0000002'} {why}"), errors
    assert log.count("rank_00001.safetensors") == 1 and "[rank" not in log, log[-3000:]
    shutil.rmtree(run / "iter_0000002" / "checksums")  # saved without checksums: the RNG file's own read fails
    resumed = train(prefix, run, nproc=2)
    errors, log = rank_lines(resumed)
    assert resumed.returncode != 0 and len(errors) == 1, log[-3000:]
    assert errors[0].startswith(f"error: rank 1: checkpoint {run / 'iter_0000002' / 'rng'} is corrupt"), errors
    assert log.count("rank_00001.safetensors") == 1 and "[rank" not in log, log[-3000:]

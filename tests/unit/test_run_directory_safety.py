"""A run directory is never destroyed by a run that did not write it, nor by --overwrite or --finetune with a --load
inside it; it has one owner at a time (a lock file); its config.yaml holds the run, not one invocation's intentions;
resuming keeps the checkpoint's LR schedule (unless --override-opt-param-scheduler) and each iteration appears once
in the logs; a garbage `latest` pointer is one line."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
from pathlib import Path

import pytest
import yaml
from dead_pid import dead_pid
from test_train_guards import TINY, write_dataset

from moetron.cli import main
from moetron.config import RUN_TIME_INTENTIONS
from moetron.errors import UserError
from moetron.train.run_lock import LOCK_NAME, RunLock
from moetron.train.trainer import Trainer

STEPS = ["--train-iters", "4", "--save-interval", "2", "--lr", "1e-3", "--min-lr", "1e-5"]


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def trained(tmp_path, capsys):
    prefix = write_dataset(tmp_path / "corpus_text_document")
    run = tmp_path / "run"
    assert main(["train", *TINY, "--data-path", prefix, *STEPS, "--save", str(run)]) == 0
    capsys.readouterr()
    return prefix, run


@pytest.mark.parametrize("load", [None, "typo"], ids=["no-load", "mistyped-load"])
def test_a_new_run_refuses_a_save_directory_holding_another_run(trained, tmp_path, capsys, load):
    prefix, run = trained
    before = snapshot(run)
    extra = ["--load", str(tmp_path / load)] if load else []
    assert main(["train", *TINY, "--data-path", prefix, *STEPS, "--save", str(run), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert f"--save {run} already holds another run's output (checkpoints up to iter_0000004)" in err
    assert f"--load {run}" in err and "--overwrite" in err
    assert snapshot(run) == before  # nothing renamed, pruned, rewound, overwritten or appended


def test_overwrite_deletes_the_previous_run_and_starts_fresh(trained, capsys):
    prefix, run = trained
    assert main(["train", *TINY, "--data-path", prefix, "--train-iters", "2", "--save", str(run), "--overwrite"]) == 0
    out = capsys.readouterr().out
    assert "--overwrite: deleting the previous run's checkpoints up to iter_0000004" in out
    assert sorted(p.name for p in run.glob("iter_*")) == ["iter_0000002"]
    assert [json.loads(line)["iteration"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def lrs(run: Path) -> dict[int, float]:
    return {r["iteration"]: r["lr"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def test_resuming_keeps_the_checkpoints_schedule_unless_overridden(trained, tmp_path, capsys):
    prefix, run = trained
    decayed = lrs(run)[4]
    longer = ["train", *TINY, "--data-path", prefix, *STEPS[2:], "--train-iters", "8", "--save", str(run)]
    assert main([*longer, "--load", str(run), "--save-interval", "100"]) == 0
    out = capsys.readouterr().out
    assert "warning: the LR schedule in use" in out and "add --override-opt-param-scheduler" in out  # finished
    assert lrs(run)[5] == pytest.approx(1e-5) and decayed == pytest.approx(1e-5)  # stays at the decayed end

    other = tmp_path / "other"
    assert main(["train", *TINY, "--data-path", prefix, *STEPS, "--save", str(other)]) == 0
    assert main([*longer[:-1], str(other), "--load", str(other), "--override-opt_param-scheduler"]) == 0
    assert "LR schedule: this run's flags" in capsys.readouterr().out
    assert lrs(other)[5] > 1e-4  # the longer run's schedule: halfway through its decay


def test_a_resumed_run_logs_each_iteration_once(trained, capsys):
    prefix, run = trained
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    ghost = [json.dumps({**json.loads(lines[-1]), "iteration": 5}), '{"iteration": 6, "lm_lo']  # a crash mid-write
    metrics.write_text("\n".join(lines + ghost) + "\n")
    (run / "latest").write_text("iter_0000004\n")
    assert main(["train", *TINY, "--data-path", prefix, *STEPS[2:], "--train-iters", "6", "--save", str(run),
                 "--load", str(run), "--save-interval", "100"]) == 0  # fmt: skip
    assert [json.loads(line)["iteration"] for line in metrics.read_text().splitlines()] == [1, 2, 3, 4, 5, 6]


def test_garbage_in_latest_is_one_line(trained, capsys):
    prefix, run = trained
    (run / "latest").write_bytes(b"\x00\xff garbage\n")
    assert main(["train", *TINY, "--data-path", prefix, *STEPS, "--save", str(run), "--load", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "latest does not name a checkpoint" in err


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("inside", ["", "iter_0000004"], ids=["run-dir", "iter-dir"])
def test_overwrite_refuses_to_delete_the_checkpoint_it_loads(trained, capsys, inside):
    prefix, run = trained
    before = snapshot(run)
    load = str(run / inside) if inside else str(run)
    argv = ["train", *TINY, "--data-path", prefix, *STEPS, "--save", str(run), "--load", load, "--overwrite"]
    assert main(argv) == 2
    err = one_error_line(capsys)
    assert f"--overwrite would delete the checkpoint --load {load} names (it is inside --save {run})" in err
    assert snapshot(run) == before


def test_finetune_refuses_to_replace_the_run_it_loads(trained, capsys):
    prefix, run = trained
    before = snapshot(run)
    argv = ["train", *TINY, "--data-path", prefix, *STEPS, "--save", str(run), "--load", str(run), "--finetune"]
    assert main(argv) == 2
    err = one_error_line(capsys)
    assert "--finetune starts a new run at iteration 0" in err and "give a new --save" in err
    assert snapshot(run) == before  # the checkpoint of the same iteration, metrics.jsonl and eval.jsonl as they were


def test_the_saved_config_holds_the_run_not_this_invocations_intentions(trained, capsys):
    prefix, run = trained
    argv = ["train", *TINY, "--data-path", prefix, *STEPS, "--save", str(run), "--load", str(run)]
    assert (
        main([*argv, "--train-iters", "6", "--exit-interval", "5", "--no-load-rng", "--override-opt_param-scheduler"])
        == 0
    )
    for saved in (run / "config.yaml", run / "iter_0000005" / "config.yaml"):
        train = yaml.safe_load(saved.read_text())["train"]
        assert train["train_iters"] == 6 and not set(RUN_TIME_INTENTIONS) & set(train)
    capsys.readouterr()
    assert main([*argv, "--exit-interval", "5", "--print-config"]) == 0  # --print-config shows all of them
    assert yaml.safe_load(capsys.readouterr().out)["train"]["exit_interval"] == 5


def test_exit_interval_without_save_says_it_stops_without_saving(tmp_path, capsys):
    prefix = write_dataset(tmp_path / "corpus_text_document")
    assert main(["train", *TINY, "--data-path", prefix, "--train-iters", "4", "--exit-interval", "2"]) == 0
    out = capsys.readouterr().out
    assert " reached --exit-interval 2: stopping without a checkpoint (no --save) at iteration 2 and exiting" in out
    assert "saving" not in out and " iteration       3/4" not in out


# ---------------------------------------------------------------------------- one owner at a time
def write_lock(run: Path, host: str, pid: int) -> Path:
    lock = run / LOCK_NAME
    lock.write_text(json.dumps({"host": host, "pid": pid, "started": "2026-01-01T00:00:00+00:00", "token": "0"}))
    return lock


def resume(prefix: str, run: Path, *extra: str) -> list[str]:
    return ["train", *TINY, "--data-path", prefix, *STEPS[2:], "--train-iters", "6", "--save", str(run),
            "--load", str(run), *extra]  # fmt: skip


@pytest.mark.parametrize("elsewhere", [False, True], ids=["live-pid-here", "other-host"])
def test_a_run_directory_in_use_is_refused(trained, capsys, elsewhere):
    prefix, run = trained
    host, pid = ("node-17", 4242) if elsewhere else (socket.gethostname(), os.getppid())  # our parent is alive
    lock = write_lock(run, host, pid)
    before = snapshot(run)
    assert main(resume(prefix, run)) == 2
    err = one_error_line(capsys)
    assert f"--save {run} is in use by another run: pid {pid} on host {host}" in err and str(lock) in err
    assert ("if that run is really dead, delete" if elsewhere else "wait for it to end") in err
    assert snapshot(run) == before  # no interleaved metrics.jsonl, no checkpoint pruned or replaced


def test_a_stale_lock_is_taken_over_and_the_lock_released_at_the_end(trained, capsys):
    prefix, run = trained
    pid = dead_pid()
    lock = write_lock(run, socket.gethostname(), pid)
    assert main(resume(prefix, run)) == 0
    assert f"note: {lock} was left by pid {pid} on host {socket.gethostname()}" in capsys.readouterr().out
    assert not lock.exists() and (run / "iter_0000006").is_dir()
    assert LOCK_NAME not in {p.name for p in run.rglob("*") if p.parent != run}  # never copied into a checkpoint


def test_the_lock_is_held_while_training_and_released_on_an_error(trained, capsys, monkeypatch):
    prefix, run = trained
    seen = []

    def failing_train(self):
        seen.append(json.loads((run / LOCK_NAME).read_text()))
        raise UserError("something went wrong mid-run")

    monkeypatch.setattr(Trainer, "train", failing_train)
    assert main(resume(prefix, run)) == 2
    assert seen[0]["pid"] == os.getpid() and seen[0]["host"] == socket.gethostname()
    assert not (run / LOCK_NAME).exists()
    assert "something went wrong mid-run" in one_error_line(capsys)


def test_a_run_that_fails_before_training_leaves_no_directory_behind(tmp_path, capsys):
    prefix = write_dataset(tmp_path / "wide_text_document", high=600)  # token ids beyond the vocabulary
    assert main(["train", *TINY, "--data-path", prefix, "--save", str(tmp_path / "new" / "run")]) == 2
    assert "token id 600 is out of range" in one_error_line(capsys)
    assert not (tmp_path / "new").exists()  # the directories made for the lock went with it


@pytest.mark.parametrize("links", [True, False], ids=["hard-links", "no-hard-links"])
def test_two_owners_of_one_run_directory_are_kept_apart(tmp_path, monkeypatch, links):
    if not links:  # some network filesystems refuse hard links: the lock is then created in place

        def no_link(*_):
            raise OSError(errno.EPERM, "Operation not permitted")

        monkeypatch.setattr(os, "link", no_link)
    first, second = RunLock(tmp_path / "run", "--save"), RunLock(tmp_path / "run", "--save")
    first.acquire()
    with pytest.raises(UserError, match=f"is in use by another run: pid {os.getpid()} on host"):
        second.acquire()
    first.release()
    second.acquire()  # free again once the first owner left
    assert json.loads((tmp_path / "run" / LOCK_NAME).read_text())["token"] == second.owner.token
    first.release()  # not its lock any more: it stays
    assert (tmp_path / "run" / LOCK_NAME).exists()
    second.release()
    assert not (tmp_path / "run").exists()  # made for the lock, left empty: removed


def test_overwrite_deletes_nothing_before_the_checkpoint_it_loads_was_read(trained, tmp_path, capsys):
    prefix, run = trained
    broken = tmp_path / "broken"
    shutil.copytree(run / "iter_0000004", broken)
    (broken / "state.json").write_text('{"iteration": 4, "format_ver')  # truncated
    before = snapshot(run)
    argv = ["train", *TINY, "--data-path", prefix, *STEPS, "--save", str(run), "--load", str(broken), "--overwrite"]
    assert main(argv) == 2
    assert f"checkpoint {broken} is corrupt or truncated" in one_error_line(capsys)
    assert snapshot(run) == before  # the previous run is still all there

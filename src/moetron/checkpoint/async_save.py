"""`--async-save`: the checkpoint's tensors are copied to CPU memory and written by a background thread while
training goes on, with the guarantees of the synchronous save (`state.py`, `files.py`) intact.

    save(iteration)     (every rank, between steps) wait for the write in flight, if any: at most one at a time;
                        the staging directory, this rank's RNG file, state.json and config.yaml (small, written
                        now, so they hold this step's state); then `dcp.async_save` copies every tensor to fresh
                        CPU memory (DCP's own staging: its `FileSystemWriter.stage`) and hands the copy to DCP's
                        writer thread, and training resumes
    background thread   waits for DCP's write (its collectives run over a gloo group of their own, so they never
                        interleave with the training loop's); every rank agrees whether it worked; rank 0 publishes
                        (rename to iter_*, then `latest`, then prune); every rank agrees again
    wait()              (the next save, the end of training, a SIGTERM's final save, an error leaving the loop)
                        joins the thread and raises its failure as the synchronous save's one line

So a crash at any moment leaves the previous checkpoint loadable (`latest` moves only after every rank's shards
are fsynced and renamed into place), and the files are those of a synchronous save of the same step: the same DCP
plan over the same global tensors, only written later from a copy. Why DCP's `async_save` in a thread rather than
its process mode: the process mode starts a second process group in a spawned child per run; a thread needs only
the gloo group, and DCP's writer releases the GIL while it writes, so the loop loses little but the copy.
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from moetron.checkpoint import files
from moetron.checkpoint.state import (
    GlobalView,
    _attempt,
    _fail_everywhere_if_any,
    save_rank_rng,
    single_process_quiet,
    stage_checkpoint,
    write_shared_files,
)
from moetron.errors import UserError
from moetron.parallel.diagnosis import Site


class AsyncCheckpointer:
    """`save` has `save_checkpoint`'s signature and returns as soon as the tensors are copied; `wait` ends the
    write in flight. One per run; in a distributed run every rank builds it at the same point (a collective)."""

    def __init__(self, env):
        self.env = env
        # DCP's async save needs a CPU-capable group; a dedicated one keeps its collectives (run from the writer
        # thread) apart from the training loop's on the default group
        self.group = dist.new_group(backend="gloo") if env.distributed else None
        if not env.distributed:  # DCP warns on every single-process save, here from its writer thread, which the
            # synchronous save's `single_process_quiet` (a `catch_warnings`, not thread-safe) cannot reach
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        self._thread: threading.Thread | None = None
        self._iteration: int | None = None
        self._failure: BaseException | None = None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def save(
        self,
        run_dir,
        iteration: int,
        view: GlobalView,
        optimizer: torch.optim.Optimizer,
        state: dict,
        config_yaml: str,
        env,
        keep_last_n: int,
    ) -> Path:
        """Start the save of `iteration` (after the previous one has finished); returns the path it will publish."""
        self.wait()
        run_dir = Path(run_dir)
        tmp = stage_checkpoint(run_dir, iteration, env)
        with Site(f"the checkpoint save of iteration {iteration} (staging)"):
            failure = _attempt(lambda: _write_small_files(tmp, state, config_yaml, env))
            _fail_everywhere_if_any(env, failure, run_dir, iteration, discard=tmp)
            tensors = view.state(optimizer)
            writer = dcp.FileSystemWriter(str(tmp), sync_files=True)
            with single_process_quiet() as no_dist:
                future = dcp.async_save(tensors, storage_writer=writer, process_group=self.group, no_dist=no_dist)
        del tensors  # the staged copy is DCP's now; these are views of the live weights
        args = (future, run_dir, iteration, keep_last_n)
        self._thread = threading.Thread(target=self._finish, args=args, name=f"moetron-save-{iteration}")
        self._iteration, self._failure = iteration, None
        self._thread.start()
        return run_dir / files.iteration_dir_name(iteration)

    def wait(self) -> None:
        """Block until the write in flight (if any) is published; raise its failure here, on every rank alike."""
        if self._thread is None:
            return
        with Site(f"the asynchronous checkpoint write of iteration {self._iteration}"):
            self._thread.join()
            self._thread = None
            failure, self._failure = self._failure, None
            if failure is not None:
                raise failure

    def _finish(self, future, run_dir: Path, iteration: int, keep_last_n: int) -> None:
        """(the background thread) DCP's write, the agreement, the publish; the outcome is kept for `wait`."""
        try:
            self._publish_when_written(future, run_dir, iteration, keep_last_n)
        except BaseException as err:  # noqa: BLE001 - raised in the main thread by wait()
            self._failure = err

    def _publish_when_written(self, future, run_dir: Path, iteration: int, keep_last_n: int) -> None:
        env, tmp = self.env, files.staging_dir(run_dir, iteration)
        failure = _attempt(future.result)
        _fail_everywhere_if_any(env, failure, run_dir, iteration, discard=tmp, group=self.group)
        failure = _attempt(lambda: files.publish(run_dir, iteration, keep_last_n)) if env.is_main else None
        _fail_everywhere_if_any(env, failure, run_dir, iteration, group=self.group)

    def close(self) -> None:
        """Wait for the write in flight without raising a failure of it over the error already on its way out."""
        try:
            self.wait()
        except (UserError, OSError, CheckpointException, RuntimeError):
            pass


def _write_small_files(tmp: Path, state: dict, config_yaml: str, env) -> None:
    """What the synchronous save writes beside DCP's files, of this step: this rank's RNG, and (rank 0) the rest."""
    save_rank_rng(tmp, env)
    if env.is_main:
        write_shared_files(tmp, state, config_yaml)

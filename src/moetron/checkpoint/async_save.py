"""`--async-save`: the checkpoint's tensors are copied to CPU memory and written by a background thread while
training goes on, with the guarantees of the synchronous save (`state.py`, `files.py`) intact.

    save(iteration)     (every rank, between steps) wait for the write in flight, if any: at most one at a time;
                        the staging directory, this rank's RNG file, state.json and config.yaml (small, written
                        now, so they hold this step's state); then `dcp.async_save` with DCP's `DefaultStager`
                        (asynchronous staging): a staging thread copies every tensor into CPU buffers kept from the
                        previous save, and DCP's writer thread writes the copy once it is complete; training resumes
                        at once, the copy running beside the next step's forward and backward
    before_update()     (the trainer, before the optimizer step and the expert-bias update: the first writes to
                        the saved tensors after a save) waits for the staging copy to be complete
    background thread   waits for DCP's write (its collectives run over a gloo group of their own, so they never
                        interleave with the training loop's); every rank agrees whether it worked; rank 0 publishes
                        (rename to iter_*, then `latest`, then prune); every rank agrees again
    wait()              (the next save, the end of training, a SIGTERM's final save, an error leaving the loop)
                        joins the thread and raises its failure as the synchronous save's one line

So a crash at any moment leaves the previous checkpoint loadable (`latest` moves only after every rank's shards
are fsynced and renamed into place), and the files are those of a synchronous save of the same step: the same DCP
plan over the same global tensors, only written later from a copy taken before any weight changed.

Where the loop's time went (benchmarks/async_save.py): with DCP's default blocking stager, `save()` held the loop for
the copy into freshly allocated CPU memory (page faults: more than the copy itself), about half a synchronous save.
The `DefaultStager` keeps its CPU buffers between saves (one copy of this rank's checkpoint stays allocated: the
price, in host memory) and copies in its own thread (on CUDA from pinned buffers on a side stream, without
blocking), so `save()` returns after building the state dict and the loop waits only if the copy is not done by
the optimizer step. Why DCP's thread mode rather than its process mode: the process mode starts a second process
group in a spawned child per run; a thread needs only the gloo group, and DCP's writer releases the GIL while it
writes.
"""

from __future__ import annotations

import concurrent.futures
import threading
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

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
        self._stager: DefaultStager | None = None  # made at the first save (on CUDA its stream must follow the loop's)
        self._staging = None  # the staging copy of the save in flight (a Future) until `before_update` has seen it

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
                stager = self.stager()
                response = dcp.async_save(
                    tensors, storage_writer=writer, process_group=self.group, no_dist=no_dist, async_stager=stager
                )
        del tensors  # views of the live weights: the staging thread holds them until its copy is done
        self._staging = response.staging_completion
        args = (response.upload_completion, run_dir, iteration, keep_last_n)
        self._thread = threading.Thread(target=self._finish, args=args, name=f"moetron-save-{iteration}")
        self._iteration, self._failure = iteration, None
        self._thread.start()
        return run_dir / files.iteration_dir_name(iteration)

    def stager(self) -> DefaultStager:
        """DCP's stager, one per run so that its CPU buffers serve every save: asynchronous (its own thread), on
        CUDA into pinned memory with non-blocking copies on a side stream."""
        if self._stager is None:
            cuda = torch.cuda.is_available() and self.env.device.type == "cuda"
            options = StagingOptions(
                use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=cuda
            )
            self._stager = DefaultStager(options)
        return self._stager

    def before_update(self) -> None:
        """Wait (if need be) until the staging copy of the save in flight is complete: after this the loop may
        change the weights and optimizer state. A failed copy is not raised here: the writer thread sees it too, and
        `wait` says it, on every rank alike."""
        if self._staging is not None:
            concurrent.futures.wait([self._staging])
            self._staging = None

    def wait(self) -> None:
        """Block until the write in flight (if any) is published; raise its failure here, on every rank alike."""
        if self._thread is None:
            return
        with Site(f"the asynchronous checkpoint write of iteration {self._iteration}"):
            self.before_update()
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
        failure = _attempt_any(future.result)
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


def _attempt_any(wait) -> BaseException | None:
    """`_attempt` for the background write: any error of DCP's staging copy or write (a failed copy raises no
    OSError) is this rank's failure to agree on, so no peer is left waiting in the agreement."""
    try:
        wait()
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP's is a BaseException; said by `wait`
        return err
    return None

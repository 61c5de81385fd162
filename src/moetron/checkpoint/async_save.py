"""`--async-save`: the checkpoint's tensors are copied to CPU memory and written by a background thread while
training goes on, with the guarantees of the synchronous save (`state.py`, `files.py`) intact.

    save(iteration)     (every rank, between steps) wait for the write in flight, if any: at most one at a time;
                        capture this rank's RNG states and the trainer state in memory (so the files hold this
                        step's state), build the state dict and start DCP's `DefaultStager` (asynchronous staging):
                        a staging thread copies every tensor into CPU buffers kept from the previous save, with
                        the GIL released. Training resumes at once, the copy running beside the next step's
                        forward and backward
    before_update()     (the trainer, before the optimizer step and the expert-bias update: the first writes to
                        the saved tensors after a save) waits for the staging copy to be complete
    background thread   the synchronous save's phases in its order, each agreed by every rank over a gloo group of
                        the writer's own (so its collectives never interleave with the training loop's): rank 0
                        makes the fresh staging directory (the agreement is the barrier before anyone writes into
                        it); every rank writes its RNG file, rank 0 state.json and config.yaml (fsynced); once the
                        copy is complete, `dcp.save` of the copy; rank 0 publishes (rename to iter_*, then `latest`,
                        then prune)
    wait()              (the next save, the end of training, a SIGTERM's final save, an error leaving the loop)
                        joins the thread and raises its failure as the synchronous save's one line

So a crash at any moment leaves the previous checkpoint loadable (`latest` moves only after every rank's shards
are fsynced and renamed into place), and the files are those of a synchronous save of the same step: the same DCP
plan over the same global tensors, only written later from a copy taken before any weight changed.

Where the loop's time went (benchmarks/async_save.py): with DCP's default blocking stager, `save()` held the loop for
the copy into freshly allocated CPU memory (page faults: more than the copy itself), about half a synchronous save;
then the staging directory's barrier and three fsynced small files (RNG, state.json, config.yaml), now in the
writer thread (their contents captured in memory first); then the GIL, which DCP's staging copy held for each
storage's whole memcpy (`_GilFreeStateDictStager`) and which a lowered-priority writer kept while descheduled.
Why our thread calls `dcp.save` on the staged copy rather
than `dcp.async_save`: DCP's executor starts writing as soon as the copy is done, before our thread could have made
the staging directory and agreed on it; `dcp.async_save` in thread mode is this same `save` of the staged copy.
The `DefaultStager` keeps its CPU buffers between saves (one copy of this rank's checkpoint stays allocated: the
price, in host memory) and copies in its own thread (on CUDA from pinned buffers on a side stream, without
blocking), so `save()` returns after building the state dict and the loop waits only if the copy is not done by
the optimizer step. Why a thread rather than DCP's process mode (`async_checkpointer_type`): it starts a second process
group in a spawned child per run; a thread needs only the gloo group, and DCP's writer releases the GIL while it
writes.
"""

from __future__ import annotations

import concurrent.futures
import copy
import threading
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from moetron.checkpoint import files
from moetron.checkpoint.rng_files import rng_tensors
from moetron.checkpoint.state import GlobalView, SmallFiles, WriterThread, write_dcp_files, write_then_publish
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
        """Start the save of `iteration` (after the previous one has finished); returns the path it will publish.
        Between steps only what must hold this step's state is done: this rank's RNG state and the trainer state
        are captured in memory and the staging copy of the tensors is started; every file is written later by the
        writer thread."""
        self.wait()
        run_dir = Path(run_dir)
        small = SmallFiles(rng_tensors(), copy.deepcopy(state), config_yaml)  # this step's, before it moves on
        with Site(f"the checkpoint save of iteration {iteration} (staging)"):
            tensors = view.state(optimizer)
            staging = self.stager().stage(tensors)  # a Future: the copy runs in the stager's thread
        del tensors  # views of the live weights: the staging thread holds them until its copy is done
        self._staging = staging
        args = (staging, run_dir, iteration, keep_last_n, small)
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
            self._stager = _GilFreeStager(options)
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

    def _finish(self, staging, run_dir: Path, iteration: int, keep_last_n: int, small: SmallFiles) -> None:
        """(the background thread) the files, the agreements, the publish; the outcome is kept for `wait`. At the
        loop's CPU priority: this thread runs Python (DCP's planning, torch.save's pickling) and so holds the GIL at
        times, and at a lowered priority (nice +10, tried) a busy host descheduled it while it held the GIL, the loop
        then waiting for both (benchmarks/async_save.py: time lost net of run-queue waits 0.53 s niced vs 0.26 s not,
        at load 13-20)."""
        try:
            self._write_then_publish(staging, run_dir, iteration, keep_last_n, small)
        except BaseException as err:  # noqa: BLE001 - raised in the main thread by wait()
            self._failure = err

    def _write_then_publish(self, staging, run_dir: Path, iteration: int, keep_last_n: int, small) -> None:
        """The synchronous save's phases (`write_then_publish`), each agreed over the writer's own gloo group; the
        tensors are the staged copy, once it is complete."""

        def write_tensors(tmp: Path) -> None:
            write_dcp_files(tmp, staging.result(), shared_files=self.env.is_main, group=self.group)

        thread = WriterThread(group=self.group, in_background=True)
        write_then_publish(self.env, run_dir, iteration, keep_last_n, small, write_tensors, thread)

    def close(self) -> None:
        """Wait for the write in flight without raising a failure of it over the error already on its way out."""
        try:
            self.wait()
        except (UserError, OSError, CheckpointException, RuntimeError):
            pass


class _GilFreeStateDictStager(StateDictStager):
    """DCP's `StateDictStager` (the copy into CPU buffers kept between saves) with the copy made with the GIL
    released. DCP copies each storage with `UntypedStorage.copy_`, which holds the GIL for the whole memcpy: the
    training loop, a Python thread, then stalls for every copy (measured: 0.3-0.6 s of GIL waits per 500 MB on the
    loop thread; py-spy --gil showed the stager's copy holding the GIL more than any other background frame).
    `Tensor.copy_` over byte views of the same storages releases it. The first save of a storage (allocation, and
    pinning on CUDA) stays DCP's own."""

    def _stage_untyped_storage(self, storage, non_blocking: bool = False):
        cached = self._cached_storage_mapping.get(storage)
        if cached is None or cached.size() != storage.size():
            return super()._stage_untyped_storage(storage, non_blocking=non_blocking)
        _bytes(cached).copy_(_bytes(storage), non_blocking=non_blocking)
        return cached


def _bytes(storage) -> torch.Tensor:
    """A uint8 tensor over all of `storage` (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


class _GilFreeStager(DefaultStager):
    """DCP's `DefaultStager` with the GIL-free copy above. Its copy thread keeps the loop's CPU priority (a lowered
    one was tried): the loop waits for the copy before its optimizer step (`before_update`), so a copy thread that a
    busy host starves holds the loop back."""

    def __init__(self, config: StagingOptions):
        super().__init__(config)
        self._state_dict_stager = _GilFreeStateDictStager(
            pin_memory=config.use_pinned_memory, share_memory=config.use_shared_memory
        )

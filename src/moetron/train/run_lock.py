"""One owner at a time for a run directory: a lock file naming the owner's host and pid, held while a run trains.

Two runs on the same `--save` would interleave their `metrics.jsonl`, prune and replace each other's checkpoints,
and call the other's newest one "the previous checkpoint". So rank 0 creates `RUN/.moetron.lock` before anything
in the run directory is written or deleted, and removes it when the run ends: normally, on an error, and on
SIGTERM (the training loop's graceful stop returns normally; outside the loop SIGTERM raises `SystemExit` here so
that the `finally` clauses run). A lock another process holds:

- same host, its pid still running: refused (the other run is alive);
- same host, its pid gone (a run killed with SIGKILL, a crashed node restarted): stale, taken over with a note;
- another host: refused, naming the host and pid and how to remove the lock if that run is really dead (this host
  cannot tell whether a process elsewhere is alive).

The file is created complete in one step (written under a temporary name, then hard-linked to its final name, which
fails when the name exists), so a reader never sees a half-written lock. It lies beside the checkpoints, never in
one, and is neither a checkpoint nor a log (`checkpoint.files.previous_run` does not see it).

    with run_directory_lock(cfg, env):    # every rank; rank 0 takes the lock, all ranks learn the outcome
        train
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import secrets
import socket
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from moetron.errors import UserError, sigterm_raises
from moetron.fileio import describe_os_error, publish_mode

LOCK_NAME = ".moetron.lock"
NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK}  # some network/FUSE filesystems


@dataclass(frozen=True)
class Owner:
    host: str
    pid: int
    started: str  # UTC, ISO 8601
    token: str  # tells this lock from a later one of the same pid (pids are reused)

    @classmethod
    def this_process(cls) -> Owner:
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        return cls(socket.gethostname(), os.getpid(), now, secrets.token_hex(8))

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host} (since {self.started})"


def read_owner(lock: Path) -> Owner | None:
    """The owner a lock file names; None when there is no lock file. A file that is not a lock: one line."""
    try:
        text = lock.read_text()
    except FileNotFoundError:
        return None
    try:
        record = json.loads(text)
        return Owner(str(record["host"]), int(record["pid"]), str(record["started"]), str(record["token"]))
    except (ValueError, KeyError, TypeError):
        raise UserError(
            f"{lock} is not a moetron run lock (it should hold the owner's host and pid); delete it if no run is "
            f"using {lock.parent}"
        ) from None


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


class RunLock:
    """The lock of one run directory, taken by `acquire` and given back by `release` (rank 0 only)."""

    def __init__(self, run_dir: Path, flag: str):
        self.run_dir, self.flag = run_dir, flag
        self.path = run_dir / LOCK_NAME
        self.owner = Owner.this_process()
        self.created: list[Path] = []  # directories made for the lock, removed again if the run leaves them empty
        self.notes: list[str] = []

    def acquire(self) -> None:
        self._make_run_dir()
        try:
            for _ in range(3):  # another process may create or take over the lock between our steps: look again
                if self._create():
                    return
                holder = read_owner(self.path)
                if holder is not None:
                    self._take_over_stale(holder)
            raise UserError(f"{self.flag} {self.run_dir}: could not take {self.path} (other runs keep taking it)")
        except BaseException:
            self._remove_created_dirs()
            raise

    def _make_run_dir(self) -> None:
        missing = [p for p in [self.run_dir, *self.run_dir.parents] if not p.exists()]
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UserError(f"cannot create {self.flag} {self.run_dir}: {describe_os_error(err)}") from None
        self.created = missing  # innermost first

    def _create(self) -> bool:
        """Publish our lock file under its name if no lock exists (True), else leave it (False)."""
        text = json.dumps(asdict(self.owner)) + "\n"
        tmp = self.run_dir / f"{LOCK_NAME}.{self.owner.pid}.{self.owner.token}"
        try:
            tmp.write_text(text)
            publish_mode(tmp)
            os.link(tmp, self.path)  # atomic, and fails when the name exists
            return True
        except FileExistsError:
            return False
        except OSError as err:
            if err.errno not in NO_HARD_LINKS:
                raise UserError(f"cannot write {self.path}: {describe_os_error(err, self.run_dir)}") from None
        finally:
            tmp.unlink(missing_ok=True)
        return self._create_in_place(text)

    def _create_in_place(self, text: str) -> bool:
        """Filesystems without hard links: create the name exclusively, then write (a reader may see it empty)."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            return False
        except OSError as err:
            raise UserError(f"cannot write {self.path}: {describe_os_error(err, self.run_dir)}") from None
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return True

    def _take_over_stale(self, holder: Owner) -> None:
        """Remove `holder`'s lock when it is stale, else raise the one-line refusal."""
        if holder.host != self.owner.host:
            raise UserError(
                f"{self.flag} {self.run_dir} is in use by another run: {holder.describe()} holds {self.path}; "
                f"give another {self.flag}, or, if that run is really dead, delete {self.path} and start again"
            )
        if pid_alive(holder.pid):
            raise UserError(
                f"{self.flag} {self.run_dir} is in use by another run: {holder.describe()} holds {self.path}; "
                f"wait for it to end or give another {self.flag} (if pid {holder.pid} is not a moetron run, delete "
                f"{self.path})"
            )
        parked = self.run_dir / f"{LOCK_NAME}.stale.{self.owner.token}"
        try:
            os.rename(self.path, parked)  # one taker wins; the others find no lock, or the winner's
        except FileNotFoundError:
            return
        if read_owner(parked) != holder:  # we moved a fresh lock taken meanwhile: put it back
            with contextlib.suppress(OSError):
                os.link(parked, self.path)
        else:
            self.notes.append(
                f"note: {self.path} was left by {holder.describe()}, which is no longer running; taking it over"
            )
        parked.unlink(missing_ok=True)

    def release(self) -> None:
        """Remove the lock if it is still ours, then the directories made for it if the run left them empty."""
        with contextlib.suppress(OSError, UserError):
            if read_owner(self.path) == self.owner:
                self.path.unlink()
        self._remove_created_dirs()

    def _remove_created_dirs(self) -> None:
        for directory in self.created:
            try:
                directory.rmdir()
            except OSError:  # not empty: the run wrote something there
                return


def terminate_through_finally() -> contextlib.AbstractContextManager[None]:
    """SIGTERM raises `SystemExit(143)` (the status a SIGTERM kill gives), so that the lock is released on the
    way out; the training loop's `StopSignal` replaces this handler while it runs (a graceful stop)."""
    return sigterm_raises(_exit_on_sigterm)


def _exit_on_sigterm(signum: int) -> None:
    raise SystemExit(128 + signum)


def try_to_take(lock: RunLock | None, recheck) -> str | None:
    """(rank 0) Take the lock and check the run directory again under it: the one-line reason not to go on."""
    if lock is None:
        return None
    try:
        lock.acquire()
    except UserError as err:
        return str(err)
    problems = recheck()  # another run may have finished there between validation and the lock
    if problems:
        lock.release()
        return problems[0]
    for note in lock.notes:
        print(note, flush=True)
    return None


@contextlib.contextmanager
def run_directory_lock(cfg, env) -> Iterator[None]:
    """Hold the lock of `cfg`'s run directory (if it has one) for the duration of the block, on every rank: rank 0
    takes it and says why not, the others learn the outcome, and every rank raises the same error."""
    from moetron.checkpoint.run_directory import run_directory_problems

    run_dir = cfg.run_dir()
    flag = "--save" if cfg.train.save else "--output-dir"
    lock = RunLock(Path(run_dir), flag) if run_dir and env.is_main else None
    refusal = env.broadcast_object(try_to_take(lock, lambda: run_directory_problems(cfg.train)))
    if refusal:
        raise UserError(refusal)
    try:
        with terminate_through_finally():
            yield
    finally:
        if lock is not None:
            lock.release()

"""Small file helpers shared by every writer: the atomic write, output-location checks, file modes, one-line
write errors.

    write_atomic(run_dir / "latest", "iter_0000010\n", durable=True)  # all or nothing, even after a power cut
    with atomic_writer(path, "wb") as f:                      # stream into a temporary, renamed into place at the end
        np.save(f, array)
    problem = output_dir_problem("--save", cfg.train.save)   # None, or the one-line reason and fix
    publish_mode(tmp_path)                                    # a directory staged under a temporary name
    with write_errors_named("--output-prefix data/corpus"):   # ENOSPC etc. -> UserError
        ...

`tempfile.mkstemp` creates files with mode 0600 whatever the umask, so a file published from a temporary
name is unreadable to the rest of a team on a shared cluster; `publish_mode` gives it the mode a plain
`open(path, "w")` would have (0666 & ~umask).
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from moetron.errors import UserError
from moetron.scoped_memo import ScopedMemo

# What an OSError means for the user, and what to do about it.
ERRNO_FIXES = {
    errno.ENOSPC: "the disk is full; free some space or write somewhere else",
    errno.EDQUOT: "the disk quota is exhausted; free some space or write somewhere else",
    errno.EROFS: "the filesystem is read-only; write somewhere else",
    errno.EACCES: "permission denied; write somewhere you may write",
    errno.EPERM: "permission denied; write somewhere you may write",
    errno.EISDIR: "a directory is in the way; remove it or choose another path",
    errno.ENOTDIR: "a file is in the way of a directory; remove it or choose another path",
    errno.ENAMETOOLONG: "a name in the path is longer than the filesystem allows (255 bytes on most); shorten it",
}


def current_umask() -> int:
    """The process umask (read by setting and restoring it: there is no getter)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def publish_mode(path: str | os.PathLike, mode: int = 0o666) -> None:
    """Give `path` the permissions a new file gets from `open()`: `mode & ~umask` (0644 under umask 022).

    Call it on a file made by `tempfile.mkstemp`/`NamedTemporaryFile` (always 0600) before renaming it to its
    final name; directories pass `mode=0o777`.
    """
    os.chmod(path, mode & ~current_umask())


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike, mode: str = "w", *, durable: bool = False) -> Iterator[IO]:
    """A file object writing to a temporary name beside `path` (`.NAME.XXXX.tmp`, unique per writer), renamed
    onto `path` when the block ends: a reader, or a crash at any moment, sees the old file or the whole new one.

    The published file gets the mode `open()` would give it (`publish_mode`). `durable=True` also fsyncs the
    file before the rename and the directory after it, so the new name survives a power cut (what a checkpoint's
    `latest` needs; a log that is rewritten can do without). An exception inside removes the temporary and leaves
    `path` as it was. `mode` is "w" (UTF-8 text) or "wb".
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            if durable:
                f.flush()
                os.fsync(f.fileno())
        publish_mode(tmp)  # mkstemp made it 0600
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    if durable:
        fsync_dir(path.parent)


def write_atomic(path: str | os.PathLike, data: str | bytes, *, durable: bool = False) -> None:
    """Publish `data` (text is written as UTF-8) as the file `path` all at once; see `atomic_writer`."""
    with atomic_writer(path, "wb" if isinstance(data, bytes) else "w", durable=durable) as f:
        f.write(data)


def fsync_file(path: str | os.PathLike) -> None:
    """Flush a written file's data to the disk."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory's entries (a rename or a new name in it) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def describe_os_error(err: OSError, directory: str | os.PathLike | None = None) -> str:
    """`reason: fix` for an OSError, e.g. 'No space left on device: the disk is full; free some space ...'.

    numpy reports a short write as a bare "N requested and M written" (no errno); with `directory` given, a
    filesystem with (almost) no space left is named as the cause.
    """
    text = err.strerror or str(err)
    fix = ERRNO_FIXES.get(err.errno or -1)
    if fix is None and directory is not None and _nearly_full(directory):
        return f"{text}: {ERRNO_FIXES[errno.ENOSPC]}"
    return f"{text}: {fix}" if fix else text


def _nearly_full(directory: str | os.PathLike, slack: int = 1 << 20) -> bool:
    try:
        stats = os.statvfs(_nearest_existing(Path(os.path.abspath(directory))))
    except OSError:
        return False
    return stats.f_bavail * stats.f_frsize < slack


@contextlib.contextmanager
def write_errors_named(what: str) -> Iterator[None]:
    """Turn an OSError raised inside into a one-line UserError: `cannot write {what}: {reason and fix}`."""
    try:
        yield
    except OSError as err:
        where = f" ({err.filename})" if err.filename else ""
        directory = Path(os.fsdecode(err.filename)).parent if err.filename else None
        raise UserError(f"cannot write {what}{where}: {describe_os_error(err, directory)}") from None


def _nearest_existing(path: Path) -> Path:
    current = path
    while not current.exists() and current != current.parent:
        current = current.parent
    return current


_DIRECTORY_ANSWERS = ScopedMemo()  # directory → `writable_dir_problem`'s answer
# Within the block, each directory's `writable_dir_problem` is asked of the filesystem once: `plan --search`
# validates tens of thousands of layouts of one config, whose output directories never change meanwhile.
directories_checked_once = _DIRECTORY_ANSWERS.scope


def writable_dir_problem(directory: str | os.PathLike) -> str | None:
    """Why files cannot be created in `directory` (it need not exist yet), or None."""
    return _DIRECTORY_ANSWERS.get(os.fspath(directory), lambda: _writable_dir_problem(directory))


def _writable_dir_problem(directory: str | os.PathLike) -> str | None:
    path = Path(os.path.abspath(os.path.expanduser(directory)))
    if path.exists() and not path.is_dir():
        return f"'{directory}' exists and is not a directory"
    existing = _nearest_existing(path)
    if not existing.is_dir():
        return f"'{existing}' is a file, so the directory '{directory}' cannot be created"
    if not os.access(existing, os.W_OK | os.X_OK):
        reason = "read-only filesystem" if _read_only_fs(existing) else "no write permission"
        verb = "is not writable" if existing == path else f"cannot be created: '{existing}' is not writable"
        return f"'{directory}' {verb} ({reason})"
    return None


def _read_only_fs(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def output_dir_problem(flag: str, directory: str | None) -> str | None:
    """A config problem naming `flag` when `directory` cannot hold output, else None (nothing is created)."""
    if not directory:
        return None
    try:
        problem = writable_dir_problem(directory)
    except OSError as err:  # a name too long for the filesystem, a symlink loop: the path cannot even be looked at
        return f"{flag} {directory}: {describe_os_error(err)}"
    if problem is None:
        return None
    return f"{flag} {directory}: {problem}; give a directory you can write to"


def output_file_problem(label: str, path: str | os.PathLike) -> str | None:
    """Why the file `path` cannot be written (its directory must exist), starting with `label` (the flag and the
    value the user gave, e.g. "--output-prefix 'data/corpus'"), or None."""
    try:
        return _output_file_problem(label, Path(path))
    except OSError as err:  # a name too long for the filesystem, a symlink loop: the path cannot even be looked at
        return f"{label}: {describe_os_error(err)}"


def _output_file_problem(label: str, path: Path) -> str | None:
    parent = path.parent
    if path.is_dir():
        return f"{label}: '{path}' is a directory; remove it or choose another output name"
    if not parent.exists():
        return f"{label}: directory '{parent}' does not exist; create it first"
    if not parent.is_dir():
        return f"{label}: '{parent}' is a file, not a directory; choose another output path"
    if not os.access(parent, os.W_OK | os.X_OK):
        reason = "read-only filesystem" if _read_only_fs(parent) else "no write permission"
        return f"{label}: directory '{parent}' is not writable ({reason}); write somewhere else"
    return None

"""User-facing errors: one readable line each, never a traceback.

Raise `UserError` for anything the user can fix (a bad flag, a missing file, a malformed input);
the CLI prints `error: <message>` and exits with status 2. `ConfigError` carries several problems
so that all of them are reported at once.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator


class UserError(Exception):
    """A problem the user can fix; the message names the file or flag, the value and the fix."""


class SaidByAnotherRank(UserError):
    """This rank stops for an error that another rank of the same collective step found and says: quiet, so the
    run prints one line (e.g. a checkpoint file whose checksum another rank verified)."""

    quiet = True
    exit_code = 2


class ConfigError(UserError):
    """Several configuration problems, reported together."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        if len(self.problems) == 1:  # one problem, one line
            super().__init__(self.problems[0])
            return
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} configuration problem(s):\n{lines}")


@contextlib.contextmanager
def sigterm_raises(handler: Callable[[int], None]) -> Iterator[None]:
    """While active, SIGTERM calls `handler(signum)` (which raises) in the main thread, so that the `finally`
    blocks and cleanups on the way out run — a SIGTERM's default action kills the process without them. Outside
    the main thread signals cannot be caught: then it does nothing. The previous handler comes back at exit."""
    try:
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: handler(signum))
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)

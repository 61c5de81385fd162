"""`moetron launch`: torchrun for moetron, whose SIGTERM ends a run cleanly (checkpoint saved, exit status 0).

    moetron launch --standalone --nproc-per-node 2 train --config my.yaml      # = torchrun ... -m moetron train ...

Every flag before the command is torchrun's own (`torch.distributed.run`, parsed by torchrun's parser); the command
and what follows are moetron's. The only difference is what a SIGTERM (or Ctrl-C) to the launcher does.

torchrun (torch 2.13, `torch/distributed/elastic`): its agent turns the signal into a `SignalException`, sends
the same signal to the workers, waits up to `--shutdown-timeout` (30 s) before SIGKILL, then re-raises it, so the
launcher exits 1 with a traceback, whatever the workers did — and a SLURM job or a Kubernetes pod that was
preempted looks failed although every rank saved its checkpoint and exited 0.

`moetron launch` keeps SIGTERM and SIGINT out of torchrun's handled signals (`--signals-to-handle`),
and on the first one forwards it to its workers (every rank agrees to stop after the same step and saves: see
`train/signals.py`); torchrun then sees its workers succeed and the launcher exits 0, with one line saying why.
A second signal is torchrun's own shutdown (the workers are stopped; exit status 128 + the signal).

Before torchrun starts, the launcher parses the command's flags and, for `train`, validates its config at the
launch's world size (`--nnodes` × `--nproc-per-node`): a mistake is the one `error:` line a single-process run
prints, exit status 2, no worker started (under plain torchrun every worker imports torch to find it, rank 0 says
it, and torchrun's report of the failed workers follows). A worker that fails with moetron's status 2 said its
error itself: the launcher adds nothing to it.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
from pathlib import Path

from moetron.errors import UserError

HELP = "Run a moetron command under torchrun; SIGTERM saves a checkpoint and exits 0 (torchrun's flags first)."
RAW_ARGUMENTS = True  # the flags are torchrun's: `moetron.cli` hands them over unparsed
FORWARDED = (signal.SIGTERM, signal.SIGINT)


EXAMPLE = "moetron launch --standalone --nproc-per-node 2 train --config my.yaml"


def usage() -> str:
    return "usage: moetron launch [torchrun flags] COMMAND [command flags]   (e.g. --nproc-per-node 2 train ...)"


def no_command() -> UserError:
    return UserError(f"moetron launch: give torchrun's flags, then a moetron command and its flags, e.g. `{EXAMPLE}`")


def worker_pids(parent: int) -> list[int]:
    """The moetron processes started by `parent` (torchrun starts each worker in a session of its own)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[1]) == parent and b"moetron" in cmdline:
            pids.append(int(stat.parent.name))
    return sorted(pids)


class ForwardStop:
    """While active: the first SIGTERM/SIGINT goes to the workers; a second one is torchrun's shutdown."""

    def __init__(self):
        self.received: str | None = None
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        name = signal.Signals(signum).name
        workers = worker_pids(os.getpid())
        if self.received is not None or not workers:  # nothing to ask, or asked already: torchrun stops them
            raise SignalException(f"moetron launch got {name}", sigval=signal.Signals(signum))
        self.received = name
        print(
            f"moetron launch: received {name}; the {len(workers)} worker(s) on this node finish their step, save a "
            f"checkpoint and exit (send it again to stop them at once)",
            file=sys.stderr,
            flush=True,
        )
        for pid in workers:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    def __enter__(self) -> ForwardStop:
        for sig in FORWARDED:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def torchrun_args(argv: list[str]):
    """torchrun's parsed flags with `-m moetron COMMAND ...` as the entry point."""
    from moetron.cli import COMMANDS

    args = torchrun_parser().parse_args(argv)  # torchrun's flags and defaults (PET_* variables); errors: one line
    check_nproc_per_node(args.nproc_per_node)
    if args.module or args.no_python or args.training_script not in COMMANDS or args.training_script == "launch":
        choices = ", ".join(c for c in COMMANDS if c != "launch")
        raise UserError(
            f"moetron launch: {args.training_script!r} is not a moetron command; give torchrun's flags, then one "
            f"of {choices} and its flags (no -m / --no-python: the entry point is moetron)"
        )
    # torchrun's agent must leave SIGTERM / SIGINT to `ForwardStop` (`--signals-to-handle`, default all four)
    handled = [name.strip() for name in args.signals_to_handle.split(",") if name.strip()]
    args.signals_to_handle = ",".join(n for n in handled if n not in {s.name for s in FORWARDED}) or "SIGHUP"
    args.training_script_args = [args.training_script, *args.training_script_args]
    args.training_script, args.module = "moetron", True
    return args


LAUNCH_MARK = "MOETRON_LAUNCH"


def launch_world_size(args) -> int | None:
    """How many workers the launch starts in all, or None when elastic (`--nnodes 1:4`: known only at rendezvous)."""
    from torch.distributed.run import determine_local_world_size, parse_min_max_nnodes

    min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
    if min_nodes != max_nodes:
        return None
    return max_nodes * determine_local_world_size(args.nproc_per_node)


def check_before_launch(args) -> None:
    """Parse the command's flags here (argparse's usage and one error line, exit 2) and run the command's own
    `check_before_launch(parsed, world_size)` where it has one (`train`: every config problem at once)."""
    from moetron.cli import _module_name, command_parser

    command, *flags = args.training_script_args
    module = importlib.import_module(_module_name(command))
    parsed = command_parser(command, module).parse_args(flags)
    check = getattr(module, "check_before_launch", None)
    world_size = launch_world_size(args)
    if check is not None and world_size is not None:
        check(parsed, world_size)


def check_nproc_per_node(value: str) -> None:
    """Checked before torchrun starts: it reads the flag later (a traceback for `abc`, an AssertionError of its
    agent for 0)."""
    from torch.distributed.run import determine_local_world_size

    try:
        count = determine_local_world_size(value)
    except ValueError as err:  # not a number, or a device kind this machine lacks
        why = "not a number" if str(err).startswith("Unsupported") else str(err).rstrip(".")
        raise UserError(
            f"--nproc-per-node {value}: {why}; give a number of workers per node (1 or more), or cpu, gpu or auto"
        ) from None
    if count < 1:
        raise UserError(f"--nproc-per-node {value}: a node runs at least one worker; give 1 or more (e.g. 2)")


def torchrun_parser():
    """torchrun's own parser, whose errors (a missing command, an unknown flag) are one `error:` line, not its usage."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "moetron launch"
    parser.error = _parser_error
    return parser


def _parser_error(message: str):
    if "required: training_script" in message:
        raise no_command()
    raise UserError(f"moetron launch: {message} (torchrun's flags come first, then a moetron command: `{EXAMPLE}`)")


def run(argv: list[str]) -> int:
    if not argv:
        raise no_command()
    if argv[0] in ("-h", "--help"):
        print(usage() + "\n\n" + __doc__.split("\n\n", 1)[1])
        torchrun_parser().print_help()
        return 0
    args = torchrun_args(argv)
    check_before_launch(args)
    # the workers' errors say nothing of plain torchrun (`moetron.cli`), and they stop with a checkpoint if this
    # process dies without a word (SIGKILL: nothing forwarded; `train/signals.py`, `stop_with_launcher`)
    os.environ[LAUNCH_MARK] = str(os.getpid())
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    with ForwardStop() as stop:
        try:
            torchrun.run(args)
        except SignalException as err:
            when = "again" if stop.received else "before any worker was running"
            print(f"moetron launch: received {err.sigval.name} {when}: stopped the workers", file=sys.stderr)
            return 128 + int(err.sigval)
        except ChildFailedError as err:
            rank, failure = err.get_first_failure()
            raise worker_failed(rank, failure.exitcode, stop.received) from None
    return 0


USER_ERROR_STATUS = 2  # `moetron.cli`'s exit status for a UserError, which the failing worker has printed


class LaunchFailed(UserError):
    """A worker failed. The launcher exits with the worker's status (128 + the signal that stopped it); `quiet`
    where the worker's own `error:` line says it all."""

    def __init__(self, message: str, exit_code: int, quiet: bool = False):
        super().__init__(message)
        self.exit_code, self.quiet = exit_code, quiet


def worker_failed(rank: int, exitcode: int, received: str | None) -> LaunchFailed:
    """What became of the first worker that failed: an error of its own (printed by the worker, above), or a
    signal that stopped it before it could say anything — the one `ForwardStop` passed on while the workers were
    still starting (before they handle it: nothing to save yet), or one from elsewhere (the OOM killer's SIGKILL)."""
    if exitcode < 0:
        name = signal.Signals(-exitcode).name if -exitcode in signal.valid_signals() else f"signal {-exitcode}"
        why = f"worker rank {rank} was stopped by {name} before it printed an error"
        if received == name:
            why = f"worker rank {rank} was stopped by the {name} passed on to it while it was still starting"
            why += " (no checkpoint to save yet)"
        return LaunchFailed(f"moetron launch: {why}", 128 - exitcode)
    after = f" after {received} (an error of its own, if any, is above)" if received else " (its error is above)"
    said = exitcode == USER_ERROR_STATUS and received is None
    message = f"moetron launch: worker rank {rank} exited with status {exitcode}{after}"
    return LaunchFailed(message, exitcode or 1, quiet=said)

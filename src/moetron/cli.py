"""The `moetron` command line: one subcommand per module under `moetron.commands`.

Each command module defines `HELP` (one line), `add_arguments(parser)` and `run(args) -> int`.
Modules are imported only when their command runs, so `moetron --help` stays instant and a
broken optional dependency of one command never breaks another. Importing this module does not import torch:
`main()` sets the CPU allocator's defaults (`cpu_allocator_defaults`) before any command imports it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

from moetron import __version__
from moetron.errors import UserError
from moetron.progress import on_rank_zero

COMMANDS: dict[str, str] = {
    "quickstart": "Build a corpus, tokenizer and data, train a small MoE GPT, evaluate and generate.",
    "preprocess": "Tokenize JSONL/text into Megatron-compatible .bin/.idx files.",
    "train-tokenizer": "Train a byte-level BPE tokenizer (vocab.json + merges.txt + tokenizer.json).",
    "inspect": "Describe a .bin/.idx dataset (dtype, documents, tokens, first document), or a checkpoint's integrity.",
    "train": "Train a GPT / MoE GPT (single process or under torchrun).",
    "launch": "torchrun for moetron (its flags, then a command): SIGTERM saves a checkpoint and exits 0.",
    "eval": "Validation loss, perplexity and the routing report of a checkpoint.",
    "generate": "Sample text from a checkpoint with a KV cache.",
    "plan": "Parameters, FLOPs, per-GPU memory and a fits/doesn't-fit verdict, without running.",
    "dry-run": "The real training step on fake GPUs on a CPU: measured memory, host reads, collectives, defects.",
    "convert-checkpoint": "Convert a moetron 0.1 checkpoint (format 1) to the current checkpoint format.",
    "export": "Export a checkpoint as a Hugging Face model (native transformers class, or trust_remote_code).",
    "import": "Import a Hugging Face or Megatron-DeepSpeed checkpoint as a moetron run.",
    "upcycle": "Turn a dense checkpoint into a MoE one whose experts start as copies of the dense MLP.",
    "eval-harness": "Run lm-evaluation-harness tasks on a checkpoint (also under torchrun with experts spread).",
}
MODULES = {"import": "import_"}  # `import` is a Python keyword: its module is commands/import_.py


def _module_name(command: str) -> str:
    return "moetron.commands." + MODULES.get(command, command.replace("-", "_"))


def _top_level_parser() -> argparse.ArgumentParser:
    listing = "\n".join(f"  {name:<16} {text}" for name, text in COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog="moetron",
        description="Train Mixture-of-Experts GPT models.",
        epilog=f"commands:\n{listing}\n\nRun `moetron COMMAND --help` for a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"moetron {__version__}")
    parser.add_argument("command", choices=list(COMMANDS), metavar="COMMAND", help="one of the commands below")
    return parser


GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd")  # NVIDIA's driver, AMD's (ROCm)


def cpu_allocator_defaults(environ: dict | None = None, torch_imported: bool | None = None) -> bool:
    """On a machine without a GPU, give large CPU tensors transparent huge pages: PyTorch's
    `THP_MEM_ALLOC_ENABLE=1` (allocations of 2 MiB and more are 2 MiB-aligned and `madvise(MADV_HUGEPAGE)`d).

    Why: a CPU training step allocates its large buffers afresh (activations, the embedding gradient); with 4 KiB
    pages the kernel faults every page in again each step, a third of a small model's CPU time
    (benchmarks/e2e.py). Only where it can act: before torch is imported (the allocator reads the variable
    once), when the user has not set it (`THP_MEM_ALLOC_ENABLE=0` turns it off), and with no GPU driver
    present or `CUDA_VISIBLE_DEVICES` empty (a GPU run keeps PyTorch's default). Returns whether it set it.
    The kernel must allow huge pages (`/sys/kernel/mm/transparent_hugepage/enabled`: always or madvise).
    """
    return _set_on_a_cpu_before_torch(environ, torch_imported, {"THP_MEM_ALLOC_ENABLE": "1"})


def cpu_thread_defaults(environ: dict | None = None, torch_imported: bool | None = None) -> bool:
    """On a machine without a GPU, let idle OpenMP threads sleep: `OMP_WAIT_POLICY=PASSIVE`.

    Why: by default OpenMP's threads spin between parallel regions; a single-process `train` / `eval` / `generate` of
    a small model runs thousands of small ops, and on a busy machine each spinning thread holds a core the others
    wait for (a 64-wide matmul loop took 184 s of wall clock with the default against 1-3 s passive at load 26 on
    2 cores, benchmarks/RESULTS.md). torchrun avoids it by setting one thread per process; here torch keeps its
    thread count. Only before torch is imported (the OpenMP runtime reads it once), when the user has set neither
    `OMP_WAIT_POLICY` nor `OMP_NUM_THREADS` (their choice wins), and with no GPU present. Returns whether it set it.
    """
    return _set_on_a_cpu_before_torch(
        environ, torch_imported, {"OMP_WAIT_POLICY": "PASSIVE"}, user_choices=("OMP_NUM_THREADS",)
    )


def _set_on_a_cpu_before_torch(
    environ: dict | None, torch_imported: bool | None, values: dict[str, str], user_choices: tuple[str, ...] = ()
) -> bool:
    """Set `values` in the environment unless torch is already imported (its runtime read them once), the user set
    any of them or of `user_choices` (their choice wins), or a GPU is present and visible. Returns whether it set."""
    environ = os.environ if environ is None else environ
    torch_imported = "torch" in sys.modules if torch_imported is None else torch_imported
    if torch_imported or any(name in environ for name in (*values, *user_choices)):
        return False
    hidden = environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1")
    if not hidden and any(os.path.exists(node) for node in GPU_DEVICE_NODES):
        return False
    environ.update(values)
    return True


def report_user_error(err: UserError) -> int:
    """Print `error: <message>` once and return the exit status (2, or the error's own `exit_code`).

    Under torchrun every rank hits the same config error before the process group exists, so rank 0 says it; after
    that an error may be one rank's alone (rank 1's corrupt RNG file): `train/failures.py` marks those `every_rank`,
    said by the rank they happened on (`error: rank 1: …`), and `quiet` where another rank said the same message
    or the ranks a recorded failure stopped."""
    if not (on_rank_zero() or getattr(err, "every_rank", False) or getattr(err, "quiet", False)):
        if "TORCHELASTIC_RUN_ID" in os.environ:
            time.sleep(STARTUP_ERROR_WAIT_S)  # torchrun stops this rank here when rank 0 failed the same way
            print(f"error: rank {os.environ.get('RANK')}: {err}", file=sys.stderr)  # rank 0 did not fail: say it
        return getattr(err, "exit_code", 2)
    if (on_rank_zero() or getattr(err, "every_rank", False)) and not getattr(err, "quiet", False):
        print(f"error: {err}", file=sys.stderr)
        if not getattr(err, "every_rank", False) and _under_plain_torchrun():  # a startup error: every rank's
            print(PLAIN_TORCHRUN_NOTE, file=sys.stderr)
    return getattr(err, "exit_code", 2)


# A torchrun worker other than rank 0 with a startup error waits this long before exiting: exiting first let
# torchrun stop rank 0 before it printed the error (a plain `torchrun` run with a config error showed only
# torchrun's report, no `error:` line). Rank 0's exit makes torchrun stop the waiting ranks; a rank still running
# after the wait had an error rank 0 did not (a file missing on its node only) and says it itself.
STARTUP_ERROR_WAIT_S = 30.0


def command_parser(command: str, module) -> argparse.ArgumentParser:
    """The command's own parser. Under torchrun only rank 0 prints its usage and error: every rank parses the same
    flags and exits 2, and N copies of one mistake would bury it."""
    parser = argparse.ArgumentParser(prog=f"moetron {command}", description=COMMANDS[command])
    module.add_arguments(parser)
    if not on_rank_zero():
        parser.error = lambda message: sys.exit(2)
    return parser


PLAIN_TORCHRUN_NOTE = (
    "(torchrun's report of the failed workers follows; `moetron launch`, its drop-in, checks the config before "
    "starting any worker and stops at the line above)"
)


def _under_plain_torchrun() -> bool:
    """A torchrun worker whose launcher is torchrun itself, not `moetron launch` (which marks its workers)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "MOETRON_LAUNCH" not in os.environ


def main(argv: list[str] | None = None, **options) -> int:
    """Run the command `argv` names; `options` go to that command's `run` (`plan --measure`'s worker hands `train` an
    `on_step`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    top = _top_level_parser()
    if not argv or argv[0] in ("-h", "--help"):
        top.print_help()
        return 0
    if argv[0] == "--version":
        print(f"moetron {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        top.parse_args([command])  # prints argparse's own "invalid choice" message and exits 2
    cpu_allocator_defaults()  # before the command's module imports torch
    cpu_thread_defaults()
    module = importlib.import_module(_module_name(command))
    if getattr(module, "RAW_ARGUMENTS", False):  # `launch`: torchrun's flags, parsed by torchrun
        args = rest
    else:
        args = command_parser(command, module).parse_args(rest)
    try:
        return int(module.run(args, **options) or 0)
    except UserError as err:
        return report_user_error(err)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `moetron inspect ... | head`: the reader left; silence the flush at exit as well.
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        return 0

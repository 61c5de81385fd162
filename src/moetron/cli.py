"""The `moetron` command line: one subcommand per module under `moetron.commands`.

Each command module defines `HELP` (one line), `add_arguments(parser)` and `run(args) -> int`.
Modules are imported only when their command runs, so `moetron --help` stays instant and a
broken optional dependency of one command never breaks another.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from moetron import __version__
from moetron.errors import UserError

COMMANDS: dict[str, str] = {
    "quickstart": "Build a corpus, tokenizer and data, train a small MoE GPT, evaluate and generate.",
    "preprocess": "Tokenize JSONL/text into Megatron-compatible .bin/.idx files.",
    "train-tokenizer": "Train a byte-level BPE tokenizer (vocab.json + merges.txt + tokenizer.json).",
    "inspect": "Describe a .bin/.idx dataset: dtype, documents, tokens, sizes, first document.",
    "train": "Train a GPT / MoE GPT (single process or under torchrun).",
    "launch": "torchrun for moetron (its flags, then a command): SIGTERM saves a checkpoint and exits 0.",
    "eval": "Validation loss, perplexity and the routing report of a checkpoint.",
    "generate": "Sample text from a checkpoint with a KV cache.",
    "plan": "Parameters, FLOPs, per-GPU memory and a fits/doesn't-fit verdict, without running.",
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


def _is_rank_zero() -> bool:
    """True outside torchrun and on its global rank 0."""
    return os.environ.get("RANK", "0") in ("", "0")


def report_user_error(err: UserError) -> int:
    """Print `error: <message>` once and return the exit status (2, or the error's own `exit_code`).

    Under torchrun every rank hits the same config error, so rank 0 says it; a failure of one rank (`every_rank`,
    see `train/failures.py`) is said where it happened, and the ranks it stopped (`quiet`) say nothing."""
    if (_is_rank_zero() or getattr(err, "every_rank", False)) and not getattr(err, "quiet", False):
        print(f"error: {err}", file=sys.stderr)
    return getattr(err, "exit_code", 2)


def main(argv: list[str] | None = None) -> int:
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
    module = importlib.import_module(_module_name(command))
    if getattr(module, "RAW_ARGUMENTS", False):  # `launch`: torchrun's flags, parsed by torchrun
        args = rest
    else:
        parser = argparse.ArgumentParser(prog=f"moetron {command}", description=COMMANDS[command])
        module.add_arguments(parser)
        args = parser.parse_args(rest)
    try:
        return int(module.run(args) or 0)
    except UserError as err:
        return report_user_error(err)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `moetron inspect ... | head`: the reader left; silence the flush at exit as well.
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        return 0

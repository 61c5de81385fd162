"""`moetron convert-checkpoint`: rewrite a moetron 0.1 checkpoint (format 1) in today's format.

    moetron convert-checkpoint --load runs/old --save runs/old-v2
    moetron train --config runs/old/config.yaml --load runs/old-v2 --save runs/old-v2   # continues exactly

Weights, optimizer state, RNG files, the trainer state (iteration, data position, schedule) and the config
are carried over; the fused attention and SwiGLU tensors are re-laid out (see moetron/checkpoint/legacy.py).
"""

from __future__ import annotations

import argparse

HELP = "Convert a moetron 0.1 checkpoint (format 1) to the current checkpoint format."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--load", required=True, help="the 0.1 run directory (its latest checkpoint) or an iter_* dir")
    parser.add_argument("--save", required=True, help="a new (or empty) run directory for the converted checkpoint")


def run(args: argparse.Namespace) -> int:
    from moetron.checkpoint.legacy import convert

    path = convert(args.load, args.save)
    print(f"wrote {path} (format 2); continue with --load {args.save}")
    return 0

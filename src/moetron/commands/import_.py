"""`moetron import`: a Hugging Face model or a Megatron-DeepSpeed checkpoint → a moetron run directory.

    moetron import --hf hf/mixtral --save runs/mixtral
    moetron train --config runs/mixtral/config.yaml --load runs/mixtral --finetune --data-path data/x_text_document
    moetron import --megatron-deepspeed mds/checkpoint --save runs/continued      # weights + optimizer + progress
    moetron train --config runs/continued/config.yaml --load runs/continued --save runs/continued

(The module is `import_` because `import` is a Python keyword; `cli.py` maps the command to it.)
"""

from __future__ import annotations

import argparse
import sys

HELP = "Import a Hugging Face or Megatron-DeepSpeed checkpoint as a moetron run."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf", metavar="DIR", help="a Hugging Face model directory (config.json + safetensors)")
    source.add_argument(
        "--megatron-deepspeed", metavar="DIR", help="a Megatron-DeepSpeed --save directory or one global_step<N>"
    )
    parser.add_argument("--save", required=True, help="a new (or empty) run directory for the moetron checkpoint")
    parser.add_argument(
        "--seq-length", type=int, help="training --seq-length to write (HF import; default: min(4096, positions))"
    )
    parser.add_argument(
        "--qkv-layout",
        choices=["thirds", "per-head"],
        default="thirds",
        help="Megatron-DeepSpeed's fused QKV rows: [Q|K|V] thirds (since PR #441, Dec 2024) or per head (before)",
    )
    parser.add_argument("--no-optim", action="store_true", help="Megatron-DeepSpeed: import the weights only")
    parser.add_argument(
        "--rope-convert",
        choices=["keep", "standard"],
        default="keep",
        help="Megatron-DeepSpeed after PR #441 rotated q/k by cos(m*theta): keep that exactly (rotary_compat, the "
        "default) or convert to standard RoPE (the model then needs fine-tuning)",
    )
    parser.add_argument(
        "--allow-pickle",
        action="store_true",
        help="load .pt files with a full unpickle (runs code; trusted files only) when weights_only refuses them",
    )


def run(args: argparse.Namespace) -> int:
    if args.hf:
        from moetron.interchange.hf_import import import_hf

        result = import_hf(args.hf, args.save, args.seq_length)
        print(f"imported {result.hf_class} into {result.path}")
    else:
        from moetron.interchange.megatron_deepspeed import import_megatron_deepspeed

        result = import_megatron_deepspeed(
            args.megatron_deepspeed,
            args.save,
            args.qkv_layout,
            no_optim=args.no_optim,
            allow_pickle=args.allow_pickle,
            rope_convert=args.rope_convert,
        )
        what = "weights and optimizer state" if result.with_optimizer else "weights"
        print(f"imported {result.source} (iteration {result.iteration}, {what}) into {result.path}")
    warnings = getattr(result, "warnings", [])
    for note in result.notes[1:]:
        if note not in warnings:
            print(f"note: {note}")
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    from moetron.interchange.next_command import train_command_lines

    resume = not args.hf and result.with_optimizer  # a Megatron-DeepSpeed run with its optimizer state continues
    print("\n".join(train_command_lines(args.save, resume, getattr(result, "iteration", 0))))
    return 0

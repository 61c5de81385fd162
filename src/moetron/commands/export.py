"""`moetron export`: a checkpoint → a Hugging Face model directory.

    moetron export --load runs/moe --output hf/moe                     # native class when one fits, else remote code
    moetron export --load runs/moe --output hf/moe --dtype bf16 --arch mixtral   # insist on a class (one-line error)

Arguments and printing only; the work is `moetron.interchange.hf_export.export_hf`.
"""

from __future__ import annotations

import argparse
import re

from moetron.commands.tokenizer_flags import add_tokenizer_arguments, tokenizer_overrides
from moetron.errors import UserError

HELP = "Export a checkpoint as a Hugging Face model (native transformers class, or trust_remote_code)."


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*", text.upper())
    if not match:
        raise UserError(f"--max-shard-size {text!r} is not a size like 5GB, 500MB or 1000000")
    size = int(float(match.group(1)) * 1024 ** "BKMGT".index(match.group(2) or "B"))
    if size < 1:  # 0 would put every tensor in a shard of its own, which is not what was meant
        raise UserError(f"--max-shard-size {text!r} is less than one byte; give a size like 5GB, 500MB or 1000000")
    return size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from moetron.interchange.hf_architectures import architectures

    parser.add_argument("--load", required=True, help="a run directory (its latest checkpoint) or an iter_* directory")
    parser.add_argument("--output", required=True, help="a new (or empty) directory for the Hugging Face model")
    parser.add_argument("--format", choices=["hf"], default="hf", help="the output format (default hf)")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="weights dtype (fp32)")
    names = ", ".join(a.name for a in architectures())
    parser.add_argument("--arch", help=f"insist on this transformers class ({names}); default: the first that fits")
    parser.add_argument("--remote-code", action="store_true", help="export as trust_remote_code even if a class fits")
    parser.add_argument(
        "--dropless", action="store_true", help="export the dropless model (transformers' MoE classes never drop)"
    )
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (default 5GB)")
    parser.add_argument("--no-tokenizer", action="store_true", help="write no tokenizer files")
    add_tokenizer_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from moetron.interchange.hf_export import export_hf

    result = export_hf(
        args.load,
        args.output,
        dtype=args.dtype,
        arch=args.arch,
        remote=args.remote_code,
        dropless=args.dropless,
        tokenizer=not args.no_tokenizer,
        max_shard_bytes=parse_size(args.max_shard_size),
        tokenizer_overrides=tokenizer_overrides(args),
    )
    if result.remote_code:
        print(f"exported with remote code (AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)): no "
              f"transformers class expresses this model ({why_not_native(result.why_remote)})")  # fmt: skip
    print(f"wrote {result.output}: {result.hf_class}, {result.num_tensors} tensors in {result.num_shards} shard(s)")
    return 0


def why_not_native(why: list[str]) -> str:
    """The first reason the closest class does not fit, and how many more there are (`--arch CLASS` names one)."""
    closest, _, problems = why[0].partition(": ")
    reasons = problems.split("; ") if problems else []
    if len(reasons) <= 1:
        return why[0]
    return f"{closest}: {reasons[0]}, and {len(reasons) - 1} more difference(s)"

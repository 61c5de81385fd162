"""`moetron generate`: sample text from a checkpoint with the model's KV cache (arguments and printing; the
sampling itself is `moetron.eval.generate`, the same concept one level down).

    moetron generate --load runs/quickstart --prompt "Return the" --max-new-tokens 60
    moetron generate --load runs/quickstart --prompt-file prompts.txt --temperature 0      # greedy, one per line

Sampling: greedy (`--temperature 0`), temperature, top-k, top-p (nucleus); generation stops at the
end-of-document token or after `--max-new-tokens`. MoE layers route dropless unless `--capacity-factor`
is given. The same `--seed` gives the same text. With `--prompt-file`, prompts of equal token length share
their forward passes (a batch, no padding); each prompt's text is the same as when given alone.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from moetron.commands.tokenizer_flags import add_tokenizer_arguments, tokenizer_overrides
from moetron.errors import ConfigError, UserError

HELP = "Sample text from a checkpoint with a KV cache."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--load", required=True, help="a run directory (its latest checkpoint) or an iter_* directory")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the text to continue")
    prompt.add_argument(
        "--prompt-file",
        type=Path,
        help="a text file of prompts, one per line (blank lines skipped); prompts of the same token length are "
        "decoded together as one batch (one at a time with --capacity-factor), each giving what it gives alone",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=64,
        help="tokens to generate per prompt (default 64; lowered, with a note, to what the model's positions leave)",
    )
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy; higher = more random (default 1)")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0 = off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="sample within this probability mass (1 = off)")
    parser.add_argument(
        "--capacity-factor", type=float, help="route MoE layers with this capacity factor (default: dropless)"
    )
    parser.add_argument("--seed", type=int, default=1234, help="random seed for sampling (default 1234)")
    add_tokenizer_arguments(parser)


def read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt is not None:
        if not args.prompt:
            raise UserError("--prompt is empty; give some text to continue")
        return [args.prompt]
    path = args.prompt_file
    if not path.is_file():
        raise UserError(f"--prompt-file {path}: no such file")
    try:
        prompts = [line.rstrip("\r\n") for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except UnicodeDecodeError as err:
        raise UserError(f"--prompt-file {path} is not UTF-8 text (byte {err.start}); save it as UTF-8") from None
    if not prompts:
        raise UserError(f"--prompt-file {path} holds no prompt (one prompt per non-blank line)")
    return prompts


def run(args: argparse.Namespace) -> int:
    from moetron.eval.generate import GenerationOptions, generate_texts, load_model, load_tokenizer

    options = GenerationOptions(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        capacity_factor=args.capacity_factor,
    )
    problems = options.problems()
    if problems:
        raise ConfigError(problems)
    prompts = read_prompts(args)
    model, cfg, _ = load_model(args.load, tokenizer_overrides=tokenizer_overrides(args))
    tokenizer = load_tokenizer(cfg)
    for i, (prompt, text) in enumerate(zip(prompts, generate_texts(model, tokenizer, prompts, options), strict=True)):
        if len(prompts) > 1:
            print(f"--- prompt {i + 1}")
        print(prompt + text, flush=True)
    return 0

"""The `moetron train` command printed after an import or an upcycle: one that runs as printed once its placeholders
(upper-case words, each explained on the lines below it) are replaced.

    lines = train_command_lines("runs/mixtral", resume=False)
    # train with: moetron train --config runs/mixtral/config.yaml --load runs/mixtral --finetune
    #     --save runs/mixtral-finetuned --train-iters ITERATIONS --data-path DATA_PREFIX
    #   ITERATIONS: how many iterations to fine-tune
    #   DATA_PREFIX: a `moetron preprocess` output prefix (its .bin and .idx without the suffix)

What the run directory's config.yaml lacks on this machine becomes a placeholder: the data (an import names none,
or the recording machine's path) and the tokenizer files. A resume keeps the checkpoint's layout, so a run that
needs several processes (a Megatron-DeepSpeed EP 2 run) is printed under `torchrun --nproc-per-node N`.
"""

from __future__ import annotations

import math
import os

from moetron.config_cli import is_number, load_config
from moetron.data.config import TOKENIZER_FILES

PLACEHOLDERS = {
    "ITERATIONS": "how many iterations to fine-tune",
    "LAST_ITERATION": "the iteration to train to (the run's own schedule ends where its checkpoint is)",
    "DATA_PREFIX": "a `moetron preprocess` output prefix (its .bin and .idx without the suffix)",
    "VOCAB_JSON": "the GPT-2 vocab.json the model was trained with",
    "MERGES_TXT": "the GPT-2 merges.txt the model was trained with",
    "TOKENIZER_JSON": "the tokenizer.json (or its directory) the model was trained with",
}
TOKENIZER_PLACEHOLDERS = {"vocab_file": "VOCAB_JSON", "merge_file": "MERGES_TXT", "tokenizer_model": "TOKENIZER_JSON"}


def train_command_lines(run_dir: str, resume: bool, iteration: int = 0) -> list[str]:
    """`train with: …` and one line per placeholder it holds. `resume`: continue the run (optimizer state and
    progress were imported, up to `iteration`) into the same directory; else fine-tune its weights into
    RUN_DIR-finetuned."""
    cfg, _ = load_config(os.path.join(run_dir, "config.yaml"), {})
    p = cfg.parallel
    processes = math.lcm(p.moe_expert_parallel_size, p.tensor_model_parallel_size * p.pipeline_model_parallel_size
                         * p.context_parallel_size)  # fmt: skip
    launcher = f"torchrun --nproc-per-node {processes} -m moetron train" if processes > 1 else "moetron train"
    flags = [f"--config {run_dir}/config.yaml", f"--load {run_dir}"]
    if resume:
        flags.append(f"--save {run_dir}")
        if cfg.train.train_iters is not None and cfg.train.train_iters <= iteration:
            flags.append("--train-iters LAST_ITERATION")
    else:
        flags += ["--finetune", f"--save {run_dir.rstrip('/')}-finetuned", "--train-iters ITERATIONS"]
    prefixes = [path for path in cfg.data.data_path if not is_number(path)]
    if not prefixes or not all(os.path.exists(f"{prefix}.bin") for prefix in prefixes):
        flags.append("--data-path DATA_PREFIX")
    for flag, name in TOKENIZER_FILES.get(cfg.data.tokenizer_type, ()):
        path = getattr(cfg.data, name)
        if not path or not os.path.exists(path):
            flags.append(f"{flag} {TOKENIZER_PLACEHOLDERS[name]}")
    command = f"{launcher} {' '.join(flags)}"
    notes = [f"  {word}: {meaning}" for word, meaning in PLACEHOLDERS.items() if f" {word}" in command]
    return [f"train with: {command}", *notes]

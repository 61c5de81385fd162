"""Data configuration: Megatron's data flags (`--data-path`, `--split`, `--data-cache-path`, ...) as a dataclass.
The data section of the run's configuration (`moetron/config.py` is the whole tree: one concept, two levels).

`data_path` is either one prefix (split into train/valid/test by `split`) or a blend `W1 P1 W2 P2 ...`;
`train_data_path` / `valid_data_path` / `test_data_path` name separate (optionally blended) sets instead, and
then `split` only enters the index-cache description (as in Megatron). A prefix is a path without the
`.bin` / `.idx` extension, e.g. `data/owt_text_document`.

`problems()` lists everything wrong at once, each naming the flag, the value and the fix.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

SPLIT_FLAGS = {"train": "--train-data-path", "valid": "--valid-data-path", "test": "--test-data-path"}
# The files each --tokenizer-type reads (`data/tokenizer.py`'s build_tokenizer), as (flag, DataConfig field): only
# these are checked, so a file flag a recipe sets for another tokenizer type never fails a run that ignores it.
TOKENIZER_FILES: dict[str, tuple[tuple[str, str], ...]] = {
    "GPT2BPETokenizer": (("--vocab-file", "vocab_file"), ("--merge-file", "merge_file")),
    "HFTokenizer": (("--tokenizer-model", "tokenizer_model"),),
}
# an unknown type (refused when the tokenizer is built) is checked for every file it might mean
ANY_TOKENIZER_FILES = tuple(dict.fromkeys(f for files in TOKENIZER_FILES.values() for f in files))


@dataclass
class DataConfig:
    data_path: list[str] = field(default_factory=list)  # one prefix, or "W1 P1 W2 P2 ..." (a blend)
    split: str = "969, 30, 1"  # train/valid/test proportions of the documents, comma or slash separated
    train_data_path: list[str] = field(default_factory=list)  # separate sets; exclusive with data_path
    valid_data_path: list[str] = field(default_factory=list)
    test_data_path: list[str] = field(default_factory=list)
    data_cache_path: str | None = None  # where index caches go; None: `index-cache/` beside the data
    tokenizer_type: str = "GPT2BPETokenizer"
    vocab_file: str | None = None  # GPT-2 vocab.json (GPT2BPETokenizer); sizes the vocabulary
    merge_file: str | None = None  # GPT-2 merges.txt (GPT2BPETokenizer)
    tokenizer_model: str | None = None  # HF tokenizer.json or its directory (HFTokenizer)
    mmap_warmup: bool = False  # pre-read the .bin/.idx files once (Megatron's --mmap-warmup)
    num_workers: int = 0  # DataLoader worker processes; 0 reads in the training process

    def problems(self) -> list[str]:
        """Every problem with the data flags, each naming the flag, the value and the fix."""
        p: list[str] = []
        separate = {name: paths for name, paths in self.split_paths().items() if paths}
        if not self.data_path and not separate:
            p.append("no data given: set --data-path PREFIX (or W1 PREFIX1 W2 PREFIX2 ...), or --train-data-path")
        if self.data_path and separate:
            flags = ", ".join(SPLIT_FLAGS[name] for name in separate)
            p.append(
                f"--data-path and {flags} were both given; use --data-path with --split, or only the separate paths"
            )
        if self.data_path:
            p.extend(_path_list_problems("--data-path", self.data_path))
            problem = split_problem(self.split)
            if problem:
                p.append(problem)
        for name, paths in separate.items():
            p.extend(_path_list_problems(SPLIT_FLAGS[name], paths))
        if self.num_workers < 0:
            p.append(f"--num-workers must be >= 0, got {self.num_workers}")
        p.extend(self.tokenizer_file_problems())
        return p

    def tokenizer_file_problems(self) -> list[str]:
        """Tokenizer files that `tokenizer_type` reads, named but missing (none named is fine: --vocab-size then
        sizes the model). Files of other tokenizer types are not checked (see TOKENIZER_FILES)."""
        named = [
            (flag, getattr(self, name)) for flag, name in TOKENIZER_FILES.get(self.tokenizer_type, ANY_TOKENIZER_FILES)
        ]
        return [
            f"{flag} {path}: no such file; give the path of the tokenizer file (see --tokenizer-type)"
            for flag, path in named
            if path and not os.path.exists(path)
        ]

    def split_paths(self) -> dict[str, list[str]]:
        """The separate train/valid/test path lists by split name (empty lists when unused)."""
        return {"train": self.train_data_path, "valid": self.valid_data_path, "test": self.test_data_path}


def parse_split(split: str) -> list[float]:
    """`"969, 30, 1"` or `"98/2/0"` → three non-negative floats (padded with zeros), as Megatron parses them."""
    sep = "," if "," in split else "/"
    values = [float(s) for s in split.split(sep)]
    values = (values + [0.0, 0.0, 0.0])[:3]
    if any(v < 0 for v in values) or sum(values) <= 0:
        raise ValueError("split weights must be >= 0 with a positive sum")
    return values


def split_problem(split: str) -> str | None:
    """A message when `split` does not parse, else None."""
    try:
        parse_split(split)
    except ValueError:
        return (
            f"--split {split!r} does not parse; give three non-negative numbers with a positive sum, "
            f"comma or slash separated, e.g. '969, 30, 1' or '98/2/0'"
        )
    return None


def parse_blend(paths: list[str], flag: str = "--data-path") -> tuple[list[float], list[str]]:
    """`[P]` → ([1.0], [P]); `[W1, P1, W2, P2, ...]` → (normalized weights, prefixes). Raises ValueError."""
    if len(paths) == 1:
        return [1.0], [paths[0].strip()]
    if len(paths) % 2:
        raise ValueError(
            f"{flag} has {len(paths)} values; a blend needs weight/prefix pairs 'W1 PREFIX1 W2 PREFIX2 ...'"
        )
    weights, prefixes = [], []
    for weight, prefix in zip(paths[0::2], paths[1::2], strict=True):
        try:
            weights.append(float(weight))
        except ValueError:
            raise ValueError(
                f"{flag}: weight {weight!r} (before {prefix!r}) is not a number; write 'W1 PREFIX1 W2 PREFIX2 ...'"
            ) from None
        if not math.isfinite(weights[-1]):
            raise ValueError(
                f"{flag}: weight {weight!r} (before {prefix!r}) is not a finite number; give weights >= 0 such as "
                f"'0.3 PREFIX1 0.7 PREFIX2'"
            )
        prefixes.append(prefix.strip())
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"{flag}: blend weights {weights} must be >= 0 with a positive sum")
    total = sum(weights)
    return [w / total for w in weights], prefixes


def prefix_exists(prefix: str) -> bool:
    """Both `PREFIX.bin` and `PREFIX.idx` exist (Megatron's `dataset_exists`)."""
    # the rule of `data.indexed.dataset_exists`, written out: the config section imports nothing of the package
    return os.path.isfile(prefix + ".idx") and os.path.isfile(prefix + ".bin")


def _path_list_problems(flag: str, paths: list[str]) -> list[str]:
    try:
        _, prefixes = parse_blend(paths, flag)
    except ValueError as err:
        return [str(err)]
    return [
        f"{flag}: no dataset at prefix {prefix!r} ({prefix}.bin and {prefix}.idx must both exist); "
        f"give the path without extension, as written by `moetron preprocess --output-prefix`"
        for prefix in prefixes
        if not prefix_exists(prefix)
    ]

"""Tokenizers with Megatron's names and semantics, built on HF `tokenizers` (Rust, no compilation here).

- `GPT2BPETokenizer`: GPT-2 byte-level BPE from `vocab.json` + `merges.txt`; ids equal GPT-2's and those of
  Megatron's pure-Python `gpt2_tokenization.py` ("Hello world" -> [15496, 995]); EOD is `<|endoftext|>`.
  Like Megatron, the text "<|endoftext|>" inside a document is *not* turned into the EOD id.
- `HFTokenizer`: any HF `tokenizer.json` (a file, or a directory holding one).

`train_bpe_tokenizer` trains a new byte-level BPE whose files work as `GPT2BPETokenizer` files.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizerCore
from tokenizers import decoders, models, pre_tokenizers, trainers

from moetron.config import RunConfig
from moetron.errors import UserError
from moetron.fileio import output_dir_problem, write_errors_named

EOD_TOKEN = "<|endoftext|>"
TOKENIZER_TYPES = ("GPT2BPETokenizer", "HFTokenizer")
# End-of-document candidates for tokenizer.json files without a tokenizer_config.json beside them.
_EOS_CANDIDATES = (EOD_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "[SEP]")


class Tokenizer:
    """A `tokenizers.Tokenizer` with Megatron's interface: encode, encode_batch, decode, vocab_size, eod."""

    def __init__(self, core: HFTokenizerCore, eod: int | None, name: str):
        self.core = core
        self.name = name
        self._eod = eod

    def encode(self, text: str) -> list[int]:
        return self.core.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # encode_batch_fast skips offset tracking; it exists in tokenizers >= 0.20.
        encode = getattr(self.core, "encode_batch_fast", self.core.encode_batch)
        return [encoding.ids for encoding in encode(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.core.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        return self.core.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int:
        if self._eod is None:
            raise UserError(
                f"tokenizer {self.name} has no end-of-document token (looked for {', '.join(_EOS_CANDIDATES)} and "
                "an eos_token in tokenizer_config.json); add one, or run without --append-eod"
            )
        return self._eod


# GPT-2's split regex restricted to ASCII text, where \p{L} is [A-Za-z], \p{N} is [0-9] and \s is Unicode
# White_Space (tab, LF, VT, FF, CR, space; not the \x1c-\x1f that Python's \s adds). Equal, on ASCII, to the
# split of the ByteLevel pre-tokenizer; tests compare the two on random ASCII strings.
_WS = r"\t\n\x0b\x0c\r "
_ASCII_GPT2_SPLIT = re.compile(
    rf"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^{_WS}A-Za-z0-9]+|[{_WS}]+(?![^{_WS}])|[{_WS}]+"
)
_WORD_CACHE_LIMIT = 1 << 20


def _ascii_byte_level_table() -> dict[int, str]:
    """GPT-2's byte -> printable character map, for the ASCII bytes (printable ones map to themselves)."""
    printable = set(range(ord("!"), ord("~") + 1))
    shifted = [b for b in range(256) if b not in printable and not 0xA1 <= b <= 0xAC and not 0xAE <= b <= 0xFF]
    table = {b: chr(256 + n) for n, b in enumerate(shifted) if b < 128}
    return {**table, **{b: chr(b) for b in printable}}


_ASCII_TO_BYTE_LEVEL = _ascii_byte_level_table()


class GPT2BPETokenizer(Tokenizer):
    """GPT-2 BPE with a word cache for ASCII documents.

    The Rust pipeline spends most of its time splitting and building encodings; for ASCII text the same split is
    one C-level `re.findall`, and each distinct word is run through the BPE model once and remembered. Other text
    goes through the full Rust pipeline. Both give identical ids.
    """

    def __init__(self, core: HFTokenizerCore, eod: int | None, name: str):
        super().__init__(core, eod, name)
        self._words: dict[str, list[int]] = {}

    def _word_ids(self, word: str) -> list[int]:
        if len(self._words) >= _WORD_CACHE_LIMIT:
            self._words.clear()
        ids = [token.id for token in self.core.model.tokenize(word.translate(_ASCII_TO_BYTE_LEVEL))]
        self._words[word] = ids
        return ids

    def _ascii_ids(self, text: str) -> list[int]:
        ids: list[int] = []
        words = self._words
        for word in _ASCII_GPT2_SPLIT.findall(text):
            known = words.get(word)
            ids += self._word_ids(word) if known is None else known
        return ids

    def encode(self, text: str) -> list[int]:
        return self._ascii_ids(text) if text.isascii() else super().encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        others = [i for i, text in enumerate(texts) if not text.isascii()]
        ids = [self._ascii_ids(text) if text.isascii() else [] for text in texts]
        for i, encoded in zip(others, super().encode_batch([texts[i] for i in others]), strict=True):
            ids[i] = encoded
        return ids


def _gpt2_core(model: models.BPE) -> HFTokenizerCore:
    core = HFTokenizerCore(model)
    # GPT-2: the byte-level regex split, no prefix space; decoding maps bytes back with replacement on bad UTF-8.
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    return core


def _read_vocab(vocab_file: str | Path) -> dict[str, int]:
    try:
        vocab = json.loads(Path(vocab_file).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"--vocab-file '{vocab_file}' is not a readable GPT-2 vocab.json ({err})") from None
    if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
        raise UserError(f"--vocab-file '{vocab_file}' is not a GPT-2 vocab.json (expected a token -> id object)")
    return vocab


def _read_merges(merge_file: str | Path) -> list[tuple[str, str]]:
    try:
        lines = Path(merge_file).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"--merge-file '{merge_file}' is not a readable GPT-2 merges.txt ({err})") from None
    merges = []
    for number, line in enumerate(lines, start=1):
        if not line or (number == 1 and line.startswith("#version")):
            continue
        pair = line.split(" ")
        if len(pair) != 2:
            raise UserError(f"--merge-file '{merge_file}' line {number} is not a 'left right' merge: {line[:60]!r}")
        merges.append((pair[0], pair[1]))
    return merges


def _gpt2_bpe(vocab_file, merge_file) -> Tokenizer:
    if vocab_file is None or merge_file is None:
        raise UserError(
            "--tokenizer-type GPT2BPETokenizer needs --vocab-file (vocab.json) and --merge-file (merges.txt)"
        )
    try:  # the Rust reader is fast; only when it fails do we parse in Python, to say which file is wrong
        core = _gpt2_core(models.BPE.from_file(str(vocab_file), str(merge_file), fuse_unk=False))
    except Exception as err:  # tokenizers raises plain Exception
        _read_vocab(vocab_file)
        _read_merges(merge_file)
        raise UserError(f"--vocab-file '{vocab_file}' and --merge-file '{merge_file}' do not match ({err})") from None
    eod = core.token_to_id(EOD_TOKEN)
    if eod is None:
        raise UserError(f"--vocab-file '{vocab_file}' has no {EOD_TOKEN} token, which GPT2BPETokenizer uses as EOD")
    return GPT2BPETokenizer(core, eod, f"GPT2BPETokenizer({Path(vocab_file).name})")


def _configured_eos(directory: Path) -> str | None:
    config = directory / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None
    return eos.get("content") if isinstance(eos, dict) else eos


def _hf_tokenizer(tokenizer_model) -> Tokenizer:
    if tokenizer_model is None:
        raise UserError("--tokenizer-type HFTokenizer needs --tokenizer-model (a tokenizer.json or its directory)")
    path = Path(tokenizer_model)
    file = path / "tokenizer.json" if path.is_dir() else path
    try:
        core = HFTokenizerCore.from_file(str(file))
    except Exception as err:  # tokenizers raises plain Exception for unreadable or malformed files
        raise UserError(f"--tokenizer-model '{tokenizer_model}' is not a readable tokenizer.json ({err})") from None
    vocab = core.get_vocab(with_added_tokens=True)
    candidates = [_configured_eos(file.parent), *_EOS_CANDIDATES]
    eod = next((vocab[token] for token in candidates if token in vocab), None)
    return Tokenizer(core, eod, f"HFTokenizer({file})")


def build_tokenizer(tokenizer_type: str, vocab_file=None, merge_file=None, tokenizer_model=None) -> Tokenizer:
    """Build a tokenizer by its Megatron `--tokenizer-type` name; every bad input is a one-line UserError."""
    if tokenizer_type == "GPT2BPETokenizer":
        return _gpt2_bpe(vocab_file, merge_file)
    if tokenizer_type == "HFTokenizer":
        return _hf_tokenizer(tokenizer_model)
    raise UserError(f"--tokenizer-type '{tokenizer_type}' is not supported; choose one of {', '.join(TOKENIZER_TYPES)}")


def load_tokenizer(cfg: RunConfig):
    """The tokenizer named in the run config, checked against the model's vocabulary."""
    d = cfg.data
    for flag, file in (("--vocab-file", d.vocab_file), ("--merge-file", d.merge_file)):
        if d.tokenizer_type == "GPT2BPETokenizer" and file and not Path(file).exists():
            raise UserError(
                f"{flag} {file} (the tokenizer file the checkpoint's config.yaml names) does not exist; pass "
                f"--vocab-file and --merge-file with the tokenizer the run was trained with"
            )
    if d.tokenizer_type == "HFTokenizer" and d.tokenizer_model and not Path(d.tokenizer_model).exists():
        raise UserError(
            f"--tokenizer-model {d.tokenizer_model} (the tokenizer the checkpoint's config.yaml names) does not "
            f"exist; pass --tokenizer-model with the tokenizer the run was trained with"
        )
    tokenizer = build_tokenizer(d.tokenizer_type, d.vocab_file, d.merge_file, d.tokenizer_model)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise UserError(
            f"the tokenizer ({d.vocab_file or d.tokenizer_model}) has {tokenizer.vocab_size} tokens but the "
            f"checkpoint's model only {cfg.model.vocab_size} (vocab_size in its config.yaml); pass the tokenizer "
            f"the run was trained with (--vocab-file/--merge-file or --tokenizer-model)"
        )
    return tokenizer


def _training_texts(files: list[Path], seen: list[int]) -> Iterator[str]:
    # Imported here: readers is a sibling module that itself needs nothing from this one.
    from moetron.data.readers import iter_texts

    for text in iter_texts(files, json_key="text"):
        seen[0] += 1
        yield text


def train_bpe_tokenizer(files: list[Path], vocab_size: int, output_dir: Path) -> Path:
    """Train a byte-level BPE on JSONL (key `text`) or plain-text files; write vocab.json, merges.txt, tokenizer.json.

    `<|endoftext|>` is a special token (id 0). The vocab.json + merges.txt pair loads as `GPT2BPETokenizer`;
    returns `output_dir`.
    """
    if vocab_size < 257:
        raise UserError(f"--vocab-size {vocab_size} is too small; use at least 257 (256 byte symbols + {EOD_TOKEN})")
    output_dir = Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise UserError(f"--output-dir '{output_dir}' exists and is not a directory")
    if not output_dir.parent.is_dir():
        raise UserError(f"--output-dir '{output_dir}': parent directory '{output_dir.parent}' does not exist")
    problem = output_dir_problem("--output-dir", str(output_dir))
    if problem:
        raise UserError(problem)
    core = _gpt2_core(models.BPE())
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    seen = [0]
    core.train_from_iterator(_training_texts(list(files), seen), trainer=trainer)
    if seen[0] == 0:
        raise UserError(f"--input {' '.join(map(str, files))} holds no usable text (JSONL needs a 'text' key)")
    with write_errors_named(f"--output-dir '{output_dir}'"):
        _save_all_or_nothing(core, output_dir)
    return output_dir


TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer.json")


def _save_all_or_nothing(core: HFTokenizerCore, output_dir: Path) -> None:
    """Write the three files into a staging folder, then move them in: a failure (a full disk) changes nothing."""
    created = not output_dir.exists()
    output_dir.mkdir(exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=output_dir))
    try:
        core.model.save(str(staging))  # vocab.json + merges.txt (with the "#version" header Megatron skips)
        core.save(str(staging / "tokenizer.json"))
        for name in TOKENIZER_FILES:
            os.replace(staging / name, output_dir / name)
    except BaseException:
        if created:
            shutil.rmtree(output_dir, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)

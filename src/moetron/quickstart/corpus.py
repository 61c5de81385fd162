"""The built-in quickstart corpus: English text that every Python installation carries.

Two sources, both offline and licence-clean: the language reference topics of `pydoc_data.topics` (what
`help("FOR")` prints) and the docstrings of the standard library's modules, classes and functions. The
docstrings are pulled from the source files with `ast`, never by importing the modules (importing all of
the standard library is slow and has side effects: GUI toolkits, deprecated modules, `antigravity`).

Documents are shuffled with a fixed seed before writing, so the validation split (the last documents) is
a sample of the whole corpus rather than the last modules in alphabetical order.
"""

from __future__ import annotations

import ast
import json
import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from moetron.fileio import atomic_writer

# Standard-library folders that are tests, demos, vendored code or installed packages, not documentation.
SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "turtledemo", "lib2to3", "ensurepip"}
MIN_DOCSTRING_CHARS = 40  # one-liners such as "Return self." teach nothing


def topic_documents() -> Iterator[str]:
    """The language reference pages that `help()` shows (about 0.5 MB)."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        text = topics[name].strip()
        if text:
            yield text


def stdlib_source_files(root: Path | None = None) -> list[Path]:
    """The standard library's `.py` files, sorted, without tests, demos and installed packages."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        if not SKIPPED_DIRS.intersection(path.relative_to(root).parts):
            files.append(path)
    return files


def file_docstrings(path: Path) -> Iterator[str]:
    """Docstrings of the module and of every class and function in it (files that do not parse are skipped)."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, OSError):
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node)
            if text and len(text) >= MIN_DOCSTRING_CHARS:
                yield text


def corpus_documents(max_bytes: int | None = None) -> list[str]:
    """Topics first, then docstrings, until `max_bytes` of UTF-8 text (None: everything, about 2 MB)."""
    documents, total = [], 0
    sources = [topic_documents()] + [file_docstrings(path) for path in stdlib_source_files()]
    for source in sources:
        for text in source:
            documents.append(text)
            total += len(text.encode("utf-8"))
            if max_bytes is not None and total >= max_bytes:
                return documents
    return documents


def write_corpus(path: Path, max_bytes: int | None = None, seed: int = 1234) -> tuple[int, int]:
    """Write the corpus as JSONL (`{"text": ...}` per line), shuffled with `seed`; returns (documents, bytes)."""
    documents = corpus_documents(max_bytes)
    random.Random(seed).shuffle(documents)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_writer(path) as f:  # never leave a half-written corpus behind
        for text in documents:
            f.write(json.dumps({"text": text}) + "\n")
    return len(documents), sum(len(text.encode("utf-8")) for text in documents)

"""A memo that keeps answers only while a scope is open: `plan --search` asks the same questions of one config
tens of thousands of times (the model's per-layer counts, whether its output directories are writable), while every
other caller must see a fresh answer (a directory can become writable; a config can be edited between runs)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator
from typing import Any


class ScopedMemo:
    """`get(key, compute)` computes once per key inside `scope()`, every time outside it. Nested scopes share the
    outermost one's answers."""

    def __init__(self) -> None:
        self._answers: dict[Hashable, Any] | None = None

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        outer = self._answers
        if outer is None:
            self._answers = {}
        try:
            yield
        finally:
            self._answers = outer

    def get(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        if self._answers is None:
            return compute()
        if key not in self._answers:
            self._answers[key] = compute()
        return self._answers[key]

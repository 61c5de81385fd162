"""Per-model memoisation for `plan --search`: it prices tens of thousands of layouts of the same (never mutated)
model, and the per-layer parameter counts dominate its run time. A module of its own, below `plan/` and every
dimension's memory terms that count parameters, so that all of them share one cache."""

from __future__ import annotations

from moetron.scoped_memo import ScopedMemo

_MODEL_COUNTS = ScopedMemo()  # (function, id(model), args) → (model, value)
model_cache = _MODEL_COUNTS.scope  # within the block, `cached` results are kept per model object


def cached(fn, model, *args):
    """`fn(model, *args)`, from the open `model_cache()` when there is one (the entry holds `model`, so its id
    cannot be reused while cached)."""
    return _MODEL_COUNTS.get((fn, id(model), args), lambda: (model, fn(model, *args)))[1]

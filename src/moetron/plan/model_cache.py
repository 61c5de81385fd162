"""Per-model memoisation for `plan --search`: it prices tens of thousands of layouts of the same (never mutated)
model, and the per-layer parameter counts dominate its run time. A module of its own, below every `plan` module
that counts parameters, so none of them has to import another to share the cache."""

from __future__ import annotations

import contextlib

_MODEL_CACHE: dict | None = None  # (function, id(model), args) → (model, value) while `model_cache()` is open


@contextlib.contextmanager
def model_cache():
    """Within the block, `cached` results are kept per model object: `plan --search` prices tens of thousands of
    layouts of the same (never mutated) model, and the per-layer parameter counts dominate its run time."""
    global _MODEL_CACHE
    outer, _MODEL_CACHE = _MODEL_CACHE, {} if _MODEL_CACHE is None else _MODEL_CACHE
    try:
        yield
    finally:
        _MODEL_CACHE = outer


def cached(fn, model, *args):
    """`fn(model, *args)`, from the open `model_cache()` when there is one (the entry holds `model`, so its id
    cannot be reused while cached)."""
    if _MODEL_CACHE is None:
        return fn(model, *args)
    key = (fn, id(model), args)
    hit = _MODEL_CACHE.get(key)
    if hit is None:
        hit = _MODEL_CACHE[key] = (model, fn(model, *args))
    return hit[1]

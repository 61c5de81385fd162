"""Built-in recipes: Megatron-DeepSpeed's MoE example scripts (and the quickstart) as YAML configs.

They ship inside the package so a wheel install has them too; the repository's `configs/` is a link here.
`--config gpt-1.3B-moe128` (a bare name) resolves to the recipe of that name.
"""

from __future__ import annotations

from pathlib import Path

RECIPES_DIR = Path(__file__).resolve().parent


def list_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def resolve_config_path(value: str | Path) -> Path:
    """A path as given when it exists; otherwise a built-in recipe named `value` (with or without `.yaml`)."""
    path = Path(value)
    if path.is_file():
        return path
    recipe = RECIPES_DIR / (path.name if path.suffix == ".yaml" else f"{path.name}.yaml")
    if path.parent == Path(".") and recipe.is_file():
        return recipe
    return path

"""The import rule of docs/architecture.md ("Imports"), checked on the import graph of src/moetron.

Every import counts, at the top of a module or inside a function (a lazy import still makes the import when it
runs). Imports under `if TYPE_CHECKING:` never run: they are left out of the cycle check only, and still have to
follow the layering.
"""

from __future__ import annotations

import ast
from pathlib import Path

import moetron

SRC = Path(moetron.__file__).resolve().parent

# The config leaf: the run configuration's dataclasses (each section's; the router's is the model's), the
# layout arithmetic `RunConfig.dims()` returns, YAML loading, the shipped recipes, errors and the atomic write.
LEAF = {"moetron", "moetron.config", "moetron.config_cli", "moetron.recipes", "moetron.errors", "moetron.fileio"}
LEAF |= {"moetron.model.config", "moetron.data.config"}
LEAF |= {"moetron.parallel.dims", "moetron.recipes.scale_down", "moetron.progress"}
LEAF |= {"moetron.scoped_memo", "moetron.process_memory"}
# Entry points: the CLI and its commands (argument parsing and printing) on top of everything.
ENTRY = {"moetron.cli", "moetron.__main__", "moetron.commands", "moetron.reference"}  # reference: the CLI's docs
# Process mains inside a package, run as `python -m`: they may call the CLI (`plan --search --measure`'s torchrun
# child runs `moetron train` in-process under timing hooks).
PROCESS_MAINS = {"moetron.plan.measure_worker"}
# Lowest first: a module may import its own package and the layers below its own, never a sibling package.
LAYERS = [["leaf"], ["data", "model"], ["cpu"], ["parallel"], ["checkpoint"], ["train"], ["validate"]]
LAYERS += [["eval", "interchange", "plan", "dryrun"], ["quickstart"], ["entry"]]
# Imports that break the rule today, each with the change that removes it. A listed import that no longer exists
# fails the test too: delete it here.
KNOWN_EXCEPTIONS: set[tuple[str, str]] = set()  # imports against the layers, each with its reason


def module_name(path: Path) -> str:
    parts = ("moetron", *path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in SRC.rglob("*.py")}


def unit(module: str) -> str:
    if module in LEAF:
        return "leaf"
    if module in ENTRY or module.startswith("moetron.commands."):
        return "entry"
    return module.split(".")[1]


def layer(module: str) -> int:
    return next(i for i, units in enumerate(LAYERS) if unit(module) in units)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    blocks = [n for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)]
    return {id(node) for block in blocks for stmt in block.body for node in ast.walk(stmt)}


def imports(module: str) -> list[tuple[str, bool]]:
    """(imported name, only under TYPE_CHECKING) for every import statement of `module`, relative ones resolved."""
    path = MODULES[module]
    return parse_imports(
        path.read_text(encoding="utf-8"), module if path.name == "__init__.py" else module.rpartition(".")[0]
    )


def parse_imports(source: str, package: str) -> list[tuple[str, bool]]:
    tree = ast.parse(source)
    typing_only, found = _type_checking_nodes(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in typing_only) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package.split(".")[: len(package.split(".")) + 1 - node.level]) if node.level else ""
            base = ".".join(filter(None, [base, node.module]))
            found += [(f"{base}.{alias.name}", id(node) in typing_only) for alias in node.names]
    return found


def resolve(name: str) -> str | None:
    """The moetron module an imported name is (`from pkg import module`) or lives in (`from module import name`)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def graph(with_typing_only: bool) -> dict[str, set[str]]:
    return {module: targets(module, imports(module), with_typing_only) for module in MODULES}


def targets(module: str, names: list[tuple[str, bool]], with_typing_only: bool) -> set[str]:
    found = {resolve(name) for name, typing_only in names if with_typing_only or not typing_only}
    return {target for target in found if target and target.startswith("moetron") and target != module}


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each back edge of a depth-first search (none: the graph is acyclic)."""
    cycles, state = [], {}  # state: "open" while on the depth-first path, "done" after

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(edges.get(module, ())):
            if state.get(target) == "open":
                cycles.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    return cycles


def test_every_module_has_a_layer():
    assert [m for m in MODULES if not any(unit(m) in units for units in LAYERS)] == []


def test_imports_go_down_the_layers():
    edges = graph(with_typing_only=True)
    wrong = {(a, b) for a, targets in edges.items() for b in targets if unit(a) != unit(b) and layer(b) >= layer(a)}
    wrong -= {(a, "moetron.cli") for a in PROCESS_MAINS}
    assert sorted(wrong - KNOWN_EXCEPTIONS) == []
    assert sorted(KNOWN_EXCEPTIONS - wrong) == [], "these imports are gone: delete them from KNOWN_EXCEPTIONS"


def test_no_import_cycle():
    assert find_cycles(graph(with_typing_only=False)) == []


def test_data_and_model_hold_no_distributed_code():
    offenders = [
        (module, name)
        for module in MODULES
        if unit(module) in ("data", "model")
        for name, _ in imports(module)
        if name.startswith("torch.distributed")
    ]
    assert offenders == []


def test_the_checker_sees_lazy_and_relative_imports_and_circles():
    """The checker itself, on two made-up modules: a function-level import is an edge (a circle hidden by a lazy
    import is still a circle), a relative import resolves, a TYPE_CHECKING import is kept apart."""
    executor = "from moetron.train.micro_batch import MicroBatch\ndef build():\n    from . import pipeline_executor\n"
    pipeline = "from typing import TYPE_CHECKING\nfrom moetron.train.executor import build\nif TYPE_CHECKING:\n"
    pipeline += "    from moetron.validate import check\n"
    names = {"executor": parse_imports(executor, "moetron.train"), "pipeline": parse_imports(pipeline, "moetron.train")}
    assert ("moetron.train.pipeline_executor", False) in names["executor"]
    assert ("moetron.validate.check", True) in names["pipeline"]
    edges = {m: targets(m, imports_, False) for m, imports_ in (("moetron.train.executor", names["executor"]),
             ("moetron.train.pipeline_executor", names["pipeline"]))}  # fmt: skip
    assert find_cycles(edges) == [
        ["moetron.train.executor", "moetron.train.pipeline_executor", "moetron.train.executor"]
    ]
    assert resolve("moetron.checkpoint.load_weights") == "moetron.checkpoint"
    assert unit("moetron.commands.eval") == "entry" and layer("moetron.config") == 0 < layer("moetron.data.loader")

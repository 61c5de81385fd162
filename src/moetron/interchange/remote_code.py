"""`trust_remote_code` export: moetron's own model code, bundled into one self-contained `modeling_moetron.py`.

Configs no transformers class expresses (Megatron's GPT with DeepSpeed top-1/top-2 routing and capacity, PR-MoE,
pyramids, …) are exported with remote code. Rather than a second implementation of the model — which could drift
from the one that was trained — the exporter copies the source of `moetron.model.gpt` and every moetron module it
imports, dependencies first, with the `from moetron… import` lines removed, into one file, and appends a small
`PreTrainedModel` wrapper (`remote_code/modeling_wrapper.py`). So the exported model computes exactly what moetron
computes — DeepSpeed-exact gating, capacity, random token selection and all — with nothing but torch, numpy and
transformers installed. The bundle refuses (at export time) any construct it cannot flatten safely: two modules
defining the same top-level name, or an aliased moetron import.
"""

from __future__ import annotations

import ast
import importlib
import json
from pathlib import Path

from moetron.model.config import ModelConfig

ROOT_MODULE = "moetron.model.gpt"
TEMPLATES = Path(__file__).parent / "remote_code"


def _source(module: str) -> str:
    return Path(importlib.import_module(module).__file__).read_text(encoding="utf-8")


def _moetron_imports(tree: ast.Module) -> list[ast.ImportFrom | ast.Import]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "moetron":
            found.append(node)
        elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "moetron" for a in node.names):
            found.append(node)
    return found


def module_order(root: str = ROOT_MODULE) -> list[str]:
    """Every moetron module `root` needs, each after the modules it imports."""
    order: list[str] = []

    def visit(module: str, stack: tuple[str, ...]) -> None:
        if module in order or module in stack:
            return
        for node in _moetron_imports(ast.parse(_source(module))):
            if isinstance(node, ast.Import) or any(a.asname for a in node.names):
                raise ValueError(f"{module}: `{ast.unparse(node)}` cannot be bundled; import names unaliased")
            visit(node.module, (*stack, module))
        order.append(module)

    visit(root, ())
    return order


def _flattened(module: str) -> tuple[str, set[str]]:
    """The module's source without its moetron and __future__ imports, and its top-level names."""
    text = _source(module)
    tree = ast.parse(text)
    drop: set[int] = set()
    for node in _moetron_imports(tree):
        drop.update(range(node.lineno, node.end_lineno + 1))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            drop.update(range(node.lineno, node.end_lineno + 1))
        elif isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            drop.update(range(node.lineno, node.end_lineno + 1))
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    lines = [line for number, line in enumerate(text.splitlines(), start=1) if number not in drop]
    return "\n".join(lines).strip() + "\n", names


def bundled_model_source() -> str:
    """moetron's model code as one importable module (no moetron import inside)."""
    parts = [
        '"""moetron\'s GPT / MoE GPT, bundled by `moetron export` for transformers\' trust_remote_code.\n\n'
        "Each section below is one moetron source file (named in its header), unchanged except for its moetron\n"
        'imports: the names they imported are defined in earlier sections. Needs torch, numpy and transformers."""\n',
        "from __future__ import annotations\n",
    ]
    owner: dict[str, str] = {}
    for module in module_order():
        body, names = _flattened(module)
        for name in names:
            if name in owner:
                raise ValueError(f"cannot bundle: {name} is defined in both {owner[name]} and {module}")
            owner[name] = module
        path = module.replace(".", "/") + ".py"
        parts.append(f"\n# {'=' * 100}\n# {path}\n# {'=' * 100}\n{body}")
    parts.append("\n" + (TEMPLATES / "modeling_wrapper.py").read_text(encoding="utf-8"))
    return "\n".join(parts)


def write_remote_code(out: Path, cfg: ModelConfig, hf_fields: dict, seed: int | None = None) -> dict:
    """Write modeling_moetron.py and configuration_moetron.py into `out`; returns the config.json content.
    `seed`: the run's --seed, which seeds the exported model's random routing streams as `moetron eval`'s."""
    import dataclasses

    (out / "modeling_moetron.py").write_text(bundled_model_source(), encoding="utf-8")
    (out / "configuration_moetron.py").write_text((TEMPLATES / "configuration_moetron.py").read_text(encoding="utf-8"))
    config = {
        "architectures": ["MoetronForCausalLM"],
        "model_type": "moetron",
        "auto_map": {
            "AutoConfig": "configuration_moetron.MoetronConfig",
            "AutoModelForCausalLM": "modeling_moetron.MoetronForCausalLM",
        },
        "moetron": json.loads(json.dumps(dataclasses.asdict(cfg))),
        "inference_routing": "eval",
        "random_seed": seed,
        **hf_fields,
    }
    return config

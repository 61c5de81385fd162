"""YAML files and CLI flags → `RunConfig`, both generated from the dataclasses (field name == flag name).

Accepted YAML: a flat mapping of field names (`num_layers: 4`; hyphens or underscores), optionally grouped
under `model:`, `data:`, `parallel:`, `train:` blocks (the blocks are only for readability: names are unique).
A list field (`num_experts`) takes a list or a single value. Precedence: dataclass defaults < YAML < flags.

Flags: `--num-layers 4` for every field; booleans are switches with a `--no-` form, plus Megatron's negative
spellings (`--disable-moe-token-dropping`, `--disable-moe-top2-2nd-expert-sampling`, `--disable-bias-linear`).
Unknown flags and YAML keys are errors with a did-you-mean suggestion.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import inspect
import re
import types
import typing
from pathlib import Path

import yaml

from moetron.config import RunConfig
from moetron.errors import ConfigError, UserError
from moetron.recipes import list_recipes, resolve_config_path

# Megatron's negative switches: flag → (field, value it sets)
NEGATIVE_FLAGS = {
    "disable-moe-token-dropping": "moe_token_dropping",
    "disable-moe-top2-2nd-expert-sampling": "moe_top2_2nd_expert_sampling",
    "disable-bias-linear": "add_bias_linear",
}


@dataclasses.dataclass(frozen=True)
class FieldSpec:
    section: str
    name: str
    kind: type  # int | float | str | bool
    is_list: bool
    optional: bool
    default: object

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _describe(hint) -> tuple[type, bool, bool]:
    """(scalar type, is list, accepts None) of a field's type hint."""
    optional = False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional, hint = True, args[0]
    if typing.get_origin(hint) is list:
        return typing.get_args(hint)[0], True, optional
    return hint, False, optional


def field_specs() -> dict[str, FieldSpec]:
    specs = {}
    defaults = RunConfig()
    for section in RunConfig.SECTIONS:
        cls = type(getattr(defaults, section))
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind, is_list, optional = _describe(hints[f.name])
            default = getattr(getattr(defaults, section), f.name)
            specs[f.name] = FieldSpec(section, f.name, kind, is_list, optional, default)
    return specs


# ---------------------------------------------------------------------------- CLI
@functools.cache
def _field_comments(cls: type) -> dict[str, str]:
    """The trailing `# comment` of each field in a dataclass's source: the flag's help text.

    Fields inherited from a base dataclass (ModelConfig's routing fields come from RouterConfig) take
    their comment from the base's source; a subclass that redeclares a field overrides it."""
    comments: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        found = re.findall(r"^\s+(\w+): [^#\n]*#\s*(.+)$", source, flags=re.MULTILINE)
        comments.update({name: text.strip() for name, text in found})
    return comments


def _help(spec: FieldSpec) -> str:
    cls = type(getattr(RunConfig(), spec.section))
    comment = _field_comments(cls).get(spec.name, "")
    default = f"default: {spec.default}"
    return f"{comment} ({default})".replace("%", "%%") if comment else default


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field; defaults are SUPPRESSed so only flags actually given override the YAML."""
    parser.allow_abbrev = False  # `--num-layer` must be an error with a suggestion, not a silent prefix match
    parser.usage = "%(prog)s [--config FILE.yaml] [--flag value ...]   (--help lists every flag)"
    groups = {s: parser.add_argument_group(f"{s} flags") for s in RunConfig.SECTIONS}
    for spec in field_specs().values():
        group = groups[spec.section]
        kwargs = {"dest": spec.name, "default": argparse.SUPPRESS, "help": _help(spec)}
        if spec.kind is bool and spec.name.startswith("no_"):  # already negative: no `--no-no-...` form
            group.add_argument(spec.flag, action="store_true", **kwargs)
        elif spec.kind is bool:
            group.add_argument(spec.flag, action=argparse.BooleanOptionalAction, **kwargs)
        elif spec.is_list:
            group.add_argument(spec.flag, nargs="+", type=spec.kind, metavar=spec.kind.__name__.upper(), **kwargs)
        else:
            kind = _none_or(spec.kind) if spec.optional else spec.kind
            group.add_argument(spec.flag, type=kind, metavar=spec.kind.__name__.upper(), **kwargs)
    for flag, name in NEGATIVE_FLAGS.items():
        groups[field_specs()[name].section].add_argument(
            "--" + flag, dest=name, action="store_false", default=argparse.SUPPRESS, help=f"Megatron's: {name} false"
        )
    _install_did_you_mean(parser)


def _none_or(kind: type):
    def convert(text: str):
        return None if text.lower() in ("none", "null") else kind(text)

    convert.__name__ = kind.__name__
    return convert


def _install_did_you_mean(parser: argparse.ArgumentParser) -> None:
    original = parser.error
    known = [s for action in parser._actions for s in action.option_strings]

    def error(message: str):
        if message.startswith("unrecognized arguments:"):
            hints = []
            for token in message.split(":", 1)[1].split():
                if token.startswith("--"):
                    close = difflib.get_close_matches(token.split("=")[0], known, n=1)
                    if close:
                        hints.append(f"{token} (did you mean {close[0]}?)")
            if hints:
                message = f"{message}; " + "; ".join(hints)
        original(message)

    parser.error = error


def cli_overrides(args: argparse.Namespace) -> dict:
    specs = field_specs()
    return {k: v for k, v in vars(args).items() if k in specs}


# ---------------------------------------------------------------------------- YAML
def read_yaml(path: str | Path) -> dict:
    path = resolve_config_path(path)
    if not path.is_file():
        raise UserError(
            f"--config {path}: no such file; give the path of a YAML config or a built-in recipe name "
            f"({', '.join(list_recipes())})"
        )
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise UserError(f"--config {path} is not valid YAML: {str(err).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise UserError(f"--config {path} must be a mapping of flag names to values, got {type(raw).__name__}")
    flat = {}
    for key, value in raw.items():
        if key in RunConfig.SECTIONS and isinstance(value, dict):
            flat.update({str(k).replace("-", "_"): v for k, v in value.items()})
        else:
            flat[str(key).replace("-", "_")] = value
    return flat


def _coerce(spec: FieldSpec, value, source: str) -> tuple[object, str | None]:
    """(value of the right type, or a problem naming the key, the value and the expected type)."""
    if value is None:
        return (None, None) if spec.optional else (None, f"{source}: {spec.name} cannot be null")
    if spec.is_list:
        items = value if isinstance(value, list) else [value]
        out = [_coerce(dataclasses.replace(spec, is_list=False), v, source) for v in items]
        bad = [p for _, p in out if p]
        return ([v for v, _ in out], bad[0] if bad else None)
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, (str, int, float)) and not isinstance(value, bool),
    }[spec.kind]
    if spec.kind is float and isinstance(value, str):  # YAML reads 3e-4 (no dot) as a string
        try:
            return float(value), None
        except ValueError:
            pass
    if not ok:
        return None, f"{source}: {spec.name}: {value!r} is not a {spec.kind.__name__}"
    return spec.kind(value), None


def apply_values(cfg: RunConfig, values: dict, source: str, problems: list[str]) -> None:
    specs = field_specs()
    for key, value in values.items():
        spec = specs.get(key)
        if spec is None:
            close = difflib.get_close_matches(key, list(specs), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            problems.append(f"{source}: unknown key {key!r}{hint}")
            continue
        coerced, problem = _coerce(spec, value, source)
        if problem:
            problems.append(problem)
        else:
            setattr(getattr(cfg, spec.section), key, coerced)


def load_config(config_path: str | None, overrides: dict) -> tuple[RunConfig, set[str]]:
    """Defaults < YAML < flags; returns the config and the names that were set explicitly."""
    cfg, problems = RunConfig(), []
    explicit: set[str] = set()
    if config_path:
        values = read_yaml(config_path)
        apply_values(cfg, values, f"--config {config_path}", problems)
        explicit |= set(values)
    apply_values(cfg, overrides, "command line", problems)
    explicit |= set(overrides)
    if problems:
        raise ConfigError(problems)
    return cfg, explicit


def to_yaml(cfg: RunConfig) -> str:
    """The resolved config as a sectioned YAML document that `load_config` reads back."""
    sections = {s: dataclasses.asdict(getattr(cfg, s)) for s in RunConfig.SECTIONS}
    return yaml.safe_dump(sections, sort_keys=False)

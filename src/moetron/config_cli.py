"""YAML files and CLI flags → `RunConfig`, both generated from the dataclasses (field name == flag name).

Accepted YAML: a flat mapping of field names (`num_layers: 4`; hyphens or underscores), optionally grouped
under `model:`, `data:`, `parallel:`, `train:` blocks (the blocks are only for readability: names are unique).
A list field (`num_experts`) takes a list or a single value. Precedence: dataclass defaults < YAML < flags.

Flags beat the YAML also where two options spell one setting differently. The LR warmup can be given in
tokens, iterations, samples or as a fraction (`lr_warmup_tokens` / `_iters` / `_samples` / `_fraction`), the
decay horizon in tokens, iterations or samples, and the run length in iterations, samples or tokens
(`train_iters` / `train_samples` / `train_tokens`). When the command line sets any option of one of these three
groups, the YAML's options of that group are dropped (reset to their defaults): a recipe's
`lr_warmup_tokens: 375000000` does not outrank `--lr-warmup-iters 1`, nor its `lr_warmup_iters` an explicit
`--lr-warmup-tokens`. Within one source (only YAML, or only flags) the schedule's own rule applies: token-based
options win over step-based ones, as in Megatron (the startup warns about the ignored one).

Flags: `--num-layers 4` for every field; booleans are switches with a `--no-` form, plus Megatron's negative
spellings (`--disable-moe-token-dropping`, `--disable-moe-top2-2nd-expert-sampling`, `--disable-bias-linear`,
Megatron-Core's `--muon-no-split-qkv`).
Unknown flags and YAML keys are errors with a did-you-mean suggestion.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import inspect
import os
import re
import types
import typing
from pathlib import Path

import yaml

from moetron.config import RUN_TIME_INTENTIONS, RunConfig
from moetron.errors import ConfigError, UserError
from moetron.recipes import list_recipes, resolve_config_path

# Megatron's negative switches: flag → (field, value it sets)
# Megatron's own spellings of switches whose moetron flag is spelled with hyphens only
MEGATRON_SPELLINGS = {"override-opt_param-scheduler": "override_opt_param_scheduler"}
NEGATIVE_FLAGS = {
    "disable-moe-token-dropping": "moe_token_dropping",
    "disable-moe-top2-2nd-expert-sampling": "moe_top2_2nd_expert_sampling",
    "disable-bias-linear": "add_bias_linear",
    "muon-no-split-qkv": "muon_split_qkv",
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
    for flag, name in MEGATRON_SPELLINGS.items():
        group, spelled = groups[field_specs()[name].section], f"Megatron's spelling of {name}"
        group.add_argument("--" + flag, dest=name, action="store_true", default=argparse.SUPPRESS, help=spelled)
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


# Options that set one thing in different units: a flag for any of them replaces the YAML's whole group.
EXCLUSIVE_GROUPS = {
    "LR warmup": ("lr_warmup_tokens", "lr_warmup_iters", "lr_warmup_samples", "lr_warmup_fraction"),
    "LR decay": ("lr_decay_tokens", "lr_decay_iters", "lr_decay_samples"),
    "run length": ("train_iters", "train_samples", "train_tokens"),
    # `--save` wins over `--output-dir` when both are set: one given on the command line drops the file's other
    "run directory": ("save", "output_dir"),
}


class ExplicitNames(set):
    """The field names set explicitly (YAML or flags), plus where each came from.

    `cli`: names given as flags; `yaml`: names the config file set (and still sets); `config_path`: that file;
    `replaced`: YAML values dropped because a flag of the same group was given ({name: YAML value}).
    `scaled`: what `--scale-down` changed ({name: (old, new)}).
    """

    def __init__(self, yaml_names=(), cli_names=(), config_path: str | None = None, replaced: dict | None = None):
        super().__init__(set(yaml_names) | set(cli_names))
        self.yaml = set(yaml_names)
        self.cli = set(cli_names)
        self.config_path = config_path
        self.replaced = dict(replaced or {})
        self.scaled: dict = {}  # {name: (recipe value, new value)} set by --scale-down (recipes/scale_down.py)


def cli_names(explicit: set[str]) -> set[str]:
    """The names given as flags (a plain set, as older callers pass, counts as all flags)."""
    return getattr(explicit, "cli", explicit)


def yaml_names(explicit: set[str]) -> set[str]:
    return getattr(explicit, "yaml", set())


def _drop_replaced_yaml(cfg: RunConfig, yaml_values: dict, overrides: dict) -> dict:
    """Reset the YAML's options of every group the command line sets; returns {dropped name: YAML value}."""
    specs, replaced = field_specs(), {}
    for names in EXCLUSIVE_GROUPS.values():
        if not set(names) & set(overrides):
            continue
        for name in names:
            if name in yaml_values and name not in overrides:
                if yaml_values[name] is not None:  # a null (a saved config.yaml's unset field) set nothing
                    replaced[name] = yaml_values[name]
                setattr(getattr(cfg, specs[name].section), name, specs[name].default)
    return replaced


def load_config(config_path: str | None, overrides: dict) -> tuple[RunConfig, ExplicitNames]:
    """Defaults < YAML < flags; returns the config and the names that were set explicitly (see ExplicitNames)."""
    cfg, problems = RunConfig(), []
    values: dict = {}
    if config_path:
        values = read_yaml(config_path)
        apply_values(cfg, values, f"--config {config_path}", problems)
    apply_values(cfg, overrides, "command line", problems)
    if problems:
        raise ConfigError(problems)
    replaced = _drop_replaced_yaml(cfg, values, overrides)
    explicit = ExplicitNames(set(values) - set(replaced), set(overrides), config_path, replaced)
    return cfg, explicit


# Path fields stored absolute in a saved config, so that it works from any working directory.
PATH_FIELDS = ("vocab_file", "merge_file", "tokenizer_model", "data_cache_path")
PREFIX_LIST_FIELDS = ("data_path", "train_data_path", "valid_data_path", "test_data_path")
OUTPUT_FIELDS = ("save", "output_dir", "tensorboard_dir")  # where the run writes: the directory it started in


def config_from_flags(flags: list[str]) -> tuple[RunConfig, ExplicitNames]:
    """The config `moetron train FLAGS` would run (`--config` included), for tools and tests that hold a command
    line rather than parsed arguments."""
    parser = argparse.ArgumentParser(prog="moetron train")
    add_config_arguments(parser)
    parser.add_argument("--config")
    parsed = parser.parse_args(flags)
    return load_config(parsed.config, cli_overrides(parsed))


def _absolute(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def _absolute_prefixes(values: list[str]) -> list[str]:
    """A prefix list (`[P]` or `[W1, P1, W2, P2, ...]`) with its prefixes made absolute; malformed lists as they
    are (validation reports them)."""
    if len(values) == 1:
        return [_absolute(values[0])]
    if len(values) % 2 or not all(is_number(w) for w in values[0::2]):
        return list(values)
    out = list(values)
    out[1::2] = [_absolute(p) for p in values[1::2]]
    return out


def is_number(text: str) -> bool:
    """Whether `text` reads as a number (a blend's weight, not a path)."""
    try:
        float(text)
    except ValueError:
        return False
    return True


def with_absolute_paths(cfg: RunConfig) -> RunConfig:
    """A copy of `cfg` whose tokenizer files, data prefixes, cache directory and outputs are absolute paths."""
    data, train = cfg.data, cfg.train
    changes = {name: _absolute(getattr(data, name)) for name in PATH_FIELDS if getattr(data, name)}
    changes |= {name: _absolute_prefixes(getattr(data, name)) for name in PREFIX_LIST_FIELDS if getattr(data, name)}
    outputs = {name: _absolute(getattr(train, name)) for name in OUTPUT_FIELDS if getattr(train, name)}
    return dataclasses.replace(
        cfg, data=dataclasses.replace(data, **changes), train=dataclasses.replace(train, **outputs)
    )


def to_yaml(cfg: RunConfig, with_intentions: bool = False) -> str:
    """The resolved config as a sectioned YAML document that `load_config` reads back from any directory
    (tokenizer files, data prefixes and the cache directory are written as absolute paths).

    The run-time intentions (`RUN_TIME_INTENTIONS`: --load, --finetune, --overwrite, --exit-interval, ...) are
    left out: this is what a run directory and its checkpoints keep, and continuing the run from it must not
    repeat them. `with_intentions`: all of them too (--print-config shows what this invocation will do)."""
    cfg = with_absolute_paths(cfg)
    sections = {s: dataclasses.asdict(getattr(cfg, s)) for s in RunConfig.SECTIONS}
    if not with_intentions:
        for name in RUN_TIME_INTENTIONS:
            del sections[field_specs()[name].section][name]
    return yaml.safe_dump(sections, sort_keys=False)

"""Reading a run's configuration: YAML recipes (duplicate keys refused, relative paths anchored at the recipe),
dotted overrides from the command line (``take_overrides``, the one parser) or a dict, values coerced to each
field's type, and the sections built (each one validated as it is built, ``config.fields``).

Unknown keys are rejected with the closest valid name; values of the wrong type (an integer given as 2.7, a
number given as ``true``, a non-finite number), a YAML key given twice and a section that is not a mapping
are each one ValueError naming the setting (and the file and line), before anything else runs. No torch
import here.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from megaseq.config.fields import describe, parse_size
from megaseq.config.generated import check_written
from megaseq.config.schema import FAMILY_DEFAULT, SECTIONS, Config


def _closest(name: str, choices: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" Did you mean {close[0]!r}?" if close else ""


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Turn a YAML/CLI value into the field's type (strings from the command line included)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        non_none = [a for a in args if a is not type(None)]
        return _coerce(value, non_none[0], key) if len(non_none) == 1 else value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"{key} expects true or false, got {value!r}")
    if isinstance(value, (dict, list, tuple)) and origin is not list:
        raise ValueError(f"{key} expects a single value, got {value!r}")
    if tp is int:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"{key} expects an integer, got {value!r}")
        return parse_size(value, key)
    if tp is float:
        return _number(value, key)
    if tp is str:
        return str(value)
    if origin is list:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v] if value else []
        if isinstance(value, dict) or not isinstance(value, (list, tuple)):
            value = [value]
        return [_coerce(v, args[0], key) for v in value] if args else list(value)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{key} must be a finite number, got {value!r}")
    return value


def _number(value: Any, key: str) -> float:
    """A finite float from YAML or the command line; ``true`` and ``.inf`` are refused, not turned into 1 and inf."""
    if isinstance(value, bool):
        raise ValueError(f"{key} expects a number, got {value!r}")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key} expects a number, got {value!r}") from None
    if not math.isfinite(x):
        raise ValueError(f"{key} must be a finite number, got {value!r}")
    return x


def _build_section(cls: type, values: dict[str, Any], section: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in values.items():
        if k not in fields:
            raise ValueError(f"unknown config key {section}.{k}.{_closest(k, fields)} "
                             f"Valid keys in {section}: {', '.join(sorted(fields))}")
        kwargs[k] = _coerce(v, hints[k], f"{section}.{k}")
    return cls(**kwargs)


def build_config(raw: dict[str, Any] | None = None, overrides: list[str] | dict[str, Any] | None = None) -> Config:
    """Build a Config from a nested dict (a recipe) plus dotted overrides (``model.name=x`` or a dict)."""
    for section, body in (raw or {}).items():
        if section not in SECTIONS:
            raise ValueError(f"unknown config section {section!r}.{_closest(section, SECTIONS)} "
                             f"Sections: {', '.join(SECTIONS)}")
        if body is not None and not isinstance(body, dict):
            raise ValueError(f"config section {section!r} must be a mapping of settings (like `{section}:` and "
                             f"indented `key: value` lines below it), got {body!r}")
    raw = {k: dict(v or {}) for k, v in (raw or {}).items()} if raw else {}
    items = overrides.items() if isinstance(overrides, dict) else [_split_override(o) for o in overrides or []]
    for key, value in items:
        section, _, name = key.partition(".")
        if section not in SECTIONS or not name:
            raise ValueError(f"unknown setting {key!r}: settings look like section.key, sections: "
                             f"{', '.join(SECTIONS)}.{_closest(section, SECTIONS)}")
        raw.setdefault(section, {})[name] = value
    return Config(**{s: _build_section(cls, raw.get(s, {}), s) for s, cls in SECTIONS.items()})


def _split_override(item: str) -> tuple[str, Any]:
    key, sep, value = item.partition("=")
    if not sep:
        raise ValueError(f"override {item!r} must look like section.key=value")
    try:
        parsed = yaml.load(value, Loader=_UniqueKeyLoader) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value  # not YAML (a path with odd characters): the string as given
    return key.strip().lstrip("-"), parsed


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's SafeLoader, except that a key given twice in one mapping is an error, not "the last one wins"."""


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        line = key_node.start_mark.line + 1
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"{key!r} is given twice (first at line {seen[key]}); YAML would silently keep only "
                "the last one: merge the two", key_node.start_mark)
        seen[key] = line
    return yaml.SafeLoader.construct_mapping(loader, node, deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)
# Booleans as YAML 1.2 has them (true / false): YAML 1.1 also reads on, off, yes, no as booleans, which would turn
# `fsdp: off` or `--parallel.fsdp off` into False; a bool setting still takes those words (``_coerce``)
_BOOL_TAG = "tag:yaml.org,2002:bool"
_UniqueKeyLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != _BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_UniqueKeyLoader.add_implicit_resolver(_BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def read_yaml(path: str | Path) -> Any:
    """A YAML file with duplicate keys refused; syntax errors are one ValueError naming the file and line."""
    p = Path(path)
    try:
        text = p.read_text()
    except UnicodeDecodeError:
        raise ValueError(f"config file {p} is not UTF-8 text: give a YAML recipe") from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ValueError(f"config file {p}{where}: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"config file {p} is not valid YAML: {e}") from None


# Files a recipe names: relative paths are relative to the recipe's directory, so a recipe works from any
# working directory (on the command line they are relative to the working directory, as usual).
RECIPE_PATH_LISTS = (("data", "train"), ("data", "heldout"))
# Settings that are a path or a name (a preset, "dna"): resolved only when the recipe-relative path exists.
RECIPE_PATH_OR_NAME = (("model", "name"), ("model", "init_from"), ("data", "tokenizer"))


def _anchor(value: Any, base: Path) -> Any:
    if not isinstance(value, str) or not value or Path(value).expanduser().is_absolute() or value.startswith("~"):
        return value
    return os.path.normpath(base / value)


def resolve_recipe_paths(raw: dict[str, Any], recipe: Path) -> dict[str, Any]:
    """``raw`` with the recipe's relative file paths made relative to the recipe's directory."""
    base = recipe.resolve().parent
    for section, key in RECIPE_PATH_LISTS:
        values = raw[section].get(key) if isinstance(raw.get(section), dict) else None
        if values:
            raw[section][key] = [_anchor(v, base) for v in (values if isinstance(values, list) else [values])]
    for section, key in RECIPE_PATH_OR_NAME:
        value = raw[section].get(key) if isinstance(raw.get(section), dict) else None
        anchored = _anchor(value, base)
        if anchored is not value and Path(anchored).exists():
            raw[section][key] = anchored
    return raw


def load_config(path: str | Path | None = None, overrides: list[str] | dict[str, Any] | None = None,
                drop_sections: tuple[str, ...] = ()) -> Config:
    """Read a YAML recipe (or none: the embedded default) and apply overrides. A relative file path in the
    recipe is relative to the recipe's directory (``resolve_recipe_paths``); ``drop_sections``: the recipe's
    sections left out (their settings then come from the overrides, the defaults or the model's family)."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config file {p} not found: give a YAML recipe (see recipes/)")
        loaded = read_yaml(p) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {p} must hold a mapping of sections, got {type(loaded).__name__}")
        raw = resolve_recipe_paths({k: (dict(v) if isinstance(v, dict) else v) for k, v in loaded.items()
                                    if k not in drop_sections}, p)
        try:
            cfg = build_config(raw, overrides)
        except ValueError as e:
            raise ValueError(f"{e} (config file {p}, or its command-line settings)") from None
        check_written(cfg, raw, p)  # a file the recipe's own make_*.py writes, not written yet
        return cfg
    return build_config(raw, overrides)


def default_recipe() -> str:
    """The embedded default job (glm5-flash-tiny on phage lambda), shipped inside the package."""
    from importlib.resources import files

    return str(files("megaseq") / "recipes" / "default.yaml")


def take_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """The command line's settings as dotted overrides, and the other arguments: ``['plan', '--train.steps',
    '5', '--data.seq_len=1K', '--memory.recompute']`` -> ``(['plan'], ['train.steps=5', 'data.seq_len=1K',
    'memory.recompute=true'])``; a setting takes the next argument as its value unless that is an option."""
    keep, out, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg.split("=")[0]:
            keep.append(arg)
            i += 1
        elif "=" in arg:
            out.append(arg[2:])
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out.append(f"{arg[2:]}={argv[i + 1]}")
            i += 2
        else:
            out.append(f"{arg[2:]}=true")
            i += 1
    return keep, out


def split_overrides(rest: list[str]) -> list[str]:
    """Command-line settings to dotted overrides (``take_overrides``); anything else is an error naming it."""
    keep, out = take_overrides(rest)
    if keep:
        raise ValueError(f"unexpected argument {keep[0]!r}: settings look like --section.key value "
                         "(see `megaseq train --help`)")
    return out


def field_help() -> dict[str, list[tuple[str, str, Any]]]:
    """Per section: (key, help, default) for the CLI's --help; the help ends with the values the field accepts
    (its choices or range, from the same metadata the validator reads)."""
    out = {}
    for section, cls in SECTIONS.items():
        rows = []
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            if f.metadata.get("family") and default is None:
                default = f.metadata["family"] if isinstance(f.metadata["family"], str) else FAMILY_DEFAULT
            accepted = describe(f.metadata)
            rows.append((f.name, f.metadata.get("help", "") + (f" {accepted}" if accepted else ""), default))
        out[section] = rows
    return out

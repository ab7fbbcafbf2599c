"""Settings as typed dataclass fields, each carrying its help text and its own checks as metadata.

``opt(default, help, **checks)`` declares a field; ``validate(obj, section)`` is the one reader of the checks,
run by every section's ``__post_init__``. A field's checks, in the order they run:

- ``aliases``: accepted spellings replaced by the value they stand for (``{"default": "base"}``)
- ``size``: a token or byte count written with a unit (``32K``, ``1M``, ``4G``) parsed to an integer
- ``duration``: a time written with a unit (``90s``, ``20m``, ``2h``), checked (the text is kept)
- ``length`` (``length_text``): the number of entries of a list
- ``nonempty``: no empty entry in a list (the value names what an entry is)
- ``also``: values accepted besides the ones below (``-1`` for "the default", ``"auto"``)
- ``choices``, ``pattern``: the accepted values, or a regular expression they match in full
- ``ge``, ``gt``, ``le``, ``lt``: bounds (on each entry of a list)

A failed check is one ValueError in one format, ``{section}.{key} must be {what}{note}, got {value!r}``:
``what`` is the rule (``one of a, b``, ``>= 1``) or the field's ``expect``, ``note`` its ``note``.
None passes every check (unset). Cross-field rules are ``config.checks``. No torch import here.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import field
from typing import Any

from megaseq.config import checks


def opt(default: Any, help: str, **checks: Any) -> Any:
    """A dataclass field with help text and checks (mutable defaults go through default_factory)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **checks})
    return field(default=default, metadata={"help": help, **checks})


_SIZE_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600}
_BOUNDS = (("ge", lambda a, b: a >= b, ">="), ("gt", lambda a, b: a > b, ">"),
           ("le", lambda a, b: a <= b, "<="), ("lt", lambda a, b: a < b, "<"))


def _with_unit(s: str, units: dict[str, float]) -> float | None:
    """``s`` times its unit suffix's multiplier ('1.5K' -> 1536.0 with K = 1024); None when not a number."""
    mult = 1.0
    if s and s[-1] in units:
        s, mult = s[:-1], units[s[-1]]
    try:
        return float(s) * mult
    except ValueError:
        return None


def _size_value(value: Any) -> float | None:
    """``value`` (a number, or a string with an optional K/M/G/T suffix and ``_`` separators) as a float; None
    when it is not a number."""
    return _with_unit(str(value).strip().upper().replace("_", ""), _SIZE_UNITS)


def parse_size(value: Any, setting: str | None = None) -> int:
    """'32K' -> 32768, '1M' -> 1048576, '4G' -> 4 * 2**30, '1.5K' -> 1536; ints pass through. A value that is
    not a whole number (2.7, '1.3K'), not finite, or a bool is a ValueError (naming ``setting`` when given)."""
    where = f"{setting} " if setting else ""
    if isinstance(value, bool):
        raise ValueError(f"{where}expects an integer (like 4096 or 32K), got {value!r}")
    if isinstance(value, int):
        return value
    v = _size_value(value)
    if v is None or not math.isfinite(v) or not v.is_integer():
        raise ValueError(f"{where}expects an integer (like 4096, 32K or 1M), got {value!r}")
    return int(v)


def parse_bytes(value: Any, setting: str | None = None) -> int:
    """A memory amount in bytes: ``parse_size``'s spellings, and fractions of a unit too ('79.6G' ->
    85,469,849,190: the bytes rounded down). A value that is not a positive finite number, or a bool, is a
    ValueError (naming ``setting`` when given)."""
    where = f"{setting} " if setting else ""
    v = None if isinstance(value, bool) else _size_value(value)
    if v is None or not math.isfinite(v) or v < 1:
        raise ValueError(f"{where}expects a memory size in bytes (like 85000000000, 80G or 79.6G), got {value!r}")
    return int(v)


def format_size(n: int) -> str:
    """``parse_size``'s spelling of a token count: 32768 -> '32K', 1048576 -> '1M'; other counts as digits."""
    for suffix, mult in (("M", 1 << 20), ("K", 1 << 10)):
        if n and n % mult == 0:
            return f"{n // mult}{suffix}"
    return str(n)


def parse_duration(value: Any, setting: str | None = None) -> float:
    """'90s' -> 90.0, '20m' -> 1200.0, '1.5h' -> 5400.0, 300 -> 300.0 (seconds); '' or None -> 0.0 (no limit).
    A negative, non-finite, unreadable or bool value is a ValueError (naming ``setting`` when given)."""
    where = f"{setting} " if setting else ""
    if value is None or value == "":
        return 0.0
    v = None if isinstance(value, bool) else _with_unit(str(value).strip().lower(), _DURATION_UNITS)
    if v is None or not math.isfinite(v) or v < 0:
        raise ValueError(f"{where}expects a duration (like 600, 90s, 20m or 2h), got {value!r}")
    return v


def validate(obj: Any, section: str) -> None:
    """Normalise and check every field of ``obj`` (a section's dataclass) from its metadata, then run the
    cross-field rules of its class (``checks.RULES``). ``section`` names the settings in messages."""
    for f in dataclasses.fields(obj):
        m = f.metadata
        value = _normalised(getattr(obj, f.name), m, f"{section}.{m.get('name', f.name)}")
        if value is not getattr(obj, f.name):
            object.__setattr__(obj, f.name, value)  # (frozen dataclasses too)
    checks.derive(obj)
    for f in dataclasses.fields(obj):
        check_value(getattr(obj, f.name), f.metadata, f"{section}.{f.metadata.get('name', f.name)}")
    checks.run(obj)


def _normalised(value: Any, m: Any, name: str) -> Any:
    """``value`` with its aliases replaced, a size parsed, a duration given as a number turned into text."""
    aliases = m.get("aliases", {})
    if isinstance(value, (str, int, float)) and value in aliases:
        value = aliases[value]
    if m.get("size") and value is not None and value not in m.get("also", ()):
        value = parse_size(value, name)
    if m.get("duration"):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        parse_duration(value, name)
    return value


def check_value(value: Any, m: Any, name: str) -> None:
    """One field's checks (``m``: its metadata) on ``value``; a ValueError in the one format when one fails."""
    many = isinstance(value, (list, tuple))
    if many and "length" in m and len(value) != m["length"]:
        raise ValueError(f"{name} needs {m.get('length_text', m['length'])}, got {value!r}")
    if many and m.get("nonempty") and any(not str(v).strip() for v in value):
        raise ValueError(f"{name} holds an empty {m['nonempty']}: {value!r}")
    for v in value if many else [value]:
        what = _broken_rule(v, m)
        if what is not None:
            each = "each entry of " if many else ""
            raise ValueError(f"{each}{name} must be {m.get('expect', what)}{m.get('note', '')}, got {value!r}")


def _broken_rule(v: Any, m: Any) -> str | None:
    """The rule ``v`` breaks, in words (``one of a, b``, ``>= 1``), or None when it keeps them all."""
    if v is None or v in m.get("also", ()):
        return None
    if "choices" in m and v not in m["choices"]:
        return f"one of {', '.join(map(str, m['choices']))}"
    if "pattern" in m and not (isinstance(v, str) and re.fullmatch(m["pattern"], v)):
        return f"a match of {m['pattern']}"
    for key, ok, word in _BOUNDS:
        if key in m and isinstance(v, (int, float)) and not isinstance(v, str) and not ok(v, m[key]):
            return f"{word} {m[key]}"
    return None


def describe(m: Any) -> str:
    """A field's accepted values for ``--help``: ``[choices: a, b]``, ``[range: >= 0, < 1]`` or ''."""
    if "choices" in m:
        return f"[choices: {', '.join(str(c) for c in m['choices'] if c is not None)}]"
    if "expect" in m:
        return f"[{m['expect']}]"
    bounds = [f"{word} {m[key]}" for key, _, word in _BOUNDS if key in m]
    return f"[range: {', '.join(bounds)}]" if bounds else ""

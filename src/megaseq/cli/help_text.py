"""The settings text of ``megaseq config`` and ``megaseq train --help``: every setting with its help, the
default a recipe that leaves it out gets, and the value the embedded default job sets where it differs."""

from __future__ import annotations

import dataclasses
import textwrap

from megaseq.config import Config, default_recipe, field_help, load_config


def default_job_values() -> dict[tuple[str, str], object]:
    """The settings where the embedded default job (``megaseq train`` without a recipe) differs from a field's
    default (what a recipe that leaves the field out gets): {(section, key): the job's value}."""
    job, plain = load_config(default_recipe()), Config()
    out = {}
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(getattr(plain, section.name)):
            value = getattr(getattr(job, section.name), f.name)
            if value != getattr(getattr(plain, section.name), f.name):
                out[(section.name, f.name)] = value
    return out


def _shown(value: object) -> str:
    return "[]" if value == [] else str(value)


def config_help(only: str | None = None) -> str:
    lines = ["configuration (YAML sections, or --section.key value on the command line). [default: X] is what a run\n"
             "gets when neither its recipe nor its command line sets the key; [default job: Y] where `megaseq train`\n"
             "without a recipe (the embedded default job, itself a recipe) sets it otherwise."]
    sections = field_help()
    if only is not None and only not in sections:
        raise ValueError(f"unknown config section {only!r}: one of {', '.join(sections)}")
    job = default_job_values()
    for section, rows in sections.items():
        if only is not None and section != only:
            continue
        lines.append(f"\n  {section}:")
        for key, help_text, default in rows:
            shown = f"[default: {_shown(default)}]"
            if (section, key) in job:
                shown += f" [default job: {_shown(job[(section, key)])}]"
            wrapped = textwrap.wrap(f"{help_text} {shown}", 70)
            lines.append(f"    --{section}.{key:<24} {wrapped[0] if wrapped else ''}")
            lines.extend(f"    {'':<33}{w}" for w in wrapped[1:])
    return "\n".join(lines)

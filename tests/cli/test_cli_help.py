"""The command line's help: a bare ``megaseq`` prints it, each verb lists its own options with examples, the config
reference is ``megaseq config``, and every command a help text or a setting's help names exists."""

from __future__ import annotations

import re

import pytest

from megaseq.cli.main import EXAMPLES, VERBS, main, parser
from megaseq.config import field_help


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    return capsys.readouterr().out


def test_bare_megaseq_prints_help_and_runs_nothing(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "usage: megaseq" in out and all(v in out for v in VERBS)


def test_version(capsys):
    assert main(["--version"]) == 0
    assert re.fullmatch(r"megaseq \d+\.\d+\.\d+.*\n", capsys.readouterr().out)


@pytest.mark.parametrize("verb", ["plan", "bench", "verify", "eval"])
def test_a_verb_lists_its_own_options_and_examples(capsys, verb):
    out = _help(capsys, verb)
    assert "examples:" in out and all(e.split("#")[0].strip() in out for e in EXAMPLES[verb])
    assert "--train.resume" not in out and "--memory.checkpoint_offload" not in out
    assert "`megaseq config`" in out


def test_config_prints_the_reference(capsys):
    assert main(["config", "train"]) == 0
    out = capsys.readouterr().out
    assert "--train.resume" in out and "--memory." not in out
    assert main(["config", "nope"]) == 2


def _commands(text: str) -> list[list[str]]:
    """Each ``megaseq VERB [--option ...]`` a text names in backticks or as an example line."""
    found = re.findall(r"`megaseq ([^`]+)`", text) + re.findall(r"^\s+megaseq (.+?)(?:\s+#.*)?$", text, re.M)
    return [c.split() for c in found]


def test_every_command_a_help_text_names_exists(capsys):
    main(["--help"])
    texts = [capsys.readouterr().out]
    for verb in VERBS:
        texts.append(_help(capsys, verb))
    texts += [h for rows in field_help().values() for _, h, _ in rows]
    commands = [c for t in texts for c in _commands(t)]
    assert len(commands) > 10
    sub = {a.dest: a for a in parser()._actions if a.dest == "verb"}["verb"].choices
    for cmd in commands:
        if cmd[0] == "VERB":  # the placeholder of "`megaseq VERB --help`"
            continue
        if cmd[0].startswith("-"):
            assert cmd[0] in ("--version", "--help", "-h"), cmd
            continue
        assert cmd[0] in VERBS, f"a help text names `megaseq {' '.join(cmd)}`, which is no verb"
        options = {s for a in sub[cmd[0]]._actions for s in a.option_strings}
        for word in cmd[1:]:
            if word.startswith("--") and "." not in word:
                assert word in options, f"`megaseq {' '.join(cmd)}`: {cmd[0]} has no option {word}"


def test_the_check_catches_a_command_that_does_not_exist(capsys, monkeypatch):
    """A broken help text (one naming ``verify --list-presets``, which does not exist) fails the check above."""
    monkeypatch.setitem(EXAMPLES, "verify", ["megaseq verify --list-presets"])
    with pytest.raises(AssertionError, match="no option --list-presets"):
        test_every_command_a_help_text_names_exists(capsys)


SETTINGS_VERBS = ("train", "plan", "bench", "verify", "tune", "eval")  # the verbs that take --section.key settings


def test_each_verb_names_only_its_own_options(capsys):
    """Every --option a verb's help names is one of its own; a --section.key setting is named only by a verb that
    takes settings, and only as a real key (train's help is the settings reference)."""
    sub = {a.dest: a for a in parser()._actions if a.dest == "verb"}["verb"].choices
    keys = {f"--{section}.{key}" for section, rows in field_help().items() for key, _, _ in rows}
    for verb in VERBS:
        own = {s for a in sub[verb]._actions for s in a.option_strings}
        text = re.sub(r"torchrun .*?-m megaseq", "", _help(capsys, verb))  # torchrun's own options
        named = set(re.findall(r"(?<![\w-])--[a-z][\w.-]*[\w]", text))
        settings = {n for n in named if "." in n} - {"--section.key"}  # the placeholder of "--section.key value"
        named -= {"--section.key"}
        assert named - settings <= own, f"megaseq {verb} --help names {sorted(named - settings - own)}"
        assert settings <= keys and (not settings or verb in SETTINGS_VERBS), (verb, sorted(settings - keys))


def test_another_verbs_option_in_a_help_fails_the_check(capsys, monkeypatch):
    monkeypatch.setitem(EXAMPLES, "convert", ["megaseq convert a b --merged"])  # export's option, not convert's
    with pytest.raises(AssertionError, match="megaseq convert --help names \\['--merged'\\]"):
        test_each_verb_names_only_its_own_options(capsys)

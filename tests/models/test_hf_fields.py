"""Every family refuses the config.json fields it does not implement, by one mechanism (``models/hf_fields.py``).

Each family's tiny preset, written as its config.json (``to_hf_config``), gets each known-unsupported field or
value injected (a sliding window, an invented RoPE type, another activation, attention dropout, a field no
family knows); loading it must raise one ValueError naming the field. ``tie_word_embeddings: true`` must do
what transformers' class does: tie where its ``_tied_weights_keys`` ties, else load both matrices apart
(Kimi-Linear). A family that ignores one field (its declaration carrying it) fails the check.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from megaseq.models import hf_fields
from megaseq.models.registry import FAMILY_PACKAGES, family_module
from megaseq.models.spec import from_hf_config, to_hf_config

transformers = pytest.importorskip("transformers")

# injection name -> (the fields set, a word the message must hold, the fields removed first)
INJECTIONS: dict[str, tuple[dict[str, Any], str, tuple[str, ...]]] = {
    "use_sliding_window": ({"use_sliding_window": True, "sliding_window": 4096}, "sliding_window", ()),
    "sliding_window": ({"sliding_window": 4096}, "sliding_window", ()),
    "rope_type": ({"rope_parameters": {"rope_type": "invented", "rope_theta": 10000.0}}, "rope", ()),
    "legacy rope_scaling": ({"rope_scaling": {"type": "invented", "factor": 2.0}}, "rope", ("rope_parameters",)),
    "hidden_act": ({"hidden_act": "gelu"}, "hidden_act", ()),
    "attention_dropout": ({"attention_dropout": 0.1}, "attention_dropout", ()),
    "unknown field": ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping", ()),
}
# injections a family implements (gpt-oss computes any sliding window; its parity test covers it)
IMPLEMENTED: dict[str, tuple[str, ...]] = {"gpt_oss": ("sliding_window",)}


def tiny_config(family: str) -> dict[str, Any]:
    """The family's tiny preset as the config.json megaseq writes for it."""
    presets = family_module(family, "spec").PRESETS
    name = next(n for n in presets if n.endswith("-tiny"))
    return to_hf_config(presets[name]())


def _inject(c: dict[str, Any], fields: dict[str, Any], drop: tuple[str, ...]) -> dict[str, Any]:
    c = copy.deepcopy(c)
    section = c["text_config"] if isinstance(c.get("text_config"), dict) else c  # the language model's fields
    for k in drop:
        section.pop(k, None)
    section.update(copy.deepcopy(fields))
    return c


def refusal_failures(family: str) -> list[str]:
    """What the family accepts that it should refuse, or refuses without naming the field."""
    base = tiny_config(family)
    from_hf_config(base)  # the clean config loads
    failures = []
    for name, (fields, word, drop) in INJECTIONS.items():
        if name in IMPLEMENTED.get(family, ()):
            continue
        try:
            from_hf_config(_inject(base, fields, drop))
        except ValueError as e:
            if word not in str(e) or family.split("_")[0] not in str(e):
                failures.append(f"{name}: message does not name {word!r} and the family: {e}")
        else:
            failures.append(f"{name}: accepted {fields}")
    return failures


def tie_failure(family: str) -> str | None:
    """``tie_word_embeddings: true`` must tie exactly where transformers' class ties."""
    c = tiny_config(family)
    c["tie_word_embeddings"] = True
    if isinstance(c.get("text_config"), dict):
        c["text_config"]["tie_word_embeddings"] = True
    hf_ties = bool(getattr(transformers, c["architectures"][0])._tied_weights_keys)
    spec = from_hf_config(c)
    if spec.tie_word_embeddings != hf_ties:
        return f"tie_word_embeddings true: megaseq ties {spec.tie_word_embeddings}, transformers {hf_ties}"
    if to_hf_config(spec).get("tie_word_embeddings") is not True:
        return "the export does not carry tie_word_embeddings true"
    return None


@pytest.mark.parametrize("family", list(FAMILY_PACKAGES))
def test_every_family_refuses_every_unsupported_field(family):
    assert refusal_failures(family) == []


@pytest.mark.parametrize("family", list(FAMILY_PACKAGES))
def test_tied_embeddings_as_transformers_ties(family):
    assert tie_failure(family) is None


def test_every_family_declares_its_fields():
    for family in FAMILY_PACKAGES:
        assert isinstance(family_module(family, "spec").HF_FIELDS, hf_fields.HFFields), family


def test_a_family_that_ignores_a_field_fails(monkeypatch):
    """OLMoE declaring the sliding window as carried (read nowhere, so ignored) fails the injection check."""
    spec_mod = family_module("olmoe", "spec")
    f = spec_mod.HF_FIELDS
    ignoring = hf_fields.HFFields(f.read, f.carried | {"use_sliding_window", "sliding_window"},
                                  {k: v for k, v in f.required.items() if "sliding" not in k})
    monkeypatch.setattr(spec_mod, "HF_FIELDS", ignoring)
    failures = refusal_failures("olmoe")
    assert any(x.startswith("use_sliding_window: accepted") for x in failures)
    assert any(x.startswith("sliding_window: accepted") for x in failures)


def test_a_kimi_linear_that_ties_fails(monkeypatch):
    """Kimi-Linear tying its embeddings (what it computed before: 154% off transformers) fails the tie check."""
    spec_mod = family_module("kimi_linear", "spec")
    real = spec_mod.from_hf
    monkeypatch.setattr(spec_mod, "from_hf", lambda c: real(c).replace(
        tie_word_embeddings=c.get("tie_word_embeddings", False)))
    assert "megaseq ties True, transformers False" in tie_failure("kimi_linear")


def test_one_message_names_field_value_and_support():
    c = _inject(tiny_config("mixtral"), {"use_sliding_window": True, "sliding_window": 4096}, ())
    with pytest.raises(ValueError, match=r"use_sliding_window = True is not supported by megaseq's mixtral: full "):
        from_hf_config(c)

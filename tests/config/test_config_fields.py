"""Each setting's own checks are field metadata read by one validator (``config.fields``); the rules between
settings are named functions in one place (``config.checks``); ``--help`` shows the accepted values from the
same metadata. Broken variants (a validator that reads no rule, a rule table left empty) fail these checks."""

from __future__ import annotations

import dataclasses

import pytest

from megaseq import schemes
from megaseq.config import SECTIONS, ExpertDispatchSettings, MemorySettings, build_config, checks, field_help, fields

KNOWN = {"help", "name", "aliases", "size", "duration", "length", "length_text", "nonempty", "also", "choices",
         "pattern", "ge", "gt", "le", "lt", "expect", "note", "family"}

# (setting, a value its own metadata refuses, the message: the setting, the rule, the value)
REFUSED = [
    ("model.dtype", "fp16", r"model\.dtype must be one of bf16, fp32, fp64, got 'fp16'"),
    ("model.kernels", "fastest", r"model\.kernels must be fast or base, got 'fastest'"),
    ("data.kind", "csv", r"data\.kind must be one of fasta, text, chat, random, got 'csv'"),
    ("data.seq_len", 1, r"data\.seq_len must be >= 2, got 1"),
    ("data.heldout_tail", 1.5, r"data\.heldout_tail must be in \[0, 1\) \(or -1 for the default\), got 1\.5"),
    ("parallel.cp", 0, r"parallel\.cp must be >= 1, got 0"),
    ("parallel.dp", 0, r"parallel\.dp must be >= 1 or -1 \(fill the world\), got 0"),
    ("parallel.launcher", "slurm", r"parallel\.launcher must be one of auto, torchrun, ray, none, got 'slurm'"),
    ("parallel.ep_dispatch", "fast", r"parallel\.ep_dispatch must be one of pipelined_llep, llep, plain"),
    ("parallel.llep_alpha", 0.5, r"parallel\.llep_alpha must be >= 1\.0 \(the GPUs' caps must hold every row\)"),
    ("memory.mlp_tile_tokens", 0, r"memory\.mlp_tile_tokens must be >= 1, got 0"),
    ("memory.model_segment_tokens", -8, r"memory\.model_segment_tokens must be >= 0 \(0: off\), got -8"),
    ("optim.betas", [0.9], r"optim\.betas needs two numbers, like \[0\.9, 0\.95\], got \[0\.9\]"),
    ("optim.betas", [0.9, 1.0], r"each entry of optim\.betas must be < 1, got \[0\.9, 1\.0\]"),
    ("moe.balance", "even", r"moe\.balance must be one of auto, bias, aux_loss, none, got 'even'"),
    ("moe.aux_loss_coef", -0.5, r"moe\.aux_loss_coef must be >= 0\.0 \(or unset for the model family's\)"),
    ("lora.dropout", 1.0, r"lora\.dropout must be in \[0, 1\), got 1\.0"),
    ("train.device", "cuda:x", r"train\.device must be auto, cpu, cuda or cuda:N, got 'cuda:x'"),
    ("train.trainable", ["a", " "], r"train\.trainable holds an empty pattern"),
    ("train.time_limit", "soon", r"train\.time_limit expects a duration"),
    ("eval.kmer_k", 31, r"eval\.kmer_k must be <= 30, got 31"),
]


@pytest.mark.parametrize("setting, value, message", REFUSED, ids=[f"{r[0]}={r[1]}" for r in REFUSED])
def test_a_field_refuses_what_its_metadata_refuses(setting, value, message):
    with pytest.raises(ValueError, match=message):
        build_config(overrides={setting: value})


def test_accepted_spellings_and_units():
    cfg = build_config(overrides={"model.kernels": "default", "moe.balance": "auto", "moe.aux_loss_coef": -1.0,
                                  "train.device": "cuda:3", "parallel.dp": -1, "data.heldout_tail": -1.0,
                                  "memory.gpu_budget": "80G", "train.time_limit": 90})
    assert cfg.model.kernels == "base" and cfg.moe.balance is None and cfg.moe.aux_loss_coef is None
    assert cfg.memory.gpu_budget == 80 * 2**30 and cfg.memory.host_budget == "auto"
    assert cfg.train.time_limit == "90" and cfg.train.device == "cuda:3"


def test_a_broken_validator_fails_the_checks(monkeypatch):
    """A validator that reads no rule accepts every bad value: the refusal test above catches it."""
    monkeypatch.setattr(fields, "_broken_rule", lambda v, m: None)
    with pytest.raises(pytest.fail.Exception):
        test_a_field_refuses_what_its_metadata_refuses("data.kind", "csv", REFUSED[2][2])


def test_every_metadata_key_is_one_the_validator_reads():
    """A misspelt check (``gte=1``) would be silently ignored: every key is a known one."""
    classes = [*SECTIONS.values(), ExpertDispatchSettings]
    for cls in classes:
        for f in dataclasses.fields(cls):
            assert set(f.metadata) <= KNOWN, (cls.__name__, f.name, set(f.metadata) - KNOWN)


def test_the_size_fields_are_the_schemes_sizes():
    """``memory.*`` sizes parsed with units are the scheme records' sizes (``schemes.SIZE_SETTINGS``)."""
    sized = {f.name for f in dataclasses.fields(MemorySettings) if f.metadata.get("size")}
    assert sized == set(schemes.SIZE_SETTINGS)


@pytest.mark.parametrize("overrides, message", [
    ({"model.dsa_warmup_steps": 5}, "model.dsa_warmup_steps 5 warms up the indexer"),
    ({"model.weights": "bf16", "model.dtype": "fp32"}, "model.weights bf16 computes in bf16"),
    ({"data.related_jitter": 0.2}, "data.related_jitter 0.2 varies the regions"),
    ({"data.kind": "fasta", "data.chat_template": "t.jinja"}, "data.chat_template renders conversations"),
    ({"parallel.llep_threshold": 1.0}, r"parallel.llep_threshold \(1.0\) must be >= parallel.llep_alpha"),
    ({"lora.rank": 4, "lora.targets": []}, "lora.rank > 0 needs lora.targets"),
    ({"lora.rank": 4, "lora.targets": ["q_proj"], "model.weights": "bf16"}, "a frozen base"),
    ({"memory.auto": False, "memory.checkpoint_offload": True}, "memory.checkpoint_offload"),
    ({"memory.auto": False, "memory.segment_kv_host": True}, "memory.segment_kv_host keeps"),
])
def test_cross_field_rules(overrides, message):
    with pytest.raises(ValueError, match=message):
        build_config(overrides=overrides)


def test_an_empty_rule_table_fails_the_cross_field_checks(monkeypatch):
    monkeypatch.setattr(checks, "RULES", {})
    with pytest.raises(pytest.fail.Exception):
        test_cross_field_rules({"model.dsa_warmup_steps": 5}, "warms up the indexer")


def test_every_rule_is_listed_once():
    """The named rules of ``checks`` and the table that runs them agree: none written and never run."""
    listed = [r for rules in (*checks.RULES.values(), *checks.DERIVED.values()) for r in rules]
    defined = [v for k, v in vars(checks).items() if callable(v) and getattr(v, "__module__", "") == checks.__name__
               and k not in ("derive", "run", "hf_weights_in")]
    assert sorted(r.__name__ for r in listed) == sorted(r.__name__ for r in defined)


def test_help_shows_the_accepted_values_from_the_metadata():
    rows = {(s, k): h for s, section in field_help().items() for k, h, _ in section}
    assert rows[("data", "kind")].endswith("[choices: fasta, text, chat, random]")
    assert rows[("optim", "min_lr_ratio")].endswith("[range: >= 0, <= 1]")
    assert rows[("train", "device")].endswith("[auto, cpu, cuda or cuda:N]")
    assert rows[("moe", "balance")].endswith("[choices: auto, bias, aux_loss, none]")

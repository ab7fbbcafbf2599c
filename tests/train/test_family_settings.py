"""Settings that follow the model's family unless the user sets them (``train/family_settings.py``): a Qwen3-MoE
checkpoint trains without balancing flags, also in place of the default job's model; a value the user sets wins;
the run's config.yaml records the resolved values; ``--help`` says "[default: the model family's]"."""

from __future__ import annotations

import pytest
import torch
import yaml

from megaseq.cli import main as cli
from megaseq.cli import verbs
from megaseq.config import FAMILY_DEFAULT, MoEConfig, build_config, load_config
from megaseq.models.presets import get_preset
from megaseq.train.balance import resolve_balance
from megaseq.train.family_settings import resolve_moe

QUICK = ["--train.steps", "2", "--train.eval_every", "0", "--train.eval_after", "false", "--train.export_hf", "false",
         "--data.seq_len", "64", "--log.progress", "false", "--log.tensorboard", "false", "--model.dtype", "fp32"]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    """A Qwen3-MoE checkpoint of the user's own: config.json and safetensors (router_aux_loss_coef in it)."""
    from megaseq.models.build import build_model
    from megaseq.models.hf_io import export_hf_checkpoint

    out = tmp_path_factory.mktemp("qwen3") / "ckpt"
    spec = get_preset("qwen3-moe-tiny")
    export_hf_checkpoint(build_model(spec, dtype=torch.float32, seed=0), spec, out)
    return out


def _train(run_dir, *argv: str) -> dict:
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rc = cli.main(["train", *argv, *QUICK, "--train.run_dir", str(run_dir)])
    finally:
        torch.set_num_threads(prev)
    assert rc == 0, f"megaseq train exited {rc}"
    return yaml.safe_load((run_dir / "config.yaml").read_text())["moe"]


def _qwen_without_balancing_flags(qwen_dir, tmp_path) -> None:
    """The default job (no recipe) with a user's Qwen3-MoE checkpoint and no --moe flag trains, with the
    family's balancing written to config.yaml."""
    moe = _train(tmp_path / "run", "--model.name", str(qwen_dir))
    spec = get_preset("qwen3-moe-tiny")
    assert spec.router_aux_loss_coef > 0
    assert moe == {"balance": "aux_loss", "aux_loss_coef": spec.router_aux_loss_coef, "bias_update_rate": 0.0,
                   "seq_aux_loss_coef": 0.0}


def test_a_qwen3_moe_checkpoint_trains_with_no_balancing_flags(qwen_dir, tmp_path):
    _qwen_without_balancing_flags(qwen_dir, tmp_path)


def test_the_default_jobs_balancing_forced_on_another_model_fails_the_check(qwen_dir, tmp_path, monkeypatch):
    """As before: the default job's moe.seq_aux_loss_coef (its own model's) applied to the user's Qwen3 model."""
    monkeypatch.setattr(verbs, "load_config", lambda path, overrides, drop_sections=(): load_config(path, overrides))
    with pytest.raises(AssertionError, match="exited 2"):
        _qwen_without_balancing_flags(qwen_dir, tmp_path)


def test_a_user_set_value_wins(qwen_dir, tmp_path):
    moe = _train(tmp_path / "run", "--model.name", str(qwen_dir), "--moe.aux_loss_coef", "0.05")
    assert moe["balance"] == "aux_loss" and moe["aux_loss_coef"] == 0.05


def test_the_default_job_keeps_its_own_models_balancing():
    cfg = load_config(verbs.default_recipe(), [])
    assert cfg.moe.seq_aux_loss_coef == 0.01  # set by the default job's recipe for glm5-flash-tiny
    args = type("A", (), {"config": None})()
    assert verbs._config(args, ["--model.name", "qwen3-moe-tiny"]).moe == MoEConfig()  # the family's


@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "glm5-flash-tiny", "mixtral-tiny", "olmoe-tiny"])
@pytest.mark.parametrize("kw", [{}, {"balance": "none"}, {"bias_update_rate": 0.02}, {"aux_loss_coef": 0.0},
                                {"balance": "auto", "aux_loss_coef": -1.0}])
def test_resolving_is_idempotent_and_keeps_the_rule(preset, kw):
    spec = get_preset(preset)
    try:
        rule = resolve_balance(MoEConfig(**kw), spec)
    except ValueError:
        return  # a rule this router cannot train with: refused the same way by the run
    resolved = resolve_moe(MoEConfig(**kw), spec)
    assert None not in vars(resolved).values()
    assert resolve_balance(resolved, spec) == rule and resolve_moe(resolved, spec) == resolved
    for k, v in kw.items():  # what the user set is kept as given
        if v not in ("auto", -1.0):
            assert getattr(resolved, k) == v


def test_unset_is_not_the_mode_none():
    assert build_config({}, ["moe.balance=none"]).moe.balance == "none"
    assert build_config({}, ["moe.balance=auto"]).moe.balance is None
    assert build_config({"moe": {"balance": "none"}}).moe.balance == "none"


def test_help_says_the_family_decides():
    text = " ".join(cli.config_help("moe").split())
    for key in ("balance", "aux_loss_coef", "bias_update_rate", "seq_aux_loss_coef"):
        block = text.split(f"--moe.{key} ")[1].split("--moe.")[0]
        assert f"[default: {FAMILY_DEFAULT}]" in block, block


# ---- evaluation: what the held-out report measures follows the data ----------------------------------------

def _data(**kw):
    from megaseq.config import DataConfig

    return DataConfig(**kw)


@pytest.mark.parametrize("data, unit, kmer_k", [
    ({}, "base", 8),                                                          # DNA, single nucleotides
    ({"alphabet": "protein", "train": ["f.fa"]}, "residue", 0),               # protein, built-in residues
    ({"kind": "text", "tokenizer": "tok.json"}, "token", 0),                  # text
    ({"kind": "chat", "tokenizer": "ckpt"}, "token", 0),                      # conversations
    ({"tokenizer": "ckpt"}, "token", 0),                                      # DNA through a model's tokenizer
])
def test_evaluation_follows_the_data(data, unit, kmer_k):
    from megaseq.config import EvalConfig
    from megaseq.train.family_settings import eval_unit, resolve_eval

    d = _data(seq_len="2K", **data)
    assert eval_unit(d) == unit
    ev = resolve_eval(EvalConfig(), d)
    assert ev.kmer_k == kmer_k and ev.by_position == 256  # 8 buckets of the 2K window
    assert resolve_eval(EvalConfig(seq_len="1M"), d).by_position == 128 * 1024
    assert resolve_eval(EvalConfig(seq_len=1000), d).by_position == 64  # a power of two, at least 8 buckets
    assert resolve_eval(ev, d) == ev  # idempotent
    kept = resolve_eval(EvalConfig(by_position=100, kmer_k=3 if unit == "base" else 0), d)
    assert kept.by_position == 100 and kept.kmer_k == (3 if unit == "base" else 0)  # the user's values win


def test_a_kmer_order_for_data_without_bases_is_warned_about():
    from megaseq.config import EvalConfig
    from megaseq.train.family_settings import resolve_eval

    with pytest.warns(UserWarning, match="eval.kmer_k 6 has no effect.*per token"):
        resolve_eval(EvalConfig(kmer_k=6), _data(kind="text", tokenizer="tok.json"))


def test_help_says_the_data_decides_the_evaluation():
    from megaseq.config import DATA_DEFAULT

    text = " ".join(cli.config_help("eval").split())
    for key in ("by_position", "kmer_k"):
        block = text.split(f"--eval.{key} ")[1].split("--eval.")[0]
        assert f"[default: {DATA_DEFAULT}]" in block, block


def _dna_recipe(tmp_path):
    recipe = tmp_path / "dna.yaml"  # a recipe that leaves the eval section out: every eval setting is its default
    recipe.write_text("model:\n  name: glm5-flash-tiny\n")
    return recipe


def _run_eval(tmp_path, recipe, *argv):
    run = tmp_path / "run"
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rc = cli.main(["train", str(recipe), *QUICK[:4], "--train.eval_after", "true", *QUICK[6:],
                       "--train.run_dir", str(run), "--eval.max_windows", "1", *argv])
    finally:
        torch.set_num_threads(prev)
    assert rc == 0
    return yaml.safe_load((run / "config.yaml").read_text())["eval"], json_of(run / "eval" / "eval_by_position.json")


def json_of(path):
    import json

    return json.loads(path.read_text())


def test_the_run_records_and_uses_the_datas_evaluation(tmp_path):
    """A DNA run with no eval settings: config.yaml records the resolved values, and its report used them (the
    k-mer baseline of order 8, 8 position buckets of the 64-token window)."""
    recorded, report = _run_eval(tmp_path, _dna_recipe(tmp_path))
    assert recorded["kmer_k"] == 8 and recorded["by_position"] == 8
    assert report["unit"] == "base" and report["bucket_width"] == recorded["by_position"]
    assert report["baseline"] == "kmer-k8", report["baseline"]


def test_evaluation_left_unresolved_fails_the_check(tmp_path, monkeypatch):
    """A broken variant that resolves only the balancing: the run cannot evaluate with the printed defaults."""
    from megaseq.train import family_settings, trainer

    monkeypatch.setattr(trainer, "resolve_family_settings",
                        lambda cfg, spec: family_settings.dataclasses.replace(
                            cfg, moe=family_settings.resolve_moe(cfg.moe, spec)))
    with pytest.raises((AssertionError, TypeError)):
        test_the_run_records_and_uses_the_datas_evaluation(tmp_path)

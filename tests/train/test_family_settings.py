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

"""The trained DSA indexers' AdamW groups: their gradient is the objective's coefficient times the KL's, so their
epsilon is AdamW's times the coefficient, and their update is the one they would take at coefficient 1.

Checked in float64 on the CPU: three sparse-stage steps of a GLM tiny model at the default coefficient (0.001) end
with every parameter equal to the same steps at coefficient 1 (the indexer's inputs are detached, so its term
reaches only the indexer, whose selection the rest then reads: equal indexers, equal steps). A broken variant, the
indexers in the plain groups, must differ.
"""

from __future__ import annotations

import pytest
import torch

from megaseq.models.build import build_model
from megaseq.models.glm5.spec import glm5_flash_tiny
from megaseq.train import indexer_training as it
from megaseq.train import optim

S = 96


def model_with_indexers(coef: float):
    spec = glm5_flash_tiny().replace(index_topk=32)
    model = build_model(spec, dtype=torch.float64, device="cpu", seed=3)
    it.enable(model, coef=coef, warmup_steps=0)
    return model


def indexer_ids(model) -> set[int]:
    return {id(p) for _, m in it.dsa_layers(model) if m.indexer is not None for p in m.indexer.parameters()}


def three_steps(coef: float) -> dict[str, torch.Tensor]:
    model = model_with_indexers(coef)
    opt = torch.optim.AdamW(optim.param_groups(model, 0.01, eps=1e-8), lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    g = torch.Generator().manual_seed(0)
    for step in range(1, 4):
        ids = torch.randint(1, glm5_flash_tiny().vocab_size, (2, S + 1), generator=g)
        it.begin_step(model, step)
        it.loss_scale(model, ids[:, :-1].numel())
        hidden = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(model.logits(hidden).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_groups_put_each_trained_parameter_once_and_scale_the_indexers_eps():
    model = model_with_indexers(0.001)
    groups = optim.param_groups(model, 0.01, eps=1e-8)
    seen = [id(p) for g in groups for p in g["params"]]
    assert sorted(seen) == sorted(id(p) for p in model.parameters() if p.requires_grad)
    ix = indexer_ids(model)
    assert ix and all(g.get("eps") == pytest.approx(1e-11) for g in groups if ix & {id(p) for p in g["params"]})
    assert all("eps" not in g for g in groups if not ix & {id(p) for p in g["params"]})
    assert all(g["params"] for g in groups)
    plain = build_model(glm5_flash_tiny(), dtype=torch.float64, device="cpu", seed=3)
    two = optim.param_groups(plain, 0.01, eps=1e-8)
    assert [g["weight_decay"] for g in two] == [0.01, 0.0] and all("eps" not in g for g in two)


def test_three_steps_at_the_default_coefficient_equal_those_at_coefficient_one():
    ref = three_steps(1.0)
    got = three_steps(0.001)
    for n, p in ref.items():
        torch.testing.assert_close(got[n], p, rtol=1e-9, atol=1e-12, msg=n)


def test_the_indexers_in_the_plain_groups_fail_it(monkeypatch):
    ref = three_steps(1.0)
    monkeypatch.setattr(it, "adam_groups", lambda model: None)
    got = three_steps(0.001)
    differ = [n for n, p in ref.items() if ".indexer." in n and not torch.allclose(got[n], p, rtol=1e-9, atol=1e-12)]
    assert differ


def test_a_checkpoint_with_the_indexers_in_the_plain_groups_is_refused_with_the_fix(tmp_path, monkeypatch, capsys):
    """A ``model.train_indexer`` run whose optimizer held the indexers in the plain groups (two groups) does not
    resume into today's (four): one message naming the setting and how to start from its weights."""
    import yaml
    from test_indexer_training import WARMUP_LORA
    from test_train import _cfg

    from megaseq.cli.main import main

    raw = _cfg(tmp_path, "s", model=WARMUP_LORA["model"], train={"steps": 2}, lora={}).to_dict()
    recipe = tmp_path / "s.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    with monkeypatch.context() as m:
        m.setattr(it, "adam_groups", lambda model: None)
        assert main(["train", str(recipe)]) == 0
    capsys.readouterr()
    raw["train"]["steps"] = 4
    recipe.write_text(yaml.safe_dump(raw))
    assert main(["train", str(recipe), "--train.resume", "true"]) == 2
    err = capsys.readouterr().err
    assert "other parameter groups" in err and "model.train_indexer" in err and "--model.init_from" in err

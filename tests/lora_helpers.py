"""Shared helpers of the LoRA tests: an adapted model with random factors, and the reference those tests
compare against, autograd through the *merged* model (no adapter modules: every targeted weight replaced by
``W + (alpha / r) B A`` built from leaf A and B tensors, the scaling recomputed here from the settings)."""

from __future__ import annotations

import torch
from torch.func import functional_call

from megaseq.config import AdapterSettings, MemorySettings, build_config
from megaseq.memory.vocab_loss import linear_cross_entropy
from megaseq.models.build import build_model
from megaseq.models.common import lora
from megaseq.models.registry import parallelize

TOL = {"rtol": 1e-10, "atol": 1e-13}


def settings(targets: str = "all", rank: int = 3, alpha: float = 5.0, trainable: str = "",
             frozen_dtype: str | None = None, **kw) -> AdapterSettings:
    over = {"lora.rank": rank, "lora.alpha": alpha, "lora.targets": targets, "train.trainable": trainable, **kw}
    return AdapterSettings.of(build_config(overrides=over), frozen_dtype)


def randomize_adapters(model: torch.nn.Module, seed: int = 100) -> None:
    """Random A and B (B is zero at initialisation: every gradient test would be trivial)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if lora.is_adapter(name):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen, dtype=torch.float64))


def adapted_model(spec, adapters: AdapterSettings, memory: MemorySettings | None = None, env=None):
    """``spec``'s float64 model (seed 0) with ``adapters`` and ``memory`` applied, factors random."""
    model = build_model(spec, dtype=torch.float64, seed=0)
    done = parallelize(model, memory or MemorySettings(), env, adapters)
    randomize_adapters(model)
    return model, done


def trained(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def merged_reference(spec, adapted: torch.nn.Module, adapters: AdapterSettings, ids, labels, doc_ids=None):
    """(loss, {trained name: gradient}) of the merged computation: a plain model, every adapted weight
    ``W + s B A`` of leaves, the trained base parameters leaves too, the loss plain."""
    base = build_model(spec, dtype=torch.float64, seed=0)
    s = adapters.lora.alpha / adapters.lora.rank
    leaves = {n: p.detach().clone().requires_grad_(True) for n, p in trained(adapted).items()}
    params = {n: leaves.get(n, p.detach()) for n, p in base.named_parameters()}
    for name, _, tensor in lora.adapted(adapted):
        if tensor is None:
            A, B, w = leaves[f"{name}.lora_A.weight"], leaves[f"{name}.lora_B.weight"], f"{name}.weight"
            params[w] = params[w] + s * B @ A
        else:
            module = name.rpartition(".")[0]
            A, B = leaves[f"{module}.lora_A.{tensor}"], leaves[f"{module}.lora_B.{tensor}"]
            params[name] = params[name] + s * torch.bmm(B, A)
    hidden = functional_call(base, params, (ids,), {"doc_ids": doc_ids})
    loss = linear_cross_entropy(hidden, params["lm_head.weight"], labels)
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    return loss.detach(), dict(zip(leaves, grads))


def assert_grads(model: torch.nn.Module, ref: dict[str, torch.Tensor], tol: dict = TOL) -> None:
    """Every trained parameter's gradient as the reference's; every frozen one without a gradient."""
    params = dict(model.named_parameters())
    frozen = [n for n, p in params.items() if not p.requires_grad and p.grad is not None]
    assert not frozen, f"frozen parameters got a gradient: {frozen[:3]}"
    assert set(trained(model)) == set(ref), "trained parameters differ from the reference's"
    for name, want in ref.items():
        got = params[name].grad
        assert got is not None, f"{name}: no gradient"
        torch.testing.assert_close(got, want, **tol, msg=lambda m, n=name: f"{n}: {m}")

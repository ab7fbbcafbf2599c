"""The planner with a frozen base: its parameter table is the model's, it counts exactly the parameters the
runtime trains and freezes and their bytes, and a LoRA layer's predicted saved set (adapter intermediates
included) matches what autograd keeps in the real blocks, fp32 and bf16 autocast with the base stored in bf16.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_plan_layers import kda_uncounted, saved_bytes  # noqa: F401  (kda_uncounted: a fixture)

from lora_helpers import settings
from megaseq.config import MemorySettings
from megaseq.models.build import build_model
from megaseq.models.common import lora
from megaseq.models.presets import PRESETS, get_preset
from megaseq.models.registry import family_module, parallelize
from megaseq.plan import components as C
from megaseq.plan.choice import base_settings
from megaseq.plan.layer_terms import layer_terms
from megaseq.plan.params import param_table, trained_counts
from megaseq.plan.run import Run

torch.set_num_threads(2)
TARGETS = "q_proj,v_proj,o_proj,kv_b_proj,experts,shared_experts.up_proj,mlp.gate_proj"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_param_table_is_the_models(name: str) -> None:
    """Every preset (the full-size ones too, built on the meta device): same names, shapes and kinds."""
    spec = get_preset(name)
    with torch.device("meta"):
        model = family_module(spec.family, "model").Model(spec)
    assert sorted(param_table(spec), key=str) == sorted(lora.param_table(model), key=str)
    assert sum(p.numel for p in param_table(spec)) == C.count_params(spec).total


@pytest.mark.parametrize("name", ["glm5-flash-tiny", "qwen3-moe-tiny"])
def test_trained_counts_are_the_runtimes(name: str) -> None:
    spec = get_preset(name)
    adapters = settings(targets=TARGETS if name.startswith("glm5") else "q_proj,experts", rank=4,
                        trainable="norm.weight", frozen_dtype="bf16")
    model = build_model(spec, dtype=torch.float32, seed=0)
    parallelize(model, MemorySettings(), None, adapters)
    tr = trained_counts(spec, adapters)
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert tr.total == sum(p.numel() for p in trained.values())
    assert tr.adapters == sum(p.numel() for n, p in trained.items() if lora.is_adapter(n))
    counts = C.count_params(spec)
    counts.trained = tr
    assert counts.total == sum(p.numel() for p in model.parameters())
    for i in range(spec.num_layers):
        assert sum(tr.layers[i]) == sum(p.numel() for n, p in trained.items() if n.startswith(f"layers.{i}."))
    # bytes: the planner's parameter bytes (frozen in bf16 but the family's fp32 tensors, GLM's routers, KDA
    # conv/decay and mHC base/scale: ParamCounts.fp32_kept) against the model's, stored as the runtime stores them
    planned = C.param_bytes(counts, C.Mesh(), C.precision_for("bf16"))
    actual = sum(p.numel() * p.element_size() for p in model.parameters())
    assert planned == actual, (planned, actual)


@pytest.mark.usefixtures("kda_uncounted")
@pytest.mark.parametrize("name, seq, autocast", [("qwen3-moe-tiny", 555, False), ("qwen3-moe-tiny", 333, True),
                                                 ("glm5-flash-tiny", 555, False)])
def test_lora_saved_set_matches_blocks(name, seq, autocast) -> None:
    """Each LoRA layer's predicted saved bytes (the frozen base's activation terms, the adapters' r-wide
    intermediates, the merged kv_b_proj) within 5% of the storages autograd keeps; under CPU bf16 autocast
    with the frozen base stored in bf16 and a bf16 residual stream, as on a GPU."""
    spec = get_preset(name)
    adapters = settings(targets=TARGETS if name.startswith("glm5") else "all", rank=8,
                        frozen_dtype="bf16" if autocast else None)
    model = build_model(spec, dtype=torch.float32, seed=0)
    parallelize(model, MemorySettings(), None, adapters)
    counts = C.count_params(spec)
    counts.trained = trained_counts(spec, adapters)
    run = Run(spec=spec, seq_len=seq, batch=1, mesh=C.Mesh(), model_dtype="bf16" if autocast else "fp32",
              memory=base_settings(None, seq).to_dict(), counts=counts,
              cal=C.Calibration(kda_conv_copies=2), sparse_impl="torch_masked")
    shape = (1, seq, spec.hc_mult, spec.hidden_size) if spec.hc_mult > 1 else (1, seq, spec.hidden_size)
    h = torch.randn(*shape, dtype=torch.bfloat16 if autocast else torch.float32, requires_grad=True)
    for i, layer in enumerate(model.layers):
        if spec.layer_types[i] == "dsa" and spec.indexer_types[i] == "shared":
            continue  # needs the previous layer's selection in ctx.carry
        terms = layer_terms(run, i)
        copies = C.weight_copy_bytes(sum(counts.layer_trained(i)), run.prec, run.mesh)
        predicted = terms.saved - terms.attn.get("kda chunk state (q,k,v,g,A)", 0) + copies
        measured = saved_bytes(layer, h, autocast, skip_params=True)
        assert abs(predicted / measured - 1) < 0.05, (i, spec.layer_types[i], predicted / seq, measured / seq)


def test_qwen3_30b_lora_plan_on_one_h200(monkeypatch) -> None:
    """The figures docs/lora.md quotes: Qwen3-30B-A3B (the published config) with rank-16 LoRA on every
    projection fits 632K tokens on one H200 and not 640K with the base kernels (the 632K run:
    benchmarks/results/lora/runs/2026-12-02_48-layers-632k/), 640K and not 648K with the fast set's working sets
    (the default; planned, not measured); full fine-tuning of the same model does not fit at all."""
    from megaseq.config import load_config
    from megaseq.plan.planner import plan_from_config

    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # the recipe names its config.json from the repo root

    def fits(n: int, *over: str) -> bool:
        cfg = load_config("recipes/qwen3-30b-a3b-lora.yaml", [f"data.seq_len={n}", *over])
        return plan_from_config(cfg, world_size=1).fits

    assert fits(632 * 1024, "model.kernels=base") and not fits(640 * 1024, "model.kernels=base")
    assert fits(640 * 1024) and not fits(648 * 1024)
    assert not fits(8192, "lora.rank=0")  # the frozen base is what makes it fit


@pytest.mark.parametrize("name", ["glm5-flash-tiny", "deepseek-v32-tiny"])
def test_trained_counts_with_the_indexer_objective_are_the_runtimes(name: str) -> None:
    """LoRA with ``model.train_indexer``: the indexers' parameters train beside the adapters (their gradients and
    optimizer state), and the planner counts them, parameters and bytes, as the runtime has them."""
    from megaseq.train import indexer_training

    spec = get_preset(name)
    adapters = settings(targets="attention", rank=4, frozen_dtype="bf16")
    model = build_model(spec, dtype=torch.float32, seed=0)
    parallelize(model, MemorySettings(), None, adapters)
    indexer_training.enable(model, 0.001, 0, torch.float32)  # as the trainer does, before the optimizer
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    indexer = sum(p.numel() for n, p in trained.items() if ".indexer." in n)
    assert indexer > 0
    tr = trained_counts(spec, adapters, train_indexer=True)
    assert tr.total == sum(p.numel() for p in trained.values())
    for i in range(spec.num_layers):
        assert sum(tr.layers[i]) == sum(p.numel() for n, p in trained.items() if n.startswith(f"layers.{i}."))
    counts = C.count_params(spec)
    counts.trained = tr
    assert C.param_bytes(counts, C.Mesh(), C.precision_for("bf16")) == sum(
        p.numel() * p.element_size() for p in model.parameters())
    # the count without the indexers (the planner as it was) is short by exactly their parameters
    assert trained_counts(spec, adapters).total == tr.total - indexer


def test_the_plan_of_a_lora_run_counts_the_trained_indexers() -> None:
    """``plan_from_config``: a LoRA run with ``model.train_indexer`` plans more optimizer state than without."""
    from megaseq.config import build_config
    from megaseq.plan.planner import plan_from_config

    over = {"model.name": "glm5-flash-tiny", "lora.rank": 4, "lora.targets": "attention", "data.seq_len": 512}
    without = plan_from_config(build_config(overrides=over), world_size=1)
    with_ = plan_from_config(build_config(overrides={**over, "model.train_indexer": True}), world_size=1)
    before, after = ({c[0]: c[1] for c in p.components} for p in (without, with_))
    assert after["optimizer state"] > before["optimizer state"], (before, after)

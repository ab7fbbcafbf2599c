"""The planner's side of kept attention (``memory.keep_attention_layers``, ``ops.kept_attention``): the bytes a
kept layer holds are the runtime's, they are held from the layer's forward to its backward, the planner keeps as
many of the last layers as fit with 5% of the GPU to spare, and recompute's cost falls by the attention forwards
it no longer reruns."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from megaseq.config import MemorySettings, load_config
from megaseq.models.build import build_model
from megaseq.models.common import attention as attn_mod
from megaseq.models.common import sink_attention as sink_mod
from megaseq.models.presets import get_preset
from megaseq.models.registry import parallelize
from megaseq.ops import dispatch, kept_attention
from megaseq.plan import components as C
from megaseq.plan import fixes
from megaseq.plan.choice import base_settings
from megaseq.plan.fixes import KEEP_SELECTION_MARGIN, Budgets, CostTerms
from megaseq.plan.given import run_for
from megaseq.plan.layer_terms import all_layer_terms
from megaseq.plan.layers import kept_attention_bytes
from megaseq.plan.mesh import Precision
from megaseq.plan.phases import KEPT, KEPT_HOST, KEPT_PINNED, _phases, evaluate
from megaseq.plan.planner import plan_from_config

QWEN = "recipes/qwen3-30b-a3b-lora.yaml"


@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "gpt-oss-tiny", "kimi-linear-tiny"])
def test_kept_bytes_are_the_runtimes(preset):
    """float32 on the CPU (compute and log-sum-exp both 4 bytes): what the kept SDPA calls of one step hold is the
    planned bytes of the kept layers (with sinks, a few rows more: each span's dummy first query, a sliding
    layer's queries padded to whole blocks)."""
    spec = get_preset(preset)
    B, S = 2, 48
    model = build_model(spec, dtype=torch.float32, seed=0)
    parallelize(model, MemorySettings(recompute=True, keep_attention_layers=spec.num_layers))
    ids = torch.randint(0, spec.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    kept_attention.STATS.reset()
    with dispatch.override("sink_attention", "torch_reference", sink_mod.sink_attention_sdpa), \
            dispatch.override("attention", "torch_reference", attn_mod.attention_sdpa):
        model(ids).float().sum().backward()
    prec = Precision(compute=4, f32=4)
    planned = sum(kept_attention_bytes(spec, kind, B * S, prec) for kind in spec.layer_types)
    got = kept_attention.STATS.bytes_kept
    assert kept_attention.STATS.kept > 0
    assert planned <= got <= 1.02 * planned if spec.attention_sinks else got == planned, (got, planned)


def _plan(seq_len: str, budget: str = "auto", keep: int | None = None):
    """The recipe's plan; with ``keep``: recompute forced, the last ``keep`` layers kept."""
    over = [f"data.seq_len={seq_len}", f"memory.gpu_budget={budget}"]
    if keep is not None:
        over += ["memory.auto=false", "memory.recompute=true", f"memory.keep_attention_layers={keep}"]
    return plan_from_config(load_config(QWEN, over), world_size=1)


def test_held_from_forward_to_backward():
    """Qwen3-30B-A3B LoRA at 32K: at the loss every kept layer's bytes are held; a tiny model's phases: in the
    backward of the first layer none are (the last layers' are freed first), in the last layer's all but its
    own (its own are its rerun's saved output)."""
    spec = load_config(QWEN, []).model.name
    plans = {k: _plan("32K", keep=k) for k in (0, 1, 12, 48)}
    per_layer = kept_attention_bytes(get_preset("qwen3-moe-tiny").replace(
        num_attention_heads=32, head_dim=128), "attention", 32768, Precision())
    assert spec and per_layer == 32768 * (2 * 32 * 128 + 4 * 32)
    for k in (1, 12, 48):
        assert plans[k].phases["loss"] - plans[0].phases["loss"] == k * per_layer
    tiny = get_preset("qwen3-moe-tiny")
    L = tiny.num_layers
    run = run_for(tiny, 4096, {"recompute": True, "keep_attention_layers": L})
    phases = {name: comps for name, comps, _ in _phases(run, all_layer_terms(run))}
    one = kept_attention_bytes(tiny, "attention", 4096, run.prec)
    first = next(c for n, c in phases.items() if n.startswith("backward, layer 0 "))
    last = next(c for n, c in phases.items() if n.startswith(f"backward, layer {L - 1} "))
    assert first["kept attention outputs"] == 0 and last["kept attention outputs"] == (L - 1) * one
    assert phases["loss"]["kept attention outputs"] == L * one


def test_the_planner_keeps_as_many_as_fit():
    """Qwen3-30B-A3B LoRA at 32K: on an H200 every layer keeps on the GPU; within a tighter budget fewer, the plan
    with them alone within 95% of it and one more layer beyond it; the layers before them keep in host memory."""
    plan = _plan("32K")
    assert plan.memory["recompute"] and plan.memory["keep_attention_layers"] == 48
    assert plan.memory["keep_attention_host_layers"] == 0
    plan = _plan("32K", budget="96G")
    host = plan.memory["keep_attention_host_layers"]
    k = plan.memory["keep_attention_layers"] - host  # on the GPU
    assert plan.fits and 0 < k < 48 and k + host == 48, plan.memory
    room = plan.gpu_budget * (1 - KEEP_SELECTION_MARGIN)
    over = [f"memory.{n}={v}" for n, v in plan.memory.items()] + ["memory.auto=false", "data.seq_len=32K",
                                                                 "memory.gpu_budget=96G"]
    for n, fits in ((k, True), (k + 1, False)):
        cfg = load_config(QWEN, over + [f"memory.keep_attention_layers={n}", "memory.keep_attention_host_layers=0"])
        assert (plan_from_config(cfg, world_size=1).peak_gpu <= room) == fits, n


def test_recompute_costs_less_by_the_kept_attention_forwards(monkeypatch):
    """Recompute's cost with every layer kept is one forward less the attention cores' forward; with the broken
    cost (nothing saved) it would not fall."""
    tiny = get_preset("qwen3-moe-tiny")
    L = tiny.num_layers
    run = run_for(tiny, 4096, {"recompute": True})
    t = CostTerms.of(run)
    plain = fixes.FIXES["recompute"].cost(run, t)
    kept_run = replace(run, memory=run.memory.replace(keep_attention_layers=L))
    cores = t.sf.cores / 3  # one forward of the attention cores (every layer of this model is attention)
    assert plain == pytest.approx(t.sf.layers_forward / t.sf.total)
    assert plain - fixes.FIXES["recompute"].cost(kept_run, t) == pytest.approx(cores / t.sf.total)
    monkeypatch.setattr(fixes, "kept_attention_flops", lambda run, k: 0.0)
    assert fixes.FIXES["recompute"].cost(kept_run, t) == pytest.approx(plain)


def test_no_keep_without_sdpa_attention():
    """A model without SDPA attention layers (GLM-5's DSA, KDA) keeps nothing: its layers hold no bytes for it."""
    spec = get_preset("glm5-flash-tiny")
    prec = Precision()
    assert all(kept_attention_bytes(spec, k, 1024, prec) == 0 for k in spec.layer_types)
    assert base_settings(None, 1024).keep_attention_layers == 0
    assert Budgets().gpu_bytes > 0 and C.GIB > 0


def test_host_bytes_are_the_runtimes():
    """float32 on the CPU: the pinned pool the runtime carves for the host-kept layers (each kept tensor at an aligned
    offset) is the planned host line, and what they move is the planned bytes of those layers."""
    spec = get_preset("qwen3-moe-tiny")
    L, B, S = spec.num_layers, 2, 48
    model = build_model(spec, dtype=torch.float32, seed=0)
    done = parallelize(model, MemorySettings(recompute=True, keep_attention_layers=L, keep_attention_host_layers=L - 1))
    ids = torch.randint(0, spec.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    with dispatch.override("attention", "torch_reference", attn_mod.attention_sdpa):
        model(ids).float().sum().backward()
    run = run_for(spec, S, {"recompute": True, "keep_attention_layers": L, "keep_attention_host_layers": L - 1},
                  batch_size=B, model_dtype="fp32")
    assert (run.prec.compute, run.prec.f32) == (4, 4)
    planned = evaluate(run).host_per_gpu[KEPT_PINNED]
    store = done.kept_host
    assert store.host_bytes == store.need == planned > 0, (store.host_bytes, store.need, planned)
    per_layer = kept_attention_bytes(spec, "attention", B * S, run.prec)
    assert store.bytes_out == (L - 1) * per_layer == fixes.kept_host_bytes(run)
    # each tensor aligned: more than the bytes moved (the tiny model's tensors are not multiples of 512 bytes)
    assert planned > (L - 1) * per_layer


def test_the_gpu_holds_at_most_two_host_kept_layers():
    """A tiny model with every layer kept in host memory: no phase holds more than two host-kept layers' outputs on
    the GPU (a layer's forward: its own and the one before's; a layer's backward: the one prefetched, its own being
    its rerun's), none of the GPU-kept component, and the pool holds every layer's."""
    tiny = get_preset("qwen3-moe-tiny")
    L = tiny.num_layers
    run = run_for(tiny, 4096, {"recompute": True, "keep_attention_layers": L, "keep_attention_host_layers": L})
    one = kept_attention_bytes(tiny, "attention", 4096, run.prec)
    phases = {name: comps for name, comps, _ in _phases(run, all_layer_terms(run))}
    assert all(c.get(KEPT, 0) == 0 for c in phases.values())
    for name, c in phases.items():
        i = int(name.split("layer ")[1].split()[0]) if "layer " in name else None
        want = {"forward": min(2, (i or 0) + 1) * one, "backward": (1 if i else 0) * one}.get(name.split(",")[0])
        if name == "loss":
            want = one
        if want is not None:
            assert c[KEPT_HOST] == want, (name, c[KEPT_HOST], want)
    assert max(c.get(KEPT_HOST, 0) for c in phases.values()) == 2 * one
    assert evaluate(run).host_per_gpu[KEPT_PINNED] >= L * one


def test_qwen_32k_on_80gb_keeps_in_host_memory():
    """Qwen3-30B-A3B LoRA at 32K within 79 GiB: no layer's attention output fits on the GPU with 5% to spare, so
    the plan keeps them in pinned host memory (their copies hide behind the compute), fits, counts their pool in
    host memory and at most two layers' worth on the GPU, and recompute costs less than without them."""
    plan = _plan("32K", budget="79G")
    m = plan.memory
    host = m["keep_attention_host_layers"]
    assert plan.fits and m["recompute"] and 0 < host <= m["keep_attention_layers"], m
    per_layer = 32768 * (2 * 32 * 128 + 4 * 32)
    comps = {name: (gpu, pinned) for name, gpu, pinned, _ in plan.components}
    assert comps[f"host: {KEPT_PINNED}"][1] == host * per_layer  # 256 MiB + 4 MiB: aligned already
    assert comps.get(KEPT_HOST, (0, 0))[0] <= 2 * per_layer
    recompute_cost = dict((f[0], f[1]) for f in plan.fixes)["recompute"]
    without = _plan("32K", budget="79G", keep=0)
    assert recompute_cost < dict((f[0], f[1]) for f in without.fixes)["recompute"]


def test_host_keeping_needs_copies_that_hide(monkeypatch):
    """With a host link too slow for the copies to hide behind the compute the planner keeps nothing in host memory
    (the 79 GiB plan then keeps no layer), and recompute's cost for forced host-kept layers grows by the excess."""
    monkeypatch.setattr(fixes, "PINNED_BYTES_PER_S", 1e8)
    plan = _plan("32K", budget="79G")
    assert plan.memory["keep_attention_host_layers"] == 0, plan.memory
    tiny = get_preset("qwen3-moe-tiny")
    L = tiny.num_layers
    run = run_for(tiny, 32768, {"recompute": True, "keep_attention_layers": L, "keep_attention_host_layers": L})
    t = CostTerms.of(run)
    excess = fixes.kept_host_excess(run, t.step_s)
    gpu_kept = replace(run, memory=run.memory.replace(keep_attention_host_layers=0))
    assert excess > 0
    assert fixes.FIXES["recompute"].cost(run, t) == pytest.approx(fixes.FIXES["recompute"].cost(gpu_kept, t)
                                                                  + excess / t.step_s)


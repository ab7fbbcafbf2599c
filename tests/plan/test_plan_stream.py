"""The planner's side of the frozen base streamed from host memory (``plan/stream.py``, ``memory.stream_base``):
the bytes it moves to the host and keeps on the GPU are the runtime's, and the plan picks it only where the
resident base does not fit. Broken variant that must fail: the planner without the last-resort rule picks the
stream where the resident base fits."""

from __future__ import annotations

import pytest
import torch

from lora_helpers import settings
from megaseq.config import MemorySettings, load_config
from megaseq.models.build import build_model
from megaseq.models.presets import get_preset
from megaseq.models.registry import parallelize
from megaseq.plan import components as C
from megaseq.plan import fixes, stream
from megaseq.plan.choice import base_settings
from megaseq.plan.params import trained_counts
from megaseq.plan.phases import evaluate
from megaseq.plan.planner import plan_from_config
from megaseq.plan.run import Run

KIMI = "recipes/kimi-linear-48b-a3b-lora.yaml"


@pytest.mark.parametrize("name", ["qwen3-moe-tiny", "kimi-linear-tiny"])
def test_streamed_bytes_are_the_runtimes(name: str) -> None:
    """A bf16-stored frozen base (fp32 adapters) streamed on the CPU: per layer the planned host bytes are the
    bytes the streamer holds but for the layer's fp32 frozen tensors (the routers the plan keeps on the GPU,
    ``fp32_kept``; Kimi's 64-element ``dt_bias``, which the plan counts in bf16); the planned GPU parameters are
    what stays plus the kept ones; two layers in flight."""
    spec = get_preset(name)
    adapters = settings(targets="all", rank=4, trainable="norm.weight", frozen_dtype="bf16")
    model = build_model(spec, dtype=torch.float32, seed=0)
    done = parallelize(model, MemorySettings(stream_base=True), None, adapters)
    counts = C.count_params(spec)
    counts.trained = trained_counts(spec, adapters)
    memory = base_settings(None, 64).replace(stream_base=True)
    run = Run(spec=spec, seq_len=64, batch=1, mesh=C.Mesh(), model_dtype="bf16", memory=memory.to_dict(),
              counts=counts)
    planned = stream.streamed_layer_bytes(run)
    kept = [min(k, d) * 4 for k, (d, _) in zip(counts.fp32_kept, counts.trained.frozen_layers, strict=True)]
    held = [sum(p.numel() * p.element_size() for p in rec.params) for rec in done.streamer.layers]
    fp32 = [sum(4 * p.numel() for p in rec.params if p.dtype == torch.float32) for rec in done.streamer.layers]
    assert all(k <= h - p <= f for p, k, h, f in zip(planned, kept, held, fp32, strict=True)), (planned, held)
    streamed = {id(p) for rec in done.streamer.layers for p in rec.params}
    resident = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in streamed)
    terms = stream.gpu_terms(run, C.param_bytes(counts, C.Mesh(), run.prec))
    assert terms["parameters"] == resident + sum(kept)
    assert terms["streamed base (2 layers in flight)"] == 2 * max(planned)
    ev = evaluate(run)
    assert ev.host_per_gpu["streamed frozen base (pinned)"] == sum(planned)
    assert ev.breakdown.get("streamed base (2 layers in flight)") == 2 * max(planned)


def _plan(seq_len: str):
    cfg = load_config(KIMI, [f"data.seq_len={seq_len}"])
    return plan_from_config(cfg, world_size=1)


def _fix_names(plan) -> list[str]:
    return [f[0] for f in plan.fixes]


def test_chosen_only_where_the_resident_base_does_not_fit() -> None:
    """Kimi-Linear-48B-A3B LoRA on one H200 (published shapes): at 64K the resident base fits and the plan keeps
    it; at 1M nothing fits without the stream, and with it the plan fits (sequence segments beside it), its host
    bytes the base's ~90 GiB within the host."""
    short = _plan("64K")
    assert short.fits and "stream_base" not in _fix_names(short)
    long = _plan("1M")
    assert long.fits and "stream_base" in _fix_names(long) and "model_segments" in _fix_names(long)
    host = dict((k, h) for k, _, h, _ in long.components)["host: streamed frozen base (pinned)"]
    assert 85 * C.GIB < host < 100 * C.GIB


def test_without_the_last_resort_rule_the_stream_is_chosen_too_early(monkeypatch) -> None:
    """The broken planner (streaming sorted by its cost alone) streams the base at 128K, where it fits resident."""
    resident = _plan("128K")
    assert resident.fits and "stream_base" not in _fix_names(resident)
    monkeypatch.setattr(fixes, "LAST_RESORT", ())
    assert "stream_base" in _fix_names(_plan("128K"))


def test_segments_cost_more_copies() -> None:
    """Sequence segments stream the base three times a segment: the copy time the compute cannot hide grows
    with their number, and a pass never costs less than nothing."""
    plan_run = Run(spec=get_preset("kimi-linear-tiny"), seq_len=4096, batch=1, mesh=C.Mesh(), model_dtype="bf16",
                   memory=base_settings(None, 4096).replace(stream_base=True).to_dict(),
                   counts=C.count_params(get_preset("kimi-linear-tiny")))
    plan_run.counts.trained = trained_counts(plan_run.spec, settings(targets="all", rank=4, frozen_dtype="bf16"))
    costs = [stream.excess_seconds(plan_run, n) for n in (1, 4, 16)]
    assert 0 <= costs[0] <= costs[1] <= costs[2] and costs[2] > 0


def test_forcing_it_on_a_full_fine_tuning_is_refused() -> None:
    """``megaseq plan`` with the setting forced and nothing frozen: one message naming it and the fix."""
    cfg = load_config(KIMI, ["lora.rank=0", "memory.auto=false", "memory.stream_base=true", "data.seq_len=8K"])
    with pytest.raises(ValueError, match=r"memory.stream_base .*--lora.rank"):
        plan_from_config(cfg, world_size=1)

"""Expert parallelism with FSDP in the planner: full fine-tuning of the published DeepSeek-V3 config at 32K on 64
H200s (8 a host). With ep 64 and FSDP over all 64 GPUs each GPU holds its 4 experts a layer whole and 1/64 of
everything else: the GPU peak fits with the optimizer offloaded, whose host state (fp32 master, moments and
gradient of ~10.5B parameters a GPU) overflows a 1 TB host: ``megaseq plan`` names that component. The
parameter bytes are checked against the count by hand (experts / ep whole, the rest / 64); the planner's terms
against what each rank holds are in tests/parallel/test_ep_fsdp.py."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from megaseq.plan import components as C
from megaseq.plan.mesh import GIB, Mesh
from megaseq.plan.planner import plan

ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def spec():
    from megaseq.models.spec import from_hf_config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its multi-token-prediction layer is not modelled: said once
        return from_hf_config(ROOT / "recipes" / "deepseek-v3" / "config.json")


def test_deepseek_v3_full_fine_tuning_on_64_h200_is_held_back_by_host_memory(spec):
    mesh = Mesh(dp=1, ep=64, cp=1, fsdp="dp_cp", gpus_per_host=8)
    p = plan(spec, 32768, mesh, weights="bf16")
    assert not p.fits
    assert p.peak_gpu <= p.gpu_budget  # the GPU side fits ...
    assert p.memory["optimizer_offload"]  # ... with the optimizer state in host memory,
    host = {name: h for name, _, h, _ in p.components if h}
    assert max(host, key=host.get) == "host: optimizer state (OffloadStreamAdamW)"
    assert p.peak_host > p.host_budget and "host memory" in p.advice  # which overflows the host
    counts = C.count_params(spec)
    experts = sum(x for _, x, _ in counts.layers)
    gpu = dict((name, g) for name, g, _, _ in p.components)
    # bf16: the experts / ep whole, the rest / 64, the routers (fp32 in a bf16 model) whole
    want = 2 * (experts // 64 + (counts.total - experts - counts.kept) // 64) + 4 * counts.kept
    assert abs(gpu["parameters"] / want - 1) < 1e-3, (gpu["parameters"] / GIB, want / GIB)
    assert abs(p.peak_host / 8 / (16 * counts.total / 64) - 1) < 0.05  # 16 B a parameter, 8 GPUs a host


def test_experts_not_split_enough_are_named(spec):
    """ep 8 x cp 8: each GPU holds 32 experts a layer whole, which FSDP does not shard: the advice says so."""
    p = plan(spec, 32768, Mesh(dp=1, ep=8, cp=8, fsdp="dp_cp", gpus_per_host=8), weights="bf16")
    assert not p.fits and p.peak_gpu > p.gpu_budget
    assert "--parallel.ep" in p.advice and "FSDP shards the rest" in p.advice


def test_expert_gradients_all_reduce_is_counted(spec):
    """ep 8 x dp 8: each expert slice is on 8 GPUs, its gradient summed over them after the backward."""
    p = plan(spec, 32768, Mesh(dp=8, ep=8, cp=1, fsdp="dp", gpus_per_host=8), weights="bf16")
    grads = p.comm["expert_grads"]
    experts = sum(x for _, x, _ in C.count_params(spec).layers) // 8
    assert grads["ranks"] == 8 and grads["bytes"] == pytest.approx(experts * 2 * 2 * 7 / 8, rel=1e-6)


@pytest.mark.slow  # the advisor's grid, planned twice a setting (~30 s)
def test_megaseq_plan_names_what_keeps_full_fine_tuning_off_64_h200():
    from megaseq.plan.advisor import Hardware, Source, advise

    src = Source(str(ROOT / "recipes" / "deepseek-v3" / "config.json"), [])
    a = advise(src, Hardware(64), 32768)
    assert a.choice is None
    miss = [x for x in a.nearest if x.startswith("full fine-tuning comes closest")]
    assert miss and "ep 64" in miss[0] and "optimizer state (OffloadStreamAdamW)" in miss[0], a.nearest

"""The planner with FSDP and bf16 weights on the published config.json files (tests/fixtures/configs), through
``megaseq plan DIR``: what fits on H200s and what does not, the advice naming the settings the runtime has,
and the counts the formulas share with the runtime."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megaseq.cli.main import main
from megaseq.models.build import build_model
from megaseq.models.presets import get_preset
from megaseq.models.spec import from_hf_config
from megaseq.plan import Mesh, plan
from megaseq.plan import components as C
from megaseq.plan.mesh import GIB
from megaseq.plan.planner import Budgets

CONFIGS = Path(__file__).parents[1] / "fixtures" / "configs"
K = 1024


def _plan_cli(capsys, *args: str) -> tuple[int, str]:
    code = main(["plan", *args])
    return code, " ".join(capsys.readouterr().out.split())  # the table may wrap long lines


def test_qwen3_30b_fits_at_128k_on_8_h200_with_fsdp_and_bf16_weights(capsys):
    model = str(CONFIGS / "qwen3-30b-a3b")  # the checkpoint directory is the config
    code, out = _plan_cli(capsys, model, "--seq-len", "128K", "--gpus", "8", "--parallel.fsdp", "dp_cp",
                          "--model.weights", "bf16")
    assert code == 0 and "Fits" in out and "FSDP over dp x cp, bf16 weights" in out
    assert "FSDP over 8 ranks: 2 all-gathers of every layer and 1 reduce-scatters" in out
    # today's replicated fp32 state does not fit at any length; the advice names what would
    code, out = _plan_cli(capsys, model, "--seq-len", "128K", "--gpus", "8")
    assert code == 1 and "--parallel.fsdp dp_cp" in out and "--model.weights bf16" in out


def test_a_directory_without_a_config_is_refused(tmp_path, capsys):
    code = main(["plan", str(tmp_path)])
    assert code == 2 and "neither a YAML recipe nor a checkpoint directory" in capsys.readouterr().err


@pytest.mark.parametrize("name, gpus, seq, fits", [
    ("qwen3-235b-a22b", 16, 128 * K, False),  # the offloaded optimizer needs 1.9 TB per host
    ("qwen3-235b-a22b", 32, 128 * K, True),
    ("glm-5.3-flash", 32, 1 << 20, False),  # FSDP buffers: one layer's 7.4B gathered parameters
    ("glm-5.3-flash", 64, 1 << 20, True),
])
def test_the_large_models_with_fsdp_alone(name, gpus, seq, fits):
    spec = from_hf_config(CONFIGS / name)
    p = plan(spec, seq, Mesh(cp=gpus, gpus_per_host=8, fsdp="dp_cp"), Budgets(), weights="bf16")
    assert p.fits == fits, p.advice
    if fits:
        assert p.peak_gpu <= 139.8 * GIB and "FSDP buffers" in dict((c[0], c[1]) for c in p.components)
    else:
        assert "does not fit" in p.advice
        assert name != "qwen3-235b-a22b" or p.peak_gpu <= 139.8 * GIB  # its GPUs fit, its hosts do not
        if p.peak_gpu <= 139.8 * GIB:  # only the host overflows: the advice says so, not a GPU peak "over"
            assert p.advice.startswith("does not fit in host memory") and "host memory: needs" in p.advice
            assert "GiB > " not in p.advice, p.advice


def test_the_fp32_tensors_of_a_bf16_model_are_what_the_planner_keeps_whole():
    for preset in ("glm5-flash-tiny", "qwen3-moe-tiny"):
        spec = get_preset(preset)
        model = build_model(spec, dtype=torch.bfloat16, device="meta")
        kept = sum(p.numel() for p in model.parameters() if p.dtype == torch.float32)
        counts = C.count_params(spec)
        assert counts.kept == kept, preset
        assert counts.total == sum(p.numel() for p in model.parameters()), preset
    assert C.count_params(get_preset("glm5-flash")).kept > 0 and C.count_params(get_preset("qwen3-moe-tiny")).kept == 0


def test_bf16_weights_halve_weights_and_gradients_but_keep_the_fp32_state():
    spec = get_preset("glm5-flash-1gpu")
    counts, mesh = C.count_params(spec), Mesh()
    fp32, bf16 = C.precision_for("bf16", "fp32"), C.precision_for("bf16", "bf16")
    P, K_ = counts.total, counts.kept
    assert C.param_bytes(counts, mesh, fp32) == 4 * P
    assert C.param_bytes(counts, mesh, bf16) == 2 * (P - K_) + 4 * K_
    # the state the optimizer holds: 8 B moments with fp32 weights; 12 B with bf16 weights (the master too)
    T = counts.trainable
    assert C.optimizer_gpu_bytes(counts, mesh, bf16, False, 1) == 12 * T
    # a bf16-weight run that sums several backward passes (segments) keeps the sum in fp32
    assert C.grad_bytes(1000, mesh, bf16, 0, accumulate=True) == 4000 and C.grad_bytes(1000, mesh, bf16, 0) == 2000

"""Which implementation each op of ``model.kernels fast`` picks in a GPU run's dtypes, checked on the CPU.

A GPU step in bf16 with fp32 weights runs under autocast: fp32 streams and norms beside bf16 block outputs. A
kernel whose ``supports`` refuses such a mix falls back to the reference silently (only the dispatcher's table
shows it), and the step is timed slower than the fast set claims. A merge kernel that asks for one dtype, for
instance, runs the reference batched GEMM for 9 of glm5-flash-1gpu's 16 hyper-connection merges: their
attention and dense MLP outputs are bf16 beside the fp32 streams.

Here the whole forward of each family's tiny model runs on the CPU under bf16 autocast, fp32 weights, with the
fast set preferred; ``triton_supports`` (the device check) is made to accept the CPU and every fast
implementation is replaced by its op's reference, so only the ``supports`` rules decide and nothing runs in
Triton. Every call of the Triton-only ops must then pick the fast implementation. The sparse MLA and indexer
top-k kernels keep their own device rules (the CPU interpreter's), so they are left out here; the GPU tests
cover them.
"""

from __future__ import annotations

import collections
import contextlib
import importlib

import pytest
import torch

from megaseq.models.build import build_model
from megaseq.ops import dispatch, kernels

# ops the fast set holds to on a GPU whatever the dtypes of a bf16-autocast step (those of FAST_GPU that have
# no device rule of their own)
HELD = ("hc_mix", "hc_weights", "hc_collapse", "hc_merge", "swiglu", "rms_norm", "moe_permute", "moe_combine")
MODULES = ("mhc.mix_fused", "mhc.mix_triton", "mhc.weights_triton", "mhc.streams_triton", "moe_glue.fused",
           "rms_norm.fused", "swiglu.fused")


def _spec(family: str):
    if family == "glm5":
        from megaseq.models.glm5.spec import glm5_flash_tiny
        return glm5_flash_tiny()
    from megaseq.models.qwen3_moe.spec import qwen3_moe_tiny
    return qwen3_moe_tiny()


def fast_choices(spec, monkeypatch) -> collections.Counter:
    """(op, implementation, reason) -> calls over one forward, as a bf16-autocast GPU step would choose."""
    for name in MODULES:
        module = importlib.import_module(f"megaseq.ops.{name}")
        if hasattr(module, "triton_supports"):
            monkeypatch.setattr(module, "triton_supports", lambda *a, **k: None)
    model = build_model(spec, dtype=torch.float32, seed=0)
    seen: collections.Counter = collections.Counter()
    select = dispatch.select

    def counting(op, layer, *args, **kwargs):
        impl = select(op, layer, *args, **kwargs)
        rec = next(r for lay, r in dispatch.records() if lay == layer and r.op == op and r.impl == impl.name)
        seen[(op, impl.name, rec.reason)] += 1
        return impl

    monkeypatch.setattr(dispatch, "select", counting)
    with contextlib.ExitStack() as stack:
        for op, name in kernels.FAST_GPU.items():
            impls = dispatch.implementations(op)
            if op in HELD and name in impls:
                reference = next(i for i in impls.values() if i.reference)
                stack.enter_context(dispatch.override(op, name, reference.fn))
        stack.enter_context(dispatch.configured(preferred=kernels.preferred_kernels("cuda", "fast")))
        stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
        dispatch.reset_records()
        model(torch.randint(0, spec.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0)))
    return seen


@pytest.mark.parametrize("family", ["glm5", "qwen3_moe"])
def test_fast_set_runs_its_kernels_under_autocast(family, monkeypatch):
    seen = fast_choices(_spec(family), monkeypatch)
    ran = {op for op, _, _ in seen}
    assert ran & set(HELD), f"no fast op called: {sorted(ran)}"
    wrong = {k: n for k, n in seen.items() if k[0] in HELD and k[1] != kernels.FAST_GPU[k[0]]}
    assert not wrong, "fast ops fell back:\n" + "\n".join(f"{n} x {op} ran {impl}: {why}"
                                                          for (op, impl, why), n in wrong.items())


def test_merge_refusing_a_bf16_block_output_is_caught(monkeypatch):
    """A rule asking for one dtype (y and the streams alike) fails the check above."""
    from megaseq.ops.mhc import streams_triton as streams

    rule = streams.hc_merge_triton_supports

    def one_dtype(post, comb, y, residual):
        if y.dtype != residual.dtype:
            return f"y {y.dtype} vs residual {residual.dtype}"
        return rule(post, comb, y, residual)

    impl = dispatch.implementations("hc_merge")["triton"]
    monkeypatch.setattr(impl, "supports", one_dtype)
    seen = fast_choices(_spec("glm5"), monkeypatch)
    fell = sum(n for (op, name, _), n in seen.items() if op == "hc_merge" and name == "torch")
    merged = sum(n for (op, _, _), n in seen.items() if op == "hc_merge")
    assert 0 < fell < merged, seen  # the attention and dense-MLP merges fall back, the MoE ones do not


def test_records_keep_each_implementation_a_layer_ran():
    """A layer whose calls ran two implementations keeps both rows: the fallback is not overwritten by a later
    call that ran the fast one, and ``fallback_summary`` names it."""
    op = "test_kernel_choices_op"
    dispatch.register(op, "ref", reference=True)(lambda x: x)
    dispatch.register(op, "fast", supports=lambda x: "float64" if x.dtype == torch.float64 else None,
                      opt_in=True)(lambda x: x)
    dispatch.reset_records()
    with dispatch.configured(preferred={op: ["fast"]}):
        dispatch.select(op, "L", torch.zeros(2, dtype=torch.float64))
        dispatch.select(op, "L", torch.zeros(2))
        dispatch.select(op, "L", torch.zeros(2))
        rows = [(r.impl, r.calls) for layer, r in dispatch.records() if r.op == op]
        summary = dispatch.fallback_summary({op: ["fast"]})
    assert rows == [("ref", 1), ("fast", 2)], rows
    assert [(g["ran"], g["layers"], g["calls"]) for g in summary] == [("ref", ["L"], 1)], summary
    assert dispatch.describe_fallback(summary[0]) == f"{op} ran ref, not fast, in L (1 calls): fast: float64"


def _prefer_triton_norm(device_type: str, kernels_set: str) -> dict[str, list[str]]:
    """A preference the CPU cannot honour (Triton's RMSNorm): every call falls back, as a refused kernel would
    (for the device, or where Triton is not installed)."""
    return {"rms_norm": ["triton"]}


def test_bench_row_lists_the_fallbacks(monkeypatch):
    from megaseq.bench import measure
    from megaseq.config import build_config
    from megaseq.train import build

    monkeypatch.setattr(build, "preferred_kernels", _prefer_triton_norm)  # the dispatcher's (kernels_for)
    monkeypatch.setattr(measure, "preferred_kernels", _prefer_triton_norm)  # the row's summary
    cfg = build_config(None, ["model.name=qwen3-moe-tiny", "data.kind=random", "model.dtype=fp32",
                              "train.device=cpu"])
    row = measure.measure_megaseq(cfg, 64, 1, "random")
    assert row["status"] == "ok", row
    [g] = row["kernel_fallbacks"]
    assert g["op"] == "rms_norm" and g["preferred"] == "triton" and g["ran"] != "triton", g
    # refused for the device, or for want of Triton (CI's CPU venv)
    assert g["reason"].startswith("triton: ") and g["calls"] > 0 and g["layers"], g


def test_run_reports_the_fallbacks_after_its_first_step(monkeypatch, tmp_path, capsys):
    import yaml

    from megaseq.cli.main import main
    from megaseq.train import build

    monkeypatch.setattr(build, "preferred_kernels", _prefer_triton_norm)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"name": "qwen3-moe-tiny", "dtype": "fp32"}, "data": {"kind": "random", "seq_len": 32},
        "train": {"steps": 2, "run_dir": str(tmp_path / "run"), "export_hf": False, "eval_after": False,
                  "device": "cpu"},
        "log": {"progress": False, "tensorboard": False}}))
    assert main(["train", str(recipe)]) == 0
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if "rms_norm ran" in x]
    assert len(lines) == 1 and "model.kernels fast: rms_norm ran" in lines[0] and ": triton: " in lines[0], err


def test_the_fast_set_is_the_default_and_base_names_the_other():
    from megaseq.config import ModelConfig
    from megaseq.ops.kernels import FAST_FALLBACKS, FAST_GPU, preferred_kernels

    assert ModelConfig().kernels == "fast"
    assert ModelConfig(kernels="default").kernels == "base"  # the alias that configs of older run directories hold
    with pytest.raises(ValueError, match="model.kernels must be fast or base"):
        ModelConfig(kernels="fastest")
    want = {op: [name, *FAST_FALLBACKS.get(op, ())] for op, name in FAST_GPU.items()}
    assert preferred_kernels("cuda", "fast") == want
    assert preferred_kernels("cuda", "fast")["hc_mix"] == ["triton", "torch_fused"]
    assert preferred_kernels("cuda", "base") == {} and preferred_kernels("cpu", "fast") == {}

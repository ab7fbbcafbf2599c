"""What megaseq writes and reads at the edges: a full disk during the HF export, a FASTA record without a
sequence, the modes of the files a run writes, the kernels a plan names, and a checkpoint's 0-size shared
expert. Each is one clear outcome: one message naming the file and the fix, or nothing to say."""

from __future__ import annotations

import errno
import os
import stat
import warnings

import pytest
import torch

from megaseq.models.build import build_model
from megaseq.models.hf_io import export_hf_checkpoint, load_hf_checkpoint
from megaseq.models.presets import get_preset

ENOSPC_SAFETENSORS = ('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left '
                      'on device" })')


def _tiny(name: str = "qwen3-moe-tiny"):
    spec = get_preset(name)
    return spec, build_model(spec, dtype=torch.float32, seed=0)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# ---- a full disk during the HF export --------------------------------------------------------------------
@pytest.mark.parametrize("raised", ["safetensors", "oserror"])
def test_a_full_disk_during_the_export_is_one_message_naming_it(raised, tmp_path, monkeypatch):
    import safetensors.torch
    from safetensors import SafetensorError

    from megaseq.cli.main import os_error_message

    def full_disk(tensors, filename, metadata=None):
        if raised == "safetensors":
            raise SafetensorError(ENOSPC_SAFETENSORS)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    spec, model = _tiny()
    out = tmp_path / "run" / "hf"
    with pytest.raises(OSError) as info:
        export_hf_checkpoint(model, spec, out)
    e = info.value
    assert e.errno == errno.ENOSPC and str(out) in e.filename
    message = os_error_message(e)
    assert "\n" not in message and "No space left on device" in message and "free disk space" in message
    assert not out.exists() and list((tmp_path / "run").iterdir()) == []  # no partial export left behind


def test_another_safetensors_error_is_not_disguised(tmp_path, monkeypatch):
    import safetensors.torch
    from safetensors import SafetensorError

    monkeypatch.setattr(safetensors.torch, "save_file",
                        lambda *a, **k: (_ for _ in ()).throw(SafetensorError("tensor is not contiguous")))
    spec, model = _tiny()
    with pytest.raises(SafetensorError, match="contiguous"):
        export_hf_checkpoint(model, spec, tmp_path / "hf")


# ---- a FASTA record with a header and no sequence --------------------------------------------------------
def test_a_header_without_sequence_names_the_file_and_record(tmp_path):
    from megaseq.config import DataConfig
    from megaseq.data.fasta import load_dna_split

    fa = tmp_path / "empty_record.fa"
    fa.write_text(">chrA some description\n")
    with pytest.raises(ValueError) as info:
        load_dna_split(DataConfig(train=[str(fa)]))
    msg = str(info.value)
    assert "empty_record.fa" in msg and "'chrA'" in msg and "no sequence" in msg
    assert "heldout_records" not in msg


# ---- file modes ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_outputs_get_the_mode_open_would_give(umask, tmp_path):
    from megaseq.eval.report import save_figure, write_atomic

    previous = os.umask(umask)
    try:
        spec, model = _tiny()
        out = export_hf_checkpoint(model, spec, tmp_path / "hf")
        write_atomic(tmp_path / "report.json", "{}\n")
        from matplotlib.figure import Figure

        fig = Figure()
        fig.add_subplot().plot([0, 1], [1, 0])
        save_figure(fig, tmp_path / "loss_curve.png")
        (tmp_path / "plain.txt").write_text("x")  # what open() gives: the reference
    finally:
        os.umask(previous)
    want = _mode(tmp_path / "plain.txt")
    assert want == 0o666 & ~umask
    for f in (out / "model.safetensors", out / "config.json", tmp_path / "report.json", tmp_path / "loss_curve.png"):
        assert _mode(f) == want, (f.name, oct(_mode(f)))


def test_the_adapter_export_gets_the_default_mode(tmp_path):
    from megaseq.config import AdapterSettings, MemorySettings, build_config
    from megaseq.models.peft_io import WEIGHTS, export_adapter
    from megaseq.models.registry import parallelize

    spec, model = _tiny()
    cfg = build_config(overrides={"lora.rank": 2, "lora.targets": "q_proj,v_proj"})
    parallelize(model, MemorySettings(), None, AdapterSettings.of(cfg))
    out = export_adapter(model, spec, cfg.lora, tmp_path / "adapter")
    assert _mode(out / WEIGHTS) == _mode(out / "adapter_config.json") == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ---- the plan names only the model's kernels -------------------------------------------------------------
def test_the_plan_names_only_the_kernels_the_model_has():
    from megaseq.plan.planner import PLANNED_FAST_OPS, ops_of_model, plan

    qwen = plan(get_preset("qwen3-moe-tiny"), 4096, fast_ops=PLANNED_FAST_OPS)
    assert qwen.mesh["fast_kernels"] == ["linear_cross_entropy", "rms_norm", "swiglu"]
    glm = plan(get_preset("glm5-flash-tiny"), 4096, fast_ops=PLANNED_FAST_OPS)
    assert glm.mesh["fast_kernels"] == sorted(PLANNED_FAST_OPS)
    # every planned fast op belongs to some model's layers (a new one must be classified in ops_of_model)
    from megaseq.models.registry import FAMILY_PACKAGES, family_module

    seen = set()
    for fam in FAMILY_PACKAGES:
        for make in family_module(fam, "spec").PRESETS.values():
            seen |= ops_of_model(make())
    assert seen == PLANNED_FAST_OPS


# ---- a checkpoint's 0-size shared expert -----------------------------------------------------------------
def test_a_zero_size_shared_expert_loads_without_a_word(tmp_path):
    """transformers builds DeepSeek-V3's shared expert at ``moe_intermediate_size * n_shared_experts``: with
    ``n_shared_experts: 0`` it saves three empty tensors. They hold no weight and the model has no shared
    expert, which computes the same: they load silently. A non-empty stray tensor still warns."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    from megaseq.models.spec import from_hf_config, to_hf_config

    c = to_hf_config(get_preset("deepseek-v3-tiny"))
    c["n_shared_experts"] = 0
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**c))
    hf.save_pretrained(tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    empty = [k for k, t in tensors.items() if t.numel() == 0]
    assert len(empty) == 3 * (get_preset("deepseek-v3-tiny").mlp_types.count("moe"))
    spec = from_hf_config(tmp_path / "hf")
    assert spec.num_shared_experts == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_hf_checkpoint(tmp_path / "hf", spec=spec, dtype=torch.float32)
    tensors["model.layers.1.mlp.stray.weight"] = torch.ones(2, 2)
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.warns(UserWarning, match="1 checkpoint tensors have no place"):
        load_hf_checkpoint(tmp_path / "hf", spec=spec, dtype=torch.float32)


def test_qwen3_next_refuses_a_zero_size_shared_expert():
    from megaseq.models.spec import from_hf_config, to_hf_config

    c = to_hf_config(get_preset("qwen3-next-tiny"))
    c["shared_expert_intermediate_size"] = 0
    with pytest.raises(ValueError, match="shared_expert_intermediate_size = 0 is not supported"):
        from_hf_config(c)


# ---- what the planner offers, the runtime runs -----------------------------------------------------------
def test_fsdp_with_expert_parallelism_is_accepted_and_planned():
    """The trainer runs parallel.fsdp with parallel.ep > 1 (tests/parallel/test_ep_fsdp.py), so the config accepts
    it; the planner plans it: the routed experts whole on their GPU (E / ep of them), the rest sharded over all
    the GPUs, and never advises --parallel.ep 1 as a condition of FSDP."""
    from megaseq.config import build_config
    from megaseq.plan.mesh import Mesh
    from megaseq.plan.planner import plan

    for fsdp in ("dp", "dp_cp"):
        assert build_config(overrides={"parallel.fsdp": fsdp, "parallel.ep": 2}).parallel.ep == 2
    from pathlib import Path

    from megaseq.models.spec import from_hf_config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its multi-token-prediction layer is not modelled: said once
        spec = from_hf_config(Path(__file__).parents[2] / "recipes" / "deepseek-v3" / "config.json")
    p = plan(spec, 32768, Mesh(dp=1, ep=8, cp=8, gpus_per_host=8))
    assert not p.fits and "--parallel.fsdp" in p.advice  # the advice does talk about sharding the state
    assert "--parallel.ep 1" not in p.advice

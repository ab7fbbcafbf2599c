"""HF checkpoint round trips: transformers -> megaseq -> transformers, logits compared in float64."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megaseq.models.hf_io import export_hf_checkpoint, load_hf_checkpoint
from megaseq.models.qwen3_moe.model import Qwen3MoeModel
from megaseq.models.spec import from_hf_config
from megaseq.models.spec import to_hf_config as spec_to_hf_config

transformers = pytest.importorskip("transformers")
from test_moe import promote_hf_routers_  # noqa: E402
from test_qwen3_moe_parity import assert_close, hf_config, make_pair  # noqa: E402

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def qwen_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A tiny random Qwen3-MoE saved by transformers in small shards (per-expert keys on disk)."""
    hf, _ = make_pair(hf_config(), seed=51)
    path = tmp_path_factory.mktemp("qwen") / "hf"
    hf.save_pretrained(path, max_shard_size="20KB")
    return path, hf


def _ids(seed: int = 52) -> torch.Tensor:
    return torch.randint(0, 53, (2, 13), generator=torch.Generator().manual_seed(seed))


def _load_qwen(path: Path) -> Qwen3MoeModel:
    spec = from_hf_config(path)
    model = Qwen3MoeModel(spec).to(torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))  # anything not loaded would poison the logits
    return load_hf_checkpoint(path, model=model, spec=spec)


def test_load_sharded_qwen3_checkpoint(qwen_ckpt) -> None:
    path, hf = qwen_ckpt
    assert (path / "model.safetensors.index.json").is_file()
    ours = _load_qwen(path)
    ids = _ids()
    assert_close("logits", ours.logits(ours(ids)), hf(input_ids=ids).logits)


def test_export_reloads_in_transformers(qwen_ckpt, tmp_path: Path) -> None:
    path, hf = qwen_ckpt
    ours = _load_qwen(path)
    out = export_hf_checkpoint(ours, ours.spec, tmp_path / "export", max_shard_bytes=30_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    ref_index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(ref_index["weight_map"])  # transformers' own on-disk key set
    assert len(set(index["weight_map"].values())) > 1
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
    back.config._experts_implementation = "eager"
    back.config._attn_implementation = "eager"
    promote_hf_routers_(back)  # as make_pair's model: both HF routers in float64
    assert type(back).__name__ == "Qwen3MoeForCausalLM"
    ids = _ids(53)
    assert_close("re-exported logits", back(input_ids=ids).logits, hf(input_ids=ids).logits)
    assert from_hf_config(out) == ours.spec


def test_single_file_export_and_overwrite_is_atomic(qwen_ckpt, tmp_path: Path) -> None:
    path, _ = qwen_ckpt
    ours = _load_qwen(path)
    out = tmp_path / "export"
    out.mkdir()
    (out / "stale.txt").write_text("from an older export")
    export_hf_checkpoint(ours, ours.spec, out, dtype=torch.float32)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no temp or old directories left
    tensors = load_file(out / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"


@pytest.mark.parametrize("layout", ["fused", "per_expert"])
def test_hand_written_expert_layouts(qwen_ckpt, tmp_path: Path, layout: str) -> None:
    """One safetensors file written by hand: v5 fused expert tensors, or per-expert keys."""
    path, hf = qwen_ckpt
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}  # in-memory (fused) names
    if layout == "per_expert":
        for k in [k for k in state if k.endswith("experts.gate_up_proj")]:
            gu, down = state.pop(k), state.pop(k.replace("gate_up_proj", "down_proj"))
            base, half = k.removesuffix(".gate_up_proj"), gu.shape[1] // 2
            for j in range(gu.shape[0]):
                state[f"{base}.{j}.gate_proj.weight"] = gu[j, :half].clone()
                state[f"{base}.{j}.up_proj.weight"] = gu[j, half:].clone()
                state[f"{base}.{j}.down_proj.weight"] = down[j].clone()
    ckpt = tmp_path / layout
    ckpt.mkdir()
    save_file(state, ckpt / "model.safetensors")
    (ckpt / "config.json").write_text(json.dumps(hf.config.to_dict()))
    ours = _load_qwen(ckpt)
    ids = _ids(54)
    assert_close("logits", ours.logits(ours(ids)), hf(input_ids=ids).logits)


def _broken_copy(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    state = {}
    for f in src.glob("*.safetensors"):
        state.update(load_file(f))
    edit(state)
    save_file(state, dst / "model.safetensors")
    return dst


def test_missing_tensor_is_named(qwen_ckpt, tmp_path: Path) -> None:
    path, _ = qwen_ckpt

    def drop(state: dict) -> None:
        del state["model.layers.2.self_attn.k_norm.weight"]
        del state["model.layers.0.mlp.experts.3.up_proj.weight"]

    bad = _broken_copy(path, tmp_path / "bad", drop)
    with pytest.raises(ValueError, match=r"missing 2 tensors.*layers.0.mlp.experts.gate_up_proj "
                                         r"\(13 of 14 parts\).*layers.2.self_attn.k_norm.weight"):
        _load_qwen(bad)


def test_wrong_shape_is_named(qwen_ckpt, tmp_path: Path) -> None:
    path, _ = qwen_ckpt

    def shrink(state: dict) -> None:
        state["model.layers.1.mlp.up_proj.weight"] = state["model.layers.1.mlp.up_proj.weight"][:-1]

    bad = _broken_copy(path, tmp_path / "bad", shrink)
    with pytest.raises(ValueError, match=r"layers.1.mlp.up_proj.weight has shape \(21, 36\).*\(22, 36\)"):
        _load_qwen(bad)


def test_unsupported_architecture_and_unknown_keys(qwen_ckpt, tmp_path: Path) -> None:
    path, _ = qwen_ckpt
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(ValueError, match="unsupported architecture: model_type 'llama'"):
        load_hf_checkpoint(llama)
    with pytest.raises(ValueError, match="no model.safetensors"):
        load_hf_checkpoint(llama, model=torch.nn.Linear(2, 2), spec=from_hf_config(path))
    with pytest.raises(ValueError, match=r"unsupported architecture: model_type 'llama4'.*gpt_oss"):
        from_hf_config({"model_type": "llama4", "hidden_size": 8})  # the supported ones, gpt-oss among them, named

    def add_extra(state: dict) -> None:
        state["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3)  # skipped silently
        state["model.layers.3.mlp.gate.weight"] = torch.zeros(3)  # MTP-style layer after the last: skipped
        state["model.layers.0.self_attn.mystery.weight"] = torch.zeros(3)  # unknown: a warning

    extra = _broken_copy(path, tmp_path / "extra", add_extra)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _load_qwen(extra)
    messages = [str(w.message) for w in caught if "ignored" in str(w.message)]
    assert len(messages) == 1 and "1 checkpoint tensors" in messages[0] and "mystery" in messages[0]


def test_spec_to_hf_config_inverts_from_hf_config() -> None:
    spec = from_hf_config(hf_config().to_dict())
    assert from_hf_config(spec_to_hf_config(spec)) == spec
    with pytest.raises(ValueError, match="cannot be written as a Qwen3MoeConfig"):
        spec_to_hf_config(spec.replace(num_shared_experts=1))


# ---- GLM-5.3-Flash: the multimodal checkpoint layout (model.language_model.*, model.visual.*) -------
def _glm5_hf(seed: int) -> torch.nn.Module:
    from transformers.models.glm5_next import configuration_glm5_next as cfg_mod
    from transformers.models.glm5_next import modeling_glm5_next as hf_glm

    # 16 indexer heads, not 2: with 2 (ReLU'd) heads exact zero-score ties are common, and megaseq's
    # lowest-index tie rule then picks other keys than torch.topk's arbitrary choice in HF
    text = dict(vocab_size=37, hidden_size=32, intermediate_size=40, moe_intermediate_size=12,
                num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1,
                n_routed_experts=6, num_experts_per_tok=2, kv_lora_rank=8, q_lora_rank=12,
                qk_nope_head_dim=8, v_head_dim=8, qk_rope_head_dim=0, index_topk=8, index_head_dim=8,
                index_n_heads=16, index_kpool=4, linear_head_dim=8, linear_num_heads=2,
                hc_mult=4, pad_token_id=0,
                mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
                layer_types=["linear_attention"] * 3 + ["indexed_attention"])
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=32,
                  projection_intermediate_size=16, patch_size=14, image_size=28)
    torch.manual_seed(seed)
    config = cfg_mod.Glm5NextConfig(text_config=text, vision_config=vision)
    hf = hf_glm.Glm5NextForConditionalGeneration(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # HF zero-initialises biases and gates; randomize so every tensor matters
        for name, p in hf.named_parameters():
            if "language_model" in name and p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
    return hf.eval()


def _hf_from_pretrained(path: Path) -> torch.nn.Module:
    model = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float64)
    model.model.language_model.config._experts_implementation = "eager"
    model.model.language_model.config._attn_implementation = "eager"
    return model.eval()


def test_glm5_round_trip(tmp_path: Path) -> None:
    pytest.importorskip("megaseq.models.glm5.model")
    hf = _glm5_hf(seed=61)
    src = tmp_path / "hf"
    hf.save_pretrained(src, max_shard_size="50KB")
    ours = load_hf_checkpoint(src, dtype=torch.float64)  # built from config.json by build_model
    theirs = {k.removeprefix("model.language_model."): v
              for k, v in hf.state_dict().items() if "visual" not in k}
    mine = ours.state_dict()
    assert set(mine) == set(theirs)
    for name, t in theirs.items():
        assert torch.equal(mine[name], t.to(mine[name].dtype)), name

    out = export_hf_checkpoint(ours, ours.spec, tmp_path / "export", max_shard_bytes=40_000)
    ref_keys = set(json.loads((src / "model.safetensors.index.json").read_text())["weight_map"])
    keys = set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"])
    assert keys == {k for k in ref_keys if not k.startswith("model.visual.")}  # save_pretrained's disk format
    assert from_hf_config(out) == ours.spec
    ids = torch.randint(1, 37, (1, 21), generator=torch.Generator().manual_seed(62))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = _hf_from_pretrained(src)(input_ids=ids).logits
        got = _hf_from_pretrained(out)(input_ids=ids).logits
    assert_close("GLM-5 logits after export", got, want)
    with torch.no_grad():  # megaseq's own GLM-5 parity lives in its family tests; here a coarse check
        assert_close("megaseq GLM-5 logits", ours.logits(ours(ids)), want, rtol=1e-5)


def test_glm5_export_carries_the_source_vision_tower_and_config(tmp_path: Path) -> None:
    """With ``carry_from`` the export is the source checkpoint with the text model replaced: every source
    key (vision tower included) with the vision tensors unchanged, and the source's vision_config and token
    ids in config.json. Without it (the broken variant) the vision tensors are missing."""
    pytest.importorskip("megaseq.models.glm5.model")
    hf = _glm5_hf(seed=63)
    src = tmp_path / "hf"
    hf.save_pretrained(src, max_shard_size="50KB")
    ours = load_hf_checkpoint(src, dtype=torch.float64)
    out = export_hf_checkpoint(ours, ours.spec, tmp_path / "export", max_shard_bytes=40_000, carry_from=src)
    ref_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    out_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(out_map) == set(ref_map)
    from safetensors import safe_open

    for key in (k for k in ref_map if k.startswith("model.visual.")):
        with safe_open(str(src / ref_map[key]), "pt") as a, safe_open(str(out / out_map[key]), "pt") as b:
            assert torch.equal(a.get_tensor(key), b.get_tensor(key)), key
    src_cfg, out_cfg = (json.loads((d / "config.json").read_text()) for d in (src, out))
    assert out_cfg["vision_config"] == src_cfg["vision_config"]
    assert out_cfg["image_token_id"] == src_cfg["image_token_id"]
    bare = export_hf_checkpoint(ours, ours.spec, tmp_path / "bare", max_shard_bytes=40_000)
    bare_keys = set(json.loads((bare / "model.safetensors.index.json").read_text())["weight_map"])
    assert not any(k.startswith("model.visual.") for k in bare_keys)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back = _hf_from_pretrained(out)
    theirs = dict(hf.state_dict())
    for name, t in back.state_dict().items():
        if "visual" in name:
            assert torch.equal(t, theirs[name].to(t.dtype)), name  # not freshly initialised

"""PEFT's adapter format: a megaseq LoRA export loads with ``peft`` on the transformers model and gives the
same logits, float64 on the CPU (1e-10); the merged export (adapters folded into the base) loads with
transformers alone and matches too; an adapter read back fills the same tensors; what PEFT could not load
back is refused before anything is written.

Adapters get random factors (B is zero at initialisation, which would make every comparison trivial).
A broken variant (the expert factors' PEFT layout transposed) must fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megaseq.config import AdapterSettings, MemorySettings, build_config
from megaseq.models import peft_io
from megaseq.models.common import lora
from megaseq.models.hf_io import export_hf_checkpoint
from megaseq.models.registry import parallelize

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from test_moe import promote_hf_routers_  # noqa: E402
from test_qwen3_moe_parity import assert_close, hf_config, make_pair  # noqa: E402

torch.set_num_threads(2)
QWEN_TARGETS = "q_proj,k_proj,v_proj,o_proj,experts"


def adapt(model: torch.nn.Module, targets: str, rank: int = 3, alpha: float = 5.0, seed: int = 0, **kw):
    """``model`` with LoRA on ``targets``, its factors random (seeded)."""
    cfg = build_config(overrides={"lora.rank": rank, "lora.alpha": alpha, "lora.targets": targets, **kw})
    settings = AdapterSettings.of(cfg)
    parallelize(model, MemorySettings(), None, settings)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if lora.is_adapter(name):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
    return settings.lora


def peft_logits(hf: torch.nn.Module, adapter: Path, ids: torch.Tensor) -> torch.Tensor:
    model = peft.PeftModel.from_pretrained(hf, str(adapter))
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture
def qwen_pair():
    """A float64 HF Qwen3-MoE (routers promoted) and megaseq's with the same weights, all layers MoE."""
    return make_pair(hf_config(mlp_only_layers=[]), seed=21)


def _ids(vocab: int, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 17), generator=torch.Generator().manual_seed(seed))


def test_qwen3_adapter_loads_in_peft_with_the_same_logits(qwen_pair, tmp_path: Path) -> None:
    hf, ours = qwen_pair
    cfg = adapt(ours, QWEN_TARGETS)
    out = peft_io.export_adapter(ours, ours.spec, cfg, tmp_path / "adapter")
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    ids = _ids(ours.spec.vocab_size)
    with torch.no_grad():
        want = ours.logits(ours(ids))
        base = hf(input_ids=ids).logits
    assert (want - base).abs().max() > 1e-3  # the adapters change the logits: the comparison is not vacuous
    assert_close("peft logits", peft_logits(hf, out, ids), want)


def test_qwen3_merged_export_loads_in_transformers(qwen_pair, tmp_path: Path) -> None:
    _, ours = qwen_pair
    adapt(ours, QWEN_TARGETS)
    out = export_hf_checkpoint(ours, ours.spec, tmp_path / "merged", merged=True)
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
    back.config._experts_implementation = back.config._attn_implementation = "eager"
    promote_hf_routers_(back)
    ids = _ids(ours.spec.vocab_size, 6)
    with torch.no_grad():
        assert_close("merged logits", back(input_ids=ids).logits, ours.logits(ours(ids)))


def test_adapter_reads_back_into_fresh_adapters(qwen_pair, tmp_path: Path) -> None:
    _, ours = qwen_pair
    cfg = adapt(ours, QWEN_TARGETS)
    out = peft_io.export_adapter(ours, ours.spec, cfg, tmp_path / "adapter")
    _, other = make_pair(hf_config(mlp_only_layers=[]), seed=21)
    adapt(other, QWEN_TARGETS, seed=9)  # other random factors
    peft_io.load_adapter(other, other.spec, cfg, out)
    mine = {n: p for n, p in ours.named_parameters() if lora.is_adapter(n)}
    for n, p in other.named_parameters():
        if lora.is_adapter(n):
            assert torch.equal(p, mine[n]), n


def test_broken_expert_layout_fails(qwen_pair, tmp_path: Path, monkeypatch) -> None:
    """The expert factors written in a plausible but wrong layout (B's columns expert-major) must not load
    into PEFT with the same logits."""
    hf, ours = qwen_pair
    cfg = adapt(ours, "experts")
    real = peft_io._peft_layout

    def expert_major(proj, A, B):
        a, b = real(proj, A, B)
        return (a, B.permute(1, 0, 2).reshape(B.shape[1], -1)) if proj.kind == "experts" else (a, b)

    monkeypatch.setattr(peft_io, "_peft_layout", expert_major)
    out = peft_io.export_adapter(ours, ours.spec, cfg, tmp_path / "adapter")
    ids = _ids(ours.spec.vocab_size)
    with torch.no_grad():
        want = ours.logits(ours(ids))
    with pytest.raises(AssertionError, match="peft logits"):
        assert_close("peft logits", peft_logits(hf, out, ids), want)


def test_refusals(tmp_path: Path) -> None:
    hf, ours = make_pair(hf_config(), seed=3)  # layer 1 dense: PEFT would put its adapters on the experts
    cfg = adapt(ours, "all")
    with pytest.raises(ValueError, match="PEFT renames"):
        peft_io.export_adapter(ours, ours.spec, cfg, tmp_path / "a")
    assert not (tmp_path / "a").exists()
    _, q = make_pair(hf_config(mlp_only_layers=[]), seed=3)
    cfg = adapt(q, "q_proj")
    out = peft_io.export_adapter(q, q.spec, cfg, tmp_path / "b")
    wrong = build_config(overrides={"lora.rank": 4, "lora.targets": "q_proj"}).lora
    with pytest.raises(ValueError, match="set --lora.rank 3"):
        peft_io.load_adapter(q, q.spec, wrong, out)
    _, more = make_pair(hf_config(mlp_only_layers=[]), seed=3)
    cfg2 = adapt(more, "q_proj,v_proj")
    with pytest.raises(ValueError, match="does not target"):
        peft_io.load_adapter(more, more.spec, cfg2, out)


def test_qwen3_one_expert_tensor_is_not_nested(qwen_pair, tmp_path: Path) -> None:
    hf, ours = qwen_pair
    cfg = adapt(ours, "experts.down_proj,o_proj")
    out = peft_io.export_adapter(ours, ours.spec, cfg, tmp_path / "adapter")
    ids = _ids(ours.spec.vocab_size, 7)
    with torch.no_grad():
        want = ours.logits(ours(ids))
    assert_close("peft logits", peft_logits(hf, out, ids), want)


def test_glm5_adapter_loads_in_peft_with_the_same_logits(tmp_path: Path) -> None:
    """KDA, MLA (kv_b_proj folded into the weight), dense MLP, shared and routed experts: the multimodal
    glm5_next model PEFT loads the adapter on (``model.language_model.*``), its float32 casts promoted."""
    from test_glm5_parity import build_pair, hf_glm5_module, make_config

    _, ours, _ = build_pair(make_config(), seed=4)
    cfg = adapt(ours, "all", rank=2, alpha=3.0)
    base = export_hf_checkpoint(ours, ours.spec, tmp_path / "base")
    adapter = peft_io.export_adapter(ours, ours.spec, cfg, tmp_path / "adapter")
    cls = hf_glm5_module(True).Glm5NextForConditionalGeneration
    hf = cls.from_pretrained(base, config=transformers.AutoConfig.from_pretrained(base), dtype=torch.float64).eval()
    for c in (hf.config, hf.config.text_config):
        c._experts_implementation = c._attn_implementation = "eager"
    ids = _ids(ours.spec.vocab_size, 8)
    with torch.no_grad():
        want = ours.logits(ours(ids))
        assert (want - hf(input_ids=ids).logits).abs().max() > 1e-3
    assert_close("peft logits", peft_logits(hf, adapter, ids), want)


def test_an_adapter_names_its_base_so_that_it_resolves_elsewhere(tmp_path, monkeypatch):
    """A base given as a relative path is recorded as its absolute path; a hub id as given."""
    from megaseq.models.peft_io import base_reference

    (tmp_path / "base").mkdir()
    monkeypatch.chdir(tmp_path)
    assert base_reference("base") == str(tmp_path / "base")
    assert base_reference("Qwen/Qwen3-30B-A3B") == "Qwen/Qwen3-30B-A3B" and base_reference(None) is None

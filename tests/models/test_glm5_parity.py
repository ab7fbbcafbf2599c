"""GLM-5.3-Flash parity with transformers' ``Glm5NextTextModel`` (float64, CPU).

The reference is the installed ``modeling_glm5_next`` with its float32 casts promoted to float64
(a mechanical rewrite of the source, see ``hf_glm5_module``), as megaseq computes those parts in
``promote_types(dtype, float32)``, except in RMSNorm, whose float32 cast megaseq keeps literally
(it is per token, so it does not depend on how tokens are split). Without the rewrite HF computes the
mHC weights, the KDA recurrence, the gated norm, the softmax and the router in float32 even in a
float64 model, and no float64 comparison could go below ~1e-6;
``test_unmodified_reference_is_close`` checks the real, unmodified code at that level.
"""

from __future__ import annotations

import re
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from megaseq.models.build import build_model
from megaseq.models.spec import from_hf_config

transformers = pytest.importorskip("transformers")
from transformers.models.glm5_next import modeling_glm5_next as hf_glm  # noqa: E402

torch.set_num_threads(1)

# HF classes whose float32 casts megaseq keeps literally (norm.py): not promoted
LITERAL_CAST_CLASSES = {"Glm5NextTextRMSNorm"}
RTOL = 1e-10


def hf_glm5_module(promote: bool = True) -> types.ModuleType:
    """``modeling_glm5_next`` with ``torch.float32`` / ``.float()`` turned into float64 outside
    ``LITERAL_CAST_CLASSES``; ``promote=False`` returns the installed module itself."""
    if not promote:
        return hf_glm
    name = "transformers.models.glm5_next._modeling_glm5_next_f64"
    if name in sys.modules:
        return sys.modules[name]
    out, owner, changed = [], None, 0
    for line in open(hf_glm.__file__).read().splitlines(keepends=True):
        if m := re.match(r"(?:class|def) (\w+)", line):
            owner = m.group(1)
        if owner not in LITERAL_CAST_CLASSES:
            new = line.replace("torch.float32", "torch.float64").replace(".float()", ".double()")
            changed += new != line
            line = new
        out.append(line)
    assert changed >= 15, "the float32 casts of modeling_glm5_next moved: update hf_glm5_module"
    mod = types.ModuleType(name)
    mod.__file__, mod.__package__ = hf_glm.__file__, "transformers.models.glm5_next"
    sys.modules[name] = mod
    exec(compile("".join(out), f"{hf_glm.__file__}[float64]", "exec"), mod.__dict__)
    return mod


def make_config(mlp: str = "mixed", **kw):
    """Tiny odd-sized config: KDA x5, DSA x3 (full, shared, full), dense + MoE, grouped routing."""
    lin, dsa = "linear_attention", "indexed_attention"
    mlp_types = ["dense"] * 8 if mlp == "dense" else ["dense", "dense"] + ["sparse"] * 6
    base = dict(
        vocab_size=53, hidden_size=36, intermediate_size=44, moe_intermediate_size=20, num_hidden_layers=8,
        num_attention_heads=3, num_key_value_heads=3, n_shared_experts=1, n_routed_experts=8,
        routed_scaling_factor=1.7, kv_lora_rank=14, q_lora_rank=18, qk_rope_head_dim=0, v_head_dim=10,
        qk_nope_head_dim=12, n_group=4, topk_group=2, num_experts_per_tok=3,
        layer_types=[lin, lin, lin, dsa, dsa, lin, lin, dsa], mlp_layer_types=mlp_types,
        indexer_types=["full"] * 4 + ["shared"] + ["full"] * 3,
        index_topk=8, index_head_dim=10, index_n_heads=16, index_kpool=4, linear_head_dim=6,
        linear_num_heads=3, linear_conv_kernel_dim=4, hc_mult=4, hc_sinkhorn_iters=5, pad_token_id=0,
        swiglu_limit=1.5, rms_norm_eps=1e-5)
    cfg = hf_glm.Glm5NextTextConfig(**{**base, **kw})
    cfg._experts_implementation = "eager"
    cfg._attn_implementation = "eager"
    return cfg


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Every parameter and buffer random (seeded), at scales that keep every gate non-degenerate."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            r = torch.randn(t.shape, generator=gen, dtype=torch.float64)
            if t.dim() >= 2:
                r = r * t.shape[-1] ** -0.5
            elif name.endswith(("norm.weight", "layernorm.weight")):
                r = 1.0 + 0.2 * r
            elif name.endswith("dt_bias"):  # slow decay (as trained KDA has): long memory is exercised
                r = -4.0 + 0.5 * r
            else:  # biases, e_score_correction_bias, hc base/scale, A_log, dt_bias
                r = 0.5 * r
            t.copy_(r)


def build_pair(cfg, seed: int = 0, promote: bool = True):
    ref = hf_glm5_module(promote).Glm5NextTextModel(cfg).double()
    randomize_(ref, seed)
    ours = build_model(from_hf_config(cfg.to_dict()), dtype=torch.float64, seed=seed)
    missing, unexpected = ours.load_state_dict(ref.state_dict(), strict=False)
    assert missing == ["lm_head.weight"] and not unexpected
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(seed + 1),
                       dtype=torch.float64) * cfg.hidden_size**-0.5
    with torch.no_grad():
        ours.lm_head.weight.copy_(head)
    return ref, ours, head


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def compare_grads(ref: torch.nn.Module, ours: torch.nn.Module, rtol: float) -> float:
    """Same set of parameters without gradient; every other gradient within ``rtol``; the worst error."""
    ref_params = dict(ref.named_parameters())
    worst, bad = 0.0, []
    for name, p in ours.named_parameters():
        if name == "lm_head.weight":
            continue
        r = ref_params[name]
        r_none = r.grad is None or not r.grad.any()
        o_none = p.grad is None or not p.grad.any()
        assert r_none == o_none, f"{name}: reference grad None/zero {r_none}, megaseq {o_none}"
        if r_none:
            continue
        err = rel_err(p.grad, r.grad)
        worst = max(worst, err)
        if err > rtol:
            bad.append(f"{name}: {err:.2e}")
    assert not bad, f"{len(bad)} gradients differ, e.g. " + "; ".join(bad[:4])
    return worst


def _loss(hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden, head).flatten(0, 1), labels.flatten())


def test_hidden_states_and_grads_match_hf():
    cfg = make_config()
    ref, ours, head = build_pair(cfg, seed=0)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(1, cfg.vocab_size, (2, 70), generator=gen)  # 70 > 64: two KDA chunks
    labels = torch.randint(0, cfg.vocab_size, (2, 70), generator=gen)
    h_ref = ref(ids).last_hidden_state
    h_ours = ours(ids)
    loss_ref, loss_ours = _loss(h_ref, head, labels), F.cross_entropy(ours.logits(h_ours).flatten(0, 1),
                                                                       labels.flatten())
    loss_ref.backward()
    loss_ours.backward()
    err_h, err_l = rel_err(h_ours, h_ref), rel_err(loss_ours, loss_ref)
    worst = compare_grads(ref, ours, RTOL)
    print(f"\nGLM5 parity: hidden {err_h:.2e}, loss {err_l:.2e}, worst grad {worst:.2e}")
    assert err_h < RTOL and err_l < RTOL
    # the indexer runs under no_grad in both: its parameters must be exactly the grad-less ones
    no_grad = {n for n, p in ours.named_parameters() if p.grad is None}
    assert no_grad and all(".indexer." in n for n in no_grad)


@pytest.mark.parametrize("mlp", ["dense", "mixed"])
def test_packed_documents_match_separate_reference_runs(mlp):
    cfg = make_config(mlp)
    ref, ours, head = build_pair(cfg, seed=3)
    gen = torch.Generator().manual_seed(4)
    lens = [23, 9, 38]  # one shorter than a pool pair, one spanning several pools + a tail
    docs = [torch.randint(1, cfg.vocab_size, (1, n), generator=gen) for n in lens]
    doc_ids = torch.cat([torch.full((1, n), i) for i, n in enumerate(lens)], dim=1)
    proj = torch.randn(cfg.hidden_size, 5, generator=gen, dtype=torch.float64)
    h_ref = torch.cat([ref(d).last_hidden_state for d in docs], dim=1)
    h_ours = ours(torch.cat(docs, dim=1), doc_ids=doc_ids)
    (h_ref @ proj).sin().sum().backward()
    (h_ours @ proj).sin().sum().backward()
    # exact with MoE too: a float32 router GEMM would round differently for 70 tokens than for 23, 9
    # and 38 (~1e-7), but the routers (megaseq's and the promoted reference's) compute in float64
    err = rel_err(h_ours, h_ref)
    worst = compare_grads(ref, ours, RTOL)
    print(f"\nGLM5 packed ({mlp}): hidden {err:.2e}, worst grad {worst:.2e}")
    assert err < RTOL


def test_unmodified_reference_is_close():
    """The installed HF code as is (float32 casts in a float64 model): equal to float32 precision."""
    cfg = make_config()
    ref, ours, _ = build_pair(cfg, seed=5, promote=False)
    ids = torch.randint(1, cfg.vocab_size, (1, 45), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        err = rel_err(ours(ids), ref(ids).last_hidden_state)
    print(f"\nGLM5 vs unmodified HF (float32 casts): hidden {err:.2e}")
    assert err < 1e-3  # float32 rounding through 8 random layers: ~1e-5 seen


@pytest.mark.parametrize("spelling", ["indexed_attention", "deepseek_sparse_attention", "full_attention"])
def test_from_hf_config_dsa_spellings(spelling):
    d = make_config().to_dict()
    d["layer_types"] = [spelling if t == "indexed_attention" else t for t in d["layer_types"]]
    spec = from_hf_config(d)
    assert spec.layer_types == ("kda", "kda", "kda", "dsa", "dsa", "kda", "kda", "dsa")
    assert spec.indexer_types[3:5] == ("full", "shared")
    assert spec == from_hf_config(make_config().to_dict())


def _lowest_index_ties(x_cP, k, row_len, floor):
    from megaseq.ops.indexer import scoring as indexer_scoring

    return indexer_scoring.topk_lowest_index_ties(x_cP, k)


@pytest.mark.parametrize("broken", [False, True])
def test_four_indexer_heads_break_ties_as_transformers(broken, monkeypatch):
    """4 indexer heads: many pools score exactly 0 (every head relu'd), so rows cut inside blocks of ties.
    Scored whole on the CPU, megaseq keeps the pools ``torch.topk`` keeps on transformers' row; breaking the
    ties by the lowest index instead (the broken variant) changes the selection and the hidden states."""
    from megaseq.ops.indexer import scoring as indexer_scoring

    if broken:
        monkeypatch.setattr(indexer_scoring, "topk_as_transformers", _lowest_index_ties)
    cfg = make_config(index_n_heads=4)
    ref, ours, _ = build_pair(cfg, seed=5)
    ids = torch.randint(1, cfg.vocab_size, (2, 70), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        err = rel_err(ours(ids), ref(ids).last_hidden_state)
    print(f"\nGLM5 4 indexer heads ({'lowest-index ties' if broken else 'torch.topk ties'}): hidden {err:.2e}")
    assert (err > 1e-3) if broken else (err < RTOL)

"""gpt-oss parity with transformers: logits and every gradient in float64 on the CPU, packed documents, the
sharded save_pretrained -> megaseq -> export -> from_pretrained round trip, MXFP4 checkpoints, and broken
variants (sinks ignored, the window ignored, the experts' +1 dropped) that must fail.

A tiny config with odd sizes: 4 layers (sliding, full, sliding, full) with a window of 5 keys, shorter than
the 23-token sequences; GQA 6/2 heads of 10 dims; 7 experts top-3 with biases; YaRN with a short original
length so its ramp matters. transformers runs its eager attention (the sinks' softmax) and eager experts,
unmodified: gpt-oss's router and softmaxes run in the model's dtype, and megaseq's norms and RoPE keep HF's
float32 as HF does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megaseq.models.build import build_model
from megaseq.models.common import sink_attention
from megaseq.models.gpt_oss.state_dict_adapter import ADAPTER, dequantize_mxfp4, to_memory
from megaseq.models.hf_io import export_hf_checkpoint, load_hf_checkpoint
from megaseq.models.spec import from_hf_config
from megaseq.ops import dispatch

transformers = pytest.importorskip("transformers")
from family_parity import check_round_trip, randomize_, rel_err  # noqa: E402

torch.set_num_threads(2)
RTOL = 1e-10
VOCAB = 53


def hf_config(**kw) -> transformers.GptOssConfig:
    base = dict(vocab_size=VOCAB, hidden_size=36, intermediate_size=14, num_hidden_layers=4, num_attention_heads=6,
                num_key_value_heads=2, head_dim=10, num_local_experts=7, num_experts_per_tok=3, sliding_window=5,
                max_position_embeddings=64, pad_token_id=0, rms_norm_eps=1e-5,
                rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False, "original_max_position_embeddings": 16, "rope_theta": 500.0})
    cfg = transformers.GptOssConfig(**{**base, **kw})
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    return cfg


def ours_name(hf_name: str) -> str:
    return ADAPTER.model_name(hf_name, 10**6) or hf_name


def make_pair(cfg: transformers.GptOssConfig, seed: int = 3):
    """A randomized HF model and megaseq's with the same weights, through the adapter's layout mapping."""
    torch.manual_seed(seed)
    hf = transformers.GptOssForCausalLM(cfg).to(torch.float64).eval()
    randomize_(hf, seed)
    ours = build_model(from_hf_config(cfg.to_dict()), dtype=torch.float64, seed=seed).eval()
    state = {ours_name(k): to_memory(k, v) for k, v in hf.state_dict().items()}
    ours.load_state_dict(state, strict=True)
    return hf, ours


def compare_grads(hf, ours, rtol: float = RTOL) -> float:
    """Every HF parameter's gradient equals megaseq's, in megaseq's layout; the worst relative error."""
    mine, worst, bad = dict(ours.named_parameters()), 0.0, []
    for name, p in hf.named_parameters():
        q = mine[ours_name(name)]
        assert p.grad is not None and q.grad is not None, name
        err = rel_err(q.grad, to_memory(name, p.grad))
        worst = max(worst, err)
        if err > rtol:
            bad.append(f"{name}: {err:.2e}")
    assert not bad, f"{len(bad)} gradients differ, e.g. " + "; ".join(bad[:4])
    return worst


def check_logits_and_grads(hf, ours, ids: torch.Tensor) -> None:
    ref = hf(input_ids=ids).logits
    got = ours.logits(ours(ids))
    assert rel_err(got, ref) < RTOL, f"logits differ: {rel_err(got, ref):.2e}"
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    (ref * g).sum().backward()
    (got * g).sum().backward()
    compare_grads(hf, ours)


def ids_for(shape: tuple[int, int], seed: int = 12) -> torch.Tensor:
    return torch.randint(1, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def test_spec_and_refusals() -> None:
    spec = from_hf_config(hf_config().to_dict())
    assert spec.sliding_layers == (0, 2) and spec.sliding_window == 5 and spec.attention_sinks
    assert spec.router == "topk_softmax" and spec.router_bias and spec.expert_bias and spec.swiglu_alpha == 1.702
    base = hf_config().to_dict()
    cases = {
        "layer_types": (["sliding_attention", "full_attention", "chunked_attention", "full_attention"],
                        "layer_types must hold"),
        "attention_dropout": (0.1, "attention_dropout = 0.1 is not supported"),
        "hidden_act": ("gelu", "hidden_act = 'gelu'"),
        "quantization_config": ({"quant_method": "fp8"}, "quantization_config"),
        "experts_per_token": (2, "experts_per_token \\(2\\) disagrees"),
        "use_sliding_window_cache": (True, "use_sliding_window_cache .*is not a field"),
        "rope_parameters": ({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1.0}, "rope_type 'dynamic'"),
        "attention_bias": (False, "attention_bias false"),
    }
    for field, (value, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            from_hf_config({**base, field: value})
    with pytest.raises(ValueError, match="sliding_window must be a positive"):
        from_hf_config({**base, "sliding_window": None})
    mxfp4 = from_hf_config({**base, "quantization_config": {"quant_method": "mxfp4"}})
    assert "quantization_config" not in mxfp4.hf_extra  # an export holds dequantized weights


def test_logits_and_grads_match_hf() -> None:
    hf, ours = make_pair(hf_config())
    ids = ids_for((2, 23))
    ids[0, 4] = 0  # a padding token
    check_logits_and_grads(hf, ours, ids)


def test_packed_documents_match_each_document_alone() -> None:
    hf, ours = make_pair(hf_config(), seed=7)
    lengths = [[9, 14], [23]]
    ids = ids_for((2, 23), seed=8)
    doc_ids = torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in lengths])
    logits = ours.logits(ours(ids, doc_ids=doc_ids))
    g = torch.randn(logits.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    (logits * g).sum().backward()
    for b, row in enumerate(lengths):
        start = 0
        for n in row:
            ref = hf(input_ids=ids[b:b + 1, start:start + n]).logits
            assert rel_err(logits[b:b + 1, start:start + n], ref) < RTOL, (b, start)
            (ref * g[b:b + 1, start:start + n]).sum().backward()
            start += n
    compare_grads(hf, ours)


def _broken_sinks(q, k, v, doc_ids, scale, sinks_H, window):
    return sink_attention.sink_attention_reference(q, k, v, doc_ids, scale, torch.full_like(sinks_H, -1e30), window)


def _broken_window(q, k, v, doc_ids, scale, sinks_H, window):
    return sink_attention.sink_attention_reference(q, k, v, doc_ids, scale, sinks_H, 0)


def _broken_glu(gate, up, alpha, limit):
    return (up.clamp(-limit, limit)) * (gate.clamp(max=limit) * torch.sigmoid(gate.clamp(max=limit) * alpha))


@pytest.mark.parametrize("op, impl, broken", [("sink_attention", "torch_reference", _broken_sinks),
                                              ("sink_attention", "torch_reference", _broken_window),
                                              ("clamped_swiglu", "torch", _broken_glu)])
def test_broken_variants_fail(op: str, impl: str, broken) -> None:
    hf, ours = make_pair(hf_config())
    with dispatch.override(op, impl, broken), pytest.raises(AssertionError, match="logits differ"):
        check_logits_and_grads(hf, ours, ids_for((1, 23)))


def test_round_trip_through_transformers(tmp_path: Path) -> None:
    hf, _ = make_pair(hf_config())
    check_round_trip(hf, tmp_path, ids_for((1, 17)), "GptOssForCausalLM")


def test_mxfp4_dequantize_matches_transformers() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 2, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 10, 2), generator=gen, dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # HF's [E, 64, 10]
    got = dequantize_mxfp4(blocks, scales)  # [E, 10, 64]
    assert torch.equal(got.transpose(1, 2), want)
    with pytest.raises(AssertionError):  # the nibble order matters: swapped, it differs
        swapped = ((blocks & 0x0F) << 4) | (blocks >> 4)
        assert torch.equal(dequantize_mxfp4(swapped, scales).transpose(1, 2), want)


def _quantize(w_ERC: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 codes and scales of ``w``'s shape (rows R, columns C): blocks, scales."""
    E, R, C = w_ERC.shape
    blocks = torch.randint(0, 256, (E, R, C // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(120, 130, (E, R, C // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


def test_mxfp4_checkpoint_loads_dequantized(tmp_path: Path) -> None:
    """A checkpoint with the experts as MXFP4 blocks loads to what transformers dequantizes; the export carries
    no _scales and transformers reads it back with the same logits."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    cfg = hf_config(hidden_size=64, intermediate_size=32, head_dim=16, num_attention_heads=4)
    hf, _ = make_pair(cfg)
    gen = torch.Generator().manual_seed(1)
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    for k in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = _quantize(state[k].transpose(1, 2), gen)  # on disk rows are the output features
        state[k] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float64)  # what transformers loads
        hf.state_dict()[k].copy_(state[k])
        del state[k]
        state[k + "_blocks"], state[k + "_scales"] = blocks, scales
    src = tmp_path / "mxfp4"
    src.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(src / "model.safetensors"))
    (src / "config.json").write_text(cfg.to_json_string().replace('"model_type"', '"quantization_config": '
                                                                  '{"quant_method": "mxfp4"}, "model_type"'))
    spec = from_hf_config(src)
    model = load_hf_checkpoint(src, model=build_model(spec, dtype=torch.float64, seed=0), spec=spec)
    ids = ids_for((1, 19))
    want = hf(input_ids=ids).logits
    assert rel_err(model.logits(model(ids)), want) < RTOL
    out = export_hf_checkpoint(model, spec, tmp_path / "export")
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
    back.config._experts_implementation = back.config._attn_implementation = "eager"
    assert rel_err(back.eval()(input_ids=ids).logits, want) < RTOL
    src_scales = (src / "model.safetensors").read_bytes().count(b"_scales")
    assert src_scales and b"_scales" not in (out / "model.safetensors").read_bytes()


def test_aux_loss_and_gradients_match_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    """CE + coef * transformers' load-balancing loss (over the router's full softmax, bias included) and every
    gradient, against megaseq's balancer on the same micro-batch."""
    from test_balance import hf_loss_with_aux, megaseq_step
    from transformers.models.gpt_oss import modeling_gpt_oss

    hf, ours = make_pair(hf_config(router_aux_loss_coef=0.3), seed=13)
    ids = ids_for((2, 23), seed=14)
    want, aux = hf_loss_with_aux(hf, ids, ids, modeling_gpt_oss, monkeypatch)
    want.backward()
    balancer = megaseq_step(ours, ids, ids, 0.3)
    assert abs(balancer.metrics()["moe_aux_loss"] - float(aux.detach())) < 1e-10 * float(aux.detach())
    compare_grads(hf, ours)


def test_tiny_dna_recipe_trains(tmp_path: Path) -> None:
    """recipes/gpt-oss-tiny-dna.yaml: two steps on the CPU on sequences longer than the window, loss finite."""
    import json

    from megaseq.cli.main import main

    root = Path(__file__).resolve().parents[2]
    run = tmp_path / "run"
    rc = main(["train", str(root / "recipes" / "gpt-oss-tiny-dna.yaml"), "--train.steps", "2", "--data.seq_len",
               "256", "--train.run_dir", str(run), "--eval.by_position", "128", "--train.eval_after", "false"])
    assert rc == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 2 and all(0 < x < 10 for x in losses)


def test_peft_export_of_expert_adapters_is_refused() -> None:
    """PEFT's fused-expert factors assume [E, out, in]; gpt-oss's HF experts are [E, in, out] and interleaved, so
    an adapter on them is refused by name before a run (attention adapters export as every family's)."""
    from megaseq.models.adapters import projections, resolve_targets
    from megaseq.models.gpt_oss.spec import gpt_oss_tiny
    from megaseq.models.peft_io import check_exportable
    from megaseq.plan.params import param_table

    spec = gpt_oss_tiny()
    table = param_table(spec)
    check_exportable(spec, resolve_targets(projections(table), ["q_proj", "v_proj"], table))
    with pytest.raises(ValueError, match="routed experts .*merged"):
        check_exportable(spec, resolve_targets(projections(table), ["q_proj", "experts"], table))

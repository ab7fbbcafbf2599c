"""The softmax-attention block's ops and helpers: reference vs SDPA, document masking, KV repeats."""

from __future__ import annotations

import pytest
import torch

from conftest import cuda_backward_peak
from megaseq.models.common.attention import (
    Attention,
    attention_reference,
    attention_sdpa,
    kv_for_sdpa,
    kv_repeats,
    positions_for,
)
from megaseq.models.common.context import SeqContext
from megaseq.models.presets import get_preset
from megaseq.ops import dispatch

torch.set_num_threads(2)


def _qkv(B: int, S: int, Hq: int, Hkv: int, D: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(B, S, h, D, generator=gen, device=device).to(dtype) for h in (Hq, Hkv, Hkv)]


def _dense_reference(q, k, v, doc_ids, scale):
    """The plain S x S masked softmax in float64, the definition the two ops must agree with."""
    q, k, v = (t.double() for t in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    S = q.shape[1]
    allowed = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()[None]
    if doc_ids is not None:
        allowed = allowed & (doc_ids[:, :, None] == doc_ids[:, None, :])
    scores = torch.einsum("bshd,bthd->bhst", q, k) * scale
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return torch.einsum("bhst,bthd->bshd", scores.softmax(-1), v)


DOCS = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 3], [5, 5, 5, 5, 5, 5, 5, 6, 6, 6, 6]])


@pytest.mark.parametrize("doc_ids", [None, DOCS])
def test_reference_and_sdpa_match_dense_definition(doc_ids) -> None:
    q, k, v = _qkv(2, 11, 6, 2, 5, torch.float64, seed=1)
    want = _dense_reference(q, k, v, doc_ids, 5**-0.5)
    torch.testing.assert_close(attention_reference(q, k, v, doc_ids, 5**-0.5), want, rtol=1e-6, atol=1e-7)
    q32, k32, v32 = (t.float() for t in (q, k, v))
    torch.testing.assert_close(attention_sdpa(q32, k32, v32, doc_ids, 5**-0.5).double(), want,
                               rtol=1e-5, atol=1e-5)


def test_reference_blocks_over_queries(monkeypatch: pytest.MonkeyPatch) -> None:
    import megaseq.models.common.attention as attn

    q, k, v = _qkv(1, 23, 4, 4, 3, torch.float64, seed=2)
    whole = attention_reference(q, k, v, None, 0.5)
    monkeypatch.setattr(attn, "REFERENCE_BLOCK_ELEMS", 4 * 23 * 5)  # blocks of 5 queries
    blocked = attention_reference(q, k, v, None, 0.5)  # GEMM shapes differ: equal up to float64 rounding
    torch.testing.assert_close(blocked, whole, rtol=1e-12, atol=1e-14)


def test_sdpa_is_skipped_for_float64_and_recorded() -> None:
    spec = get_preset("qwen3-moe-tiny")
    block = Attention(spec, layer="layers.0.self_attn")
    dispatch.reset_records()
    block(torch.randn(1, 7, spec.hidden_size), SeqContext())
    block.double()(torch.randn(1, 7, spec.hidden_size, dtype=torch.float64), SeqContext())
    rec = {r.impl: r.reason for layer, r in dispatch.records() if layer == "layers.0.self_attn"}
    assert "torch_reference" in rec and "float64" in rec["torch_reference"]


def test_positions_restart_at_documents() -> None:
    ctx = SeqContext(doc_ids=DOCS)
    pos = positions_for(ctx, 2, 11, torch.device("cpu"))
    assert pos.tolist()[0] == [0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 0]
    assert positions_for(SeqContext(), 1, 4, torch.device("cpu")).tolist() == [[0, 1, 2, 3]]


@pytest.mark.parametrize("Hq, Hkv, cp, rep", [(8, 2, 2, 1), (8, 2, 4, 2), (6, 2, 3, 3), (12, 4, 6, 3),
                                               (8, 8, 4, 1)])
def test_kv_repeats(Hq: int, Hkv: int, cp: int, rep: int) -> None:
    assert kv_repeats(Hq, Hkv, cp) == rep
    with pytest.raises(ValueError, match="must divide num_attention_heads"):
        kv_repeats(Hq, Hkv, Hq + 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sdpa_matches_reference_on_gpu_bf16() -> None:
    doc_ids = torch.repeat_interleave(torch.arange(3), torch.tensor([700, 1, 323]))[None].cuda()
    q, k, v = _qkv(1, 1024, 8, 2, 128, torch.bfloat16, device="cuda", seed=3)
    want = _dense_reference(q, k, v, doc_ids, 128**-0.5)
    for op in (attention_sdpa, attention_reference):
        got = op(q, k, v, doc_ids, 128**-0.5)
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("doc_ids", [None, DOCS])
def test_repeated_kv_heads_give_the_grouped_attention(doc_ids) -> None:
    """kv_for_sdpa (on CUDA in float32: the memory-efficient kernel instead of the S x S math one) repeats KV
    head j for query heads j*g .. j*g+g-1, as enable_gqa reads them: the same attention as the grouped
    one. A KV layout that tiles the heads (repeat instead of repeat_interleave) fails."""
    q, k, v = _qkv(2, 11, 8, 2, 16, torch.float64, seed=5)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    kr, vr = kv_for_sdpa(qt, kt, vt, repeat=True)
    assert kr.shape[1] == vr.shape[1] == 8
    got = attention_reference(q, kr.transpose(1, 2), vr.transpose(1, 2), doc_ids, 0.25)
    torch.testing.assert_close(got, attention_reference(q, k, v, doc_ids, 0.25), rtol=0, atol=1e-12)
    assert kv_for_sdpa(qt, kt, vt)[0] is kt  # on the CPU nothing is repeated
    tiled = attention_reference(q, k.repeat(1, 1, 4, 1), v.repeat(1, 1, 4, 1), doc_ids, 0.25)
    assert not torch.allclose(tiled, got)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_float32_grouped_attention_at_64k_runs_without_the_score_matrix() -> None:
    """float32 SDPA with 8 query heads on 4 KV heads at 64K: the math kernel's S x S scores would be 128 GiB;
    with the repeated KV heads the step stays within a few GiB (and matches the bf16 run's output roughly)."""
    q, k, v = _qkv(1, 65536, 8, 4, 32, torch.float32, device="cuda", seed=1)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = attention_sdpa(q, k, v, None, 32**-0.5)
    assert torch.cuda.max_memory_allocated() - base < 4 * 2**30
    ref = attention_sdpa(q.bfloat16(), k.bfloat16(), v.bfloat16(), None, 32**-0.5)
    torch.testing.assert_close(out, ref.float(), rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("doc_ids", [None, DOCS])
def test_sdpa_per_kv_head_equals_one_call(doc_ids, monkeypatch: pytest.MonkeyPatch) -> None:
    """With GQA, attention_sdpa makes one SDPA call per group of query heads (``sdpa_head_groups``: 4 here, 2
    per KV head; flash's backward then holds one group's per-head dk/dv and dq accumulator at a time): the
    output and the gradients of q, k, v are those of one call. Pairing a group with the other KV head fails."""
    import megaseq.models.common.attention as attn

    assert [attn.sdpa_head_groups(*h) for h in ((8, 2), (8, 8), (8, 1), (32, 4), (12, 1), (6, 2))] == [4, 1, 4, 4, 4, 2]
    q, k, v = (t.requires_grad_() for t in _qkv(2, 11, 8, 2, 16, torch.float32, seed=6))
    g_out = torch.randn(2, 11, 8, 16, generator=torch.Generator().manual_seed(7))

    def run():
        out = attention_sdpa(q, k, v, doc_ids, 0.25)
        return (out, *torch.autograd.grad(out, (q, k, v), g_out))

    grouped = run()
    monkeypatch.setattr(attn, "sdpa_head_groups", lambda h, kv: 1)
    one_call = run()
    for a, b in zip(grouped, one_call):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    monkeypatch.undo()
    sdpa, heads = attn._sdpa_causal, k.split(1, dim=2)

    def next_heads(q_g, k_g, v_g, *a):  # each group reads the other KV head
        return sdpa(q_g, heads[1] if k_g.data_ptr() == heads[0].data_ptr() else heads[0], v_g, *a)

    monkeypatch.setattr(attn, "_sdpa_causal", next_heads)
    assert not torch.allclose(run()[0], one_call[0], atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("groups", [1, 4])
def test_sdpa_backward_memory_is_the_planned_temporaries(groups, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 SDPA backward at Qwen3-30B-A3B's heads (32 query heads on 4 KV heads, D 128), 64K tokens: the peak
    above what exists before it (the inputs, the output, its gradient) is ``plan.layers.attention_temp``
    within 10% in one call; per KV head (``sdpa_head_groups``) at most the plan and more than the gradients
    alone. Per KV head the plan holds the per-call term of the 600K Qwen3-30B-A3B step (cuDNN, 2 float32
    buffers of a call's q), above a 64K call's; docs/lora.md gives the H200 figures."""
    import megaseq.models.common.attention as attn
    import megaseq.plan.layers as plan_layers
    from megaseq.plan.layers import attention_temp
    from megaseq.plan.mesh import Mesh, precision_for

    for module in (attn, plan_layers):
        monkeypatch.setattr(module, "sdpa_head_groups", lambda h, kv: groups if 1 < kv < h else 1)
    spec = get_preset("qwen3-moe-tiny").replace(num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                                 hidden_size=2048)
    n = 65536
    q, k, v = (t.requires_grad_() for t in _qkv(1, n, 32, 4, 128, torch.bfloat16, device="cuda", seed=8))
    out = attention_sdpa(q, k, v, None, 128**-0.5)
    measured = cuda_backward_peak(out, torch.randn_like(out))
    planned = attention_temp(spec, n, precision_for("bf16"), True, Mesh())
    if groups == 1:
        assert abs(measured / planned - 1) < 0.10, (groups, measured / 2**30, planned / 2**30)
    else:  # an upper bound: a 64K call's cuDNN workspace is smaller than a 600K layer's
        grads = n * 2 * (32 + 2 * 4) * 128  # dq, dk, dv alone
        assert grads < measured <= 1.05 * planned, (groups, measured / 2**30, planned / 2**30)


def test_lower_right_causal_under_a_dispatch_mode() -> None:
    """The last ``Lq`` of ``L`` queries (a segment after the ones carried): the lower-right causal SDPA equals the
    explicit mask, and runs as well under a dispatch mode (the memory census ``bench.live.CreatedStorages``; torch's
    FLOP counter is one too), inside which its tensor-subclass mask cannot be made."""
    from megaseq.bench.live import CreatedStorages
    from megaseq.models.common.attention import _sdpa_lower_right

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 5, 8, generator=gen)
    k, v = (torch.randn(1, 2, 12, 8, generator=gen) for _ in range(2))
    keep = torch.ones(5, 12, dtype=torch.bool).tril(12 - 5)  # query i sees keys up to 7 + i
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=0.3)
    torch.testing.assert_close(_sdpa_lower_right(q, k, v, 0.3), want)
    with CreatedStorages() as live:
        got = _sdpa_lower_right(q, k, v, 0.3)
    torch.testing.assert_close(got, want)
    assert live.peak >= got.numel() * got.element_size()  # the mode saw the attention's ops

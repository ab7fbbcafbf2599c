"""MoE block parity with the transformers routers/experts (float64, CPU) and dispatch bookkeeping.

megaseq's routers compute in ``promote_types(x.dtype, float32)`` where HF casts to float32 literally,
so the float64 comparisons run HF's router code with those casts promoted (``promote_hf_routers_``);
``test_routers_match_unmodified_hf_bitwise`` checks the real code in float32 and bf16, where both agree.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
import textwrap
import types
from collections.abc import Callable

import pytest
import torch

from megaseq.models.common.mlp import MLP
from megaseq.models.common.moe import MoE
from megaseq.models.common.norm import RMSNorm
from megaseq.models.spec import ModelSpec
from megaseq.ops import dispatch
from megaseq.ops.moe_glue.reference import grouped_mm_reference

transformers = pytest.importorskip("transformers")
from transformers.models.glm5_next import modeling_glm5_next as hf_glm  # noqa: E402
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf_qwen  # noqa: E402

torch.set_num_threads(2)
H, I, E = 24, 10, 12


def _glm_spec(**kw) -> ModelSpec:
    base = dict(family="glm5_next", vocab_size=16, hidden_size=H, num_layers=1, layer_types=("kda",),
                mlp_types=("moe",), num_experts=E, num_experts_per_tok=3, moe_intermediate_size=I,
                num_shared_experts=1, router="sigmoid_bias", swiglu_limit=0.7, routed_scaling_factor=2.5,
                n_group=1, topk_group=1)
    return ModelSpec(**{**base, **kw})


def _qwen_spec(**kw) -> ModelSpec:
    base = dict(family="qwen3_moe", vocab_size=16, hidden_size=H, num_layers=1, layer_types=("attention",),
                mlp_types=("moe",), num_experts=E, num_experts_per_tok=3, moe_intermediate_size=I,
                router="softmax", norm_topk_prob=True)
    return ModelSpec(**{**base, **kw})


HF_ROUTERS = ("Glm5NextTextTopkRouter", "Qwen3MoeTopKRouter")


def promote_hf_routers_(model: torch.nn.Module) -> torch.nn.Module:
    """Rebinds every HF router of ``model`` to its own ``forward`` with the float32 casts turned into
    float64 (megaseq's ``promote_types(x, float32)`` for float64 input); the rest of HF is untouched."""
    found = 0
    for m in model.modules():
        if type(m).__name__ in HF_ROUTERS or type(m).__name__.lower().endswith("topkrouter"):
            m.forward = types.MethodType(_promoted_forward(type(m)), m)
            found += 1
    assert found, "no HF router in the model"
    return model


@functools.cache
def _promoted_forward(cls: type) -> types.FunctionType:
    src = textwrap.dedent(inspect.getsource(cls.forward))
    new = re.sub(r"\btorch\.float(32)?\b", "torch.float64", src).replace(".float()", ".double()")
    assert new != src, f"{cls.__name__}.forward has no float32 cast any more: update promote_hf_routers_"
    scope: dict = {}
    exec(compile(new, f"{inspect.getsourcefile(cls)}[{cls.__name__} float64]", "exec"),
         sys.modules[cls.__module__].__dict__, scope)  # HF's module globals (torch, F), not modified
    return scope["forward"]


def _hf_glm_moe(spec: ModelSpec, promote: bool = True) -> torch.nn.Module:
    cfg = hf_glm.Glm5NextTextConfig(
        hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_hidden_layers=1,
        num_experts_per_tok=spec.num_experts_per_tok, n_shared_experts=spec.num_shared_experts,
        n_group=spec.n_group, topk_group=spec.topk_group, norm_topk_prob=spec.norm_topk_prob,
        routed_scaling_factor=spec.routed_scaling_factor, swiglu_limit=spec.swiglu_limit)
    cfg._experts_implementation = "eager"
    hf = hf_glm.Glm5NextTextMoE(cfg)
    return promote_hf_routers_(hf) if promote else hf


def _hf_qwen_moe(spec: ModelSpec, promote: bool = True) -> torch.nn.Module:
    cfg = hf_qwen.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E,
                                 num_experts_per_tok=spec.num_experts_per_tok,
                                 norm_topk_prob=spec.norm_topk_prob)
    cfg._experts_implementation = "eager"
    hf = hf_qwen.Qwen3MoeSparseMoeBlock(cfg)
    return promote_hf_routers_(hf) if promote else hf


def _randomize_and_copy(hf: torch.nn.Module, ours: torch.nn.Module, gen: torch.Generator, bias: bool) -> None:
    hf.double()
    ours.double()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)
        if bias:
            b = hf.gate.e_score_correction_bias
            b.copy_(torch.randn(b.shape, generator=gen, dtype=torch.float64) * 0.3)
    missing, unexpected = ours.load_state_dict(hf.state_dict(), strict=True)
    assert not missing and not unexpected


def _assert_close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-10) -> None:
    err = (a - b).abs().max().item()
    scale = b.abs().max().item()
    assert err <= rtol * max(scale, 1e-30), f"max abs err {err:.3e} vs scale {scale:.3e}"


def _check_parity(spec: ModelSpec, hf: torch.nn.Module, seed: int, shape=(3, 7),
                  prepare: Callable[[MoE, torch.nn.Module], None] | None = None) -> MoE:
    """Output, input gradient and every parameter's gradient against ``hf`` (float64); ``prepare(ours, hf)``
    runs after the weights are copied (e.g. switching both to balanced routing)."""
    gen = torch.Generator().manual_seed(seed)
    ours = MoE(spec)
    _randomize_and_copy(hf, ours, gen, bias=spec.router == "sigmoid_bias")
    if prepare is not None:
        prepare(ours, hf)
    x = torch.randn(*shape, H, generator=gen, dtype=torch.float64)
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_hf, y_ours = hf(x_hf), ours(x_ours)
    _assert_close(y_ours, y_hf)
    g = torch.randn(y_hf.shape, generator=gen, dtype=torch.float64)
    y_hf.backward(g)
    y_ours.backward(g)
    _assert_close(x_ours.grad, x_hf.grad)
    ours_params = dict(ours.named_parameters())
    for name, p in hf.named_parameters():
        assert p.grad is not None, name
        _assert_close(ours_params[name].grad, p.grad)
    return ours


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_router_matches_qwen3(norm: bool) -> None:
    spec = _qwen_spec(norm_topk_prob=norm)
    _check_parity(spec, _hf_qwen_moe(spec), seed=1)


@pytest.mark.parametrize("n_group,topk_group,norm", [(1, 1, True), (4, 2, True), (3, 1, False), (6, 4, True)])
def test_sigmoid_bias_router_matches_glm5(n_group: int, topk_group: int, norm: bool) -> None:
    spec = _glm_spec(n_group=n_group, topk_group=topk_group, norm_topk_prob=norm)
    _check_parity(spec, _hf_glm_moe(spec), seed=2 + n_group)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("router", ["softmax", "sigmoid_bias"])
def test_routers_match_unmodified_hf_bitwise(router: str, dtype: torch.dtype) -> None:
    """The installed HF routers as they are, in float32 and bf16: same weights and experts, bit for bit."""
    if router == "softmax":
        spec = _qwen_spec()
        hf = _hf_qwen_moe(spec, promote=False).gate
    else:
        spec = _glm_spec(n_group=4, topk_group=2)
        hf = _hf_glm_moe(spec, promote=False).gate
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for t in hf.state_dict().values():
            t.copy_(torch.randn(t.shape, generator=gen) * 0.5)
    if router == "softmax":
        hf.to(dtype)  # HF's Qwen router weight lives in the model dtype; megaseq keeps it float32
    ours = MoE(spec).gate
    ours.load_state_dict(hf.state_dict(), strict=True)
    x = torch.randn(37, H, generator=gen).to(dtype)
    _, w_hf, e_hf = hf(x)
    w_ours, e_ours = ours(x)
    assert w_ours.dtype == w_hf.dtype and torch.equal(e_ours, e_hf) and torch.equal(w_ours, w_hf)


def test_group_limited_choice_stays_in_chosen_groups() -> None:
    spec = _glm_spec(n_group=4, topk_group=1, num_experts_per_tok=2)
    moe = MoE(spec).double()
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    _, experts_NK = moe.gate(x)
    groups = experts_NK // (E // 4)
    assert (groups == groups[:, :1]).all(), "with topk_group=1 every token's experts share one group"


def test_skewed_routing_and_tokens_per_expert() -> None:
    """A huge correction bias sends every token to the same two experts; outputs still match HF."""
    spec = _glm_spec(num_experts_per_tok=2)
    hf = _hf_glm_moe(spec)
    ours = _check_parity(spec, hf, seed=9)  # randomizes both identically; now skew them
    with torch.no_grad():
        for m in (hf, ours):
            m.gate.e_score_correction_bias.zero_()
            m.gate.e_score_correction_bias[4] = 50.0
            m.gate.e_score_correction_bias[7] = 20.0
    x = torch.randn(2, 11, H, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    _assert_close(ours(x), hf(x))
    counts = ours.last_tokens_per_expert
    assert counts.dtype == torch.int64 and counts.shape == (E,) and not counts.requires_grad
    assert counts[4] == 22 and counts[7] == 22 and counts.sum() == 44


def test_tokens_per_expert_counts_routing() -> None:
    spec = _qwen_spec()
    moe = MoE(spec).double()
    x = torch.randn(5, 13, H, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    moe(x)
    _, experts_NK = moe.gate(x.reshape(-1, H))
    expected = torch.zeros(E, dtype=torch.int64)
    for e in experts_NK.reshape(-1).tolist():
        expected[e] += 1
    assert torch.equal(moe.last_tokens_per_expert, expected)


def test_grouped_mm_reference_and_dispatch_record() -> None:
    gen = torch.Generator().manual_seed(4)
    counts = torch.tensor([3, 0, 5, 1])
    x = torch.randn(9, 7, generator=gen, dtype=torch.float64)
    w = torch.randn(4, 5, 7, generator=gen, dtype=torch.float64)
    rows = torch.repeat_interleave(torch.arange(4), counts)
    expected = torch.einsum("md,mod->mo", x, w[rows])
    _assert_close(grouped_mm_reference(x, w, counts), expected)
    dispatch.reset_records()
    MoE(_qwen_spec(), layer="layers.0.mlp")(torch.randn(4, H))
    recs = {r.op: r.impl for layer, r in dispatch.records() if layer == "layers.0.mlp"}
    assert recs.get("grouped_mm") == "torch_loop"
    assert recs.get("moe_permute") == recs.get("moe_combine") == "torch"  # the references on the CPU


@pytest.mark.parametrize("limit", [None, 0.3])
def test_mlp_and_norm_match_hf(limit: float | None) -> None:
    gen = torch.Generator().manual_seed(6)
    if limit is None:
        hf = hf_qwen.Qwen3MoeMLP(hf_qwen.Qwen3MoeConfig(hidden_size=H, intermediate_size=I))
    else:
        hf = hf_glm.Glm5NextTextMLP(hf_glm.Glm5NextTextConfig(hidden_size=H, intermediate_size=I,
                                                              swiglu_limit=limit, num_hidden_layers=1))
    ours = MLP(H, I, swiglu_limit=limit)
    _randomize_and_copy(hf, ours, gen, bias=False)
    x = torch.randn(3, 5, H, generator=gen, dtype=torch.float64)
    _assert_close(ours(x), hf(x))
    hf_norm, norm = hf_qwen.Qwen3MoeRMSNorm(H, eps=1e-6).double(), RMSNorm(H, eps=1e-6).double()
    with torch.no_grad():
        hf_norm.weight.copy_(torch.randn(H, generator=gen, dtype=torch.float64))
        norm.weight.copy_(hf_norm.weight)
    assert torch.equal(norm(x), hf_norm(x))


@pytest.mark.parametrize("kw,match", [
    (dict(n_group=5), "n_group"), (dict(n_group=12), "top-2"), (dict(n_group=4, topk_group=5), "topk_group"),
    (dict(router="top1"), "router"),
])
def test_bad_moe_settings_raise(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MoE(_glm_spec(**kw))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_mm_fast_matches_reference_on_gpu() -> None:
    impl = dispatch.implementations("grouped_mm")["torch_grouped_mm"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.tensor([37, 0, 130, 5, 64], device="cuda")
    x = torch.randn(int(counts.sum()), 64, device="cuda", generator=gen).bfloat16().requires_grad_()
    w = torch.randn(5, 48, 64, device="cuda", generator=gen).bfloat16().requires_grad_()
    assert impl.supports(x, w, counts) is None
    y_fast = impl.fn(x, w, counts)
    y_ref = grouped_mm_reference(x.float(), w.float(), counts.cpu())
    torch.testing.assert_close(y_fast.float(), y_ref, rtol=2e-2, atol=2e-2)
    g = torch.randn_like(y_fast)
    gx, gw = torch.autograd.grad(y_fast, (x, w), g)
    rx, rw = torch.autograd.grad(grouped_mm_reference(x, w, counts.cpu()), (x, w), g)
    torch.testing.assert_close(gx.float(), rx.float(), rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(gw.float(), rw.float(), rtol=2e-2, atol=5e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_moe_bf16_on_gpu_uses_grouped_mm_and_matches_float64() -> None:
    spec = _glm_spec(num_experts=16, num_experts_per_tok=4, hidden_size=64, moe_intermediate_size=32,
                     swiglu_limit=10.0, n_group=4, topk_group=2)
    ref = MoE(spec).double()
    with torch.no_grad():
        ref.gate.e_score_correction_bias.normal_(0.0, 0.1)
    fast = MoE(spec, layer="gpu.mlp").cuda()
    fast.load_state_dict(ref.state_dict())
    fast.experts.bfloat16()
    fast.shared_experts.bfloat16()  # the router stays float32, as build_model keeps it
    x = torch.randn(3, 301, 64).bfloat16().double()  # bf16-exact, so both routers see the same inputs
    gpu_moe_matches_float64(fast, ref, x, "gpu.mlp")


def gpu_moe_matches_float64(fast: MoE, ref: MoE, x: torch.Tensor, layer: str) -> None:
    """``fast`` (bf16 experts on the GPU, dispatched as ``layer``) runs both expert matmuls as grouped_mm's and
    matches ``ref`` (float64, CPU) on ``x`` (bf16-exact): the output and every parameter's gradient."""
    dispatch.reset_records()
    y_fast = fast(x.cuda().bfloat16())
    # the layer's records hold every op it dispatches (swiglu, moe_permute and moe_combine run their "torch"
    # references unless their opt-in Triton kernels are preferred); both expert matmuls must be grouped_mm's
    ran = {(r.op, r.impl) for name, r in dispatch.records() if name == layer}
    assert {impl for op, impl in ran if op == "grouped_mm"} == {"torch_grouped_mm"}, ran
    y_ref = ref(x)
    torch.testing.assert_close(y_fast.double().cpu(), y_ref, rtol=5e-2, atol=5e-2)
    y_fast.float().square().sum().backward()
    y_ref.square().sum().backward()
    for name, p in ref.named_parameters():
        g_fast = dict(fast.named_parameters())[name].grad.double().cpu()
        rel = (g_fast - p.grad).norm() / p.grad.norm()
        assert rel < 5e-2, f"{name}: relative grad error {rel:.3e}"


def test_combine_returns_the_residual_dtype_whatever_sum_promotes_to(monkeypatch) -> None:
    """CUDA autocast runs ``sum`` in float32 (CPU autocast does not): the MoE's output must still be in the
    residual stream's dtype, or a frozen bf16 base's stream turns float32 at the first MoE layer (every later
    boundary doubled: +27% of a Qwen3-30B-A3B LoRA step's memory on an H200). The promotion is simulated here."""
    from megaseq.ops.moe_glue import reference as moe_mod

    real_sum = torch.Tensor.sum
    monkeypatch.setattr(torch.Tensor, "sum", lambda self, *a, **k: real_sum(self.float(), *a, **k))
    y = torch.randn(6 * 2, 5, dtype=torch.bfloat16)
    w = torch.rand(6, 2)
    out = moe_mod.combine(y, w, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    ref = (y.float() * w.reshape(-1, 1)).bfloat16().float().view(6, 2, 5).sum(dim=1).bfloat16()
    assert torch.equal(out, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_moe_under_cuda_autocast_keeps_a_bf16_stream_bf16() -> None:
    """The real promotion: a bf16 input under bf16 autocast (fp32 router, bf16 experts: a frozen bf16
    base) comes out bf16."""
    spec = _glm_spec(num_experts=16, num_experts_per_tok=4, hidden_size=64, moe_intermediate_size=32,
                     n_group=4, topk_group=2)
    moe = MoE(spec, layer="gpu.mlp").cuda()
    moe.experts.bfloat16()
    moe.shared_experts.bfloat16()
    x = torch.randn(2, 33, 64, device="cuda").bfloat16()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert moe(x).dtype == torch.bfloat16


def test_expert_counts_match_bincount_without_it(monkeypatch) -> None:
    """The experts' row counts equal torch.bincount's (unused experts included), and the MoE forward never calls
    bincount: on CUDA it reads its input's min and max back to the host, two syncs per layer and pass."""
    from megaseq.models.common.moe import expert_counts

    gen = torch.Generator().manual_seed(4)
    for n, e in ((0, 5), (37, 9), (1000, 3)):
        ids = torch.randint(0, max(e - 2, 1), (n,), generator=gen)  # the last experts get no rows
        assert torch.equal(expert_counts(ids, e), torch.bincount(ids, minlength=e))
    spec = _qwen_spec()
    moe = MoE(spec).double()

    def no_bincount(*a, **k):
        raise AssertionError("torch.bincount in the MoE forward")

    monkeypatch.setattr(torch, "bincount", no_bincount)
    moe(torch.randn(2, 7, H, generator=gen, dtype=torch.float64))
    assert int(moe.last_tokens_per_expert.sum()) == 2 * 7 * spec.num_experts_per_tok

"""The planner's saved sets of the fast kernel set against what the kernels really keep for backward: whole GLM-5
layers (KDA + dense MLP, KDA + MoE, DSA + MoE) with bf16 weights, megaseq's Triton kernels (norms, SwiGLU, the MoE
glue, mHC mix, weights, collapse and merge, the fused sparse MLA, the indexer's top-k) run by the dispatcher.

Without a GPU the Triton kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest.py), whose
bf16 arithmetic is wrong: the values do not matter here, only which tensors each op keeps and their sizes. fla's
kernels (KDA's chunk, conv, forget gate and gated norm) cannot run there: their storages are left out of the
measurement and their terms out of the prediction; ``test_fla_forget_gate_keeps_its_input`` checks the gate's term
on a GPU. Each saved storage is attributed to the op whose dispatcher call made it (``saved_by_op``).
"""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch

pytest.importorskip("triton")  # on the CPU under the interpreter conftest.py selects

from megaseq.bench.saved import SavedStorages  # noqa: E402
from megaseq.models.common.context import SeqContext  # noqa: E402
from megaseq.ops import dispatch, table  # noqa: E402
from megaseq.plan import activations, layer_terms  # noqa: E402
from megaseq.plan.planner import PLANNED_FAST_OPS  # noqa: E402

torch.set_num_threads(1)
CUDA = torch.cuda.is_available()
# the megaseq Triton kernels of the fast set (fla's and Liger's need their packages and a GPU)
TRITON_OPS = ("rms_norm", "swiglu", "moe_permute", "moe_combine", "hc_mix", "hc_weights", "hc_collapse", "hc_merge",
              "sparse_attention", "indexer_topk", "indexer_target")
FLA_OPS = ("kda", "causal_conv", "kda_gate", "gated_rms_norm")
FLA_TERMS = ("kda conv", "kda forget gate", "kda chunk state (q,k,v,g,A)")


@contextlib.contextmanager
def triton_on_cpu():
    """The dispatcher prefers each op's Triton kernel and runs it on CPU tensors (the interpreter)."""
    saved = {}
    preferred = {}
    for op in table.OPS:
        if op.name not in TRITON_OPS:
            continue
        impl = dispatch.implementations(op.name)[op.fast]
        saved[op.name] = (impl, impl.supports)
        dispatch._impls(op.name)[op.fast].supports = None
        preferred[op.name] = [op.fast]
        module = importlib.import_module(next(i.module for i in op.impls if i.name == op.fast))
        if hasattr(module, "CPU_INTERPRETER"):
            saved[module] = module.CPU_INTERPRETER
            module.CPU_INTERPRETER = True
    try:
        with dispatch.configured(preferred=preferred):
            yield
    finally:
        for key, value in saved.items():
            if isinstance(key, str):
                dispatch._impls(key)[value[0].name].supports = value[1]
            else:
                key.CPU_INTERPRETER = value


def saved_by_op(fn, params) -> dict[str, int]:
    """Bytes of the distinct storages autograd keeps while ``fn()`` runs, by the dispatcher op whose call made
    them (``"torch"``: outside any op), the parameters' own storages left out (``bench.saved``)."""
    saved = SavedStorages(params)
    with saved.recording():
        fn()
    return saved.by_op()


def _run(spec, seq: int):
    from megaseq.plan.given import run_for

    return run_for(spec, seq, {}, model_dtype="bf16", weights="bf16", fast_ops=PLANNED_FAST_OPS)


def predicted_without_fla(run, i: int) -> int:
    """Layer ``i``'s planned saved bytes less fla's own terms (``FLA_TERMS`` and the gated norm's part of KDA's
    output entry: its input and gate ``2 c D`` and fp32 rstd per head)."""
    spec, c = run.spec, run.prec.compute
    terms = layer_terms.layer_terms(run, i)
    out = terms.saved - sum(v for k, v in terms.attn.items() if k in FLA_TERMS)
    if spec.layer_types[i] == "kda":
        D = spec.linear_num_heads * spec.linear_head_dim
        out -= run.n * (2 * c * D + 4 * spec.linear_num_heads)
    return out


_MEASURED: dict[tuple[int, int], int] = {}


def measured_without_fla(model, i: int, seq: int) -> int:
    """Layer ``i``'s saved bytes under the Triton kernels, fla's ops apart (measured once per module)."""
    if (i, seq) not in _MEASURED:
        _MEASURED[i, seq] = _measure(model, i, seq)
    return _MEASURED[i, seq]


def _measure(model, i: int, seq: int) -> int:
    torch.manual_seed(1)
    spec = model.spec
    h = torch.randn(1, seq, spec.hc_mult, spec.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    layer = model.layers[i]
    with triton_on_cpu():
        by_op = saved_by_op(lambda: layer(h * 1.0, SeqContext()), layer.parameters())  # a non-leaf input
    assert by_op.get("hc_weights") and by_op.get("sparse_attention" if spec.layer_types[i] == "dsa" else "swiglu")
    return sum(v for op, v in by_op.items() if op not in FLA_OPS)


@pytest.fixture(scope="module")
def tiny():
    """glm5-flash-tiny a little wider (H 128, q_lora 96, kv_lora 64, I 256 / 64), so that each term the planner
    had wrong is more than the tolerance of its layer."""
    from megaseq.models.build import build_model
    from megaseq.models.presets import get_preset

    if CUDA:
        pytest.skip("the CPU interpreter's run (a GPU picks fla's kernels too: test_fla_forget_gate_keeps_its_input)")
    spec = get_preset("glm5-flash-tiny").replace(hidden_size=128, q_lora_rank=96, kv_lora_rank=64,
                                                 intermediate_size=256, moe_intermediate_size=64)
    return build_model(spec, dtype=torch.bfloat16, seed=0)


SEQ = 256  # = index_topk: the selection is its full width
TOL = 0.03


def ratio(model, i: int) -> float:
    """Planned over measured saved bytes of layer ``i`` (fla's ops apart)."""
    return predicted_without_fla(_run(model.spec, SEQ), i) / measured_without_fla(model, i, SEQ)


@pytest.mark.parametrize("i", [0, 1, 3], ids=["kda+dense", "kda+moe", "dsa+moe"])
def test_fast_saved_set_matches_the_kernels(tiny, i):
    """Each layer kind's planned saved bytes with the fast set within 3% of the storages its kernels keep (fla's
    ops apart): the Triton hc_weights keeps the mix, not Sinkhorn's iterations; the Triton norm its input and rstd
    (DSA's q/kv norms too); the sigmoid router's fp32 copy of a bf16 input is not the shared expert's input. (The
    plan counts the merge's ``comb`` in the compute dtype, the Triton merge keeps it in fp32: 64 bytes a token here,
    0.03% of a glm5-flash-1gpu layer; and the routing's int64 indices roughly.)"""
    assert abs(ratio(tiny, i) - 1) < TOL, (i, ratio(tiny, i))


def test_the_reference_weights_formula_fails_the_fast_check(tiny, monkeypatch):
    """A deliberately broken variant: the mHC term without ``fast_weights`` (the reference's Sinkhorn divisions,
    the planner before the fast hc_weights was counted) is far from what the kernels keep."""
    original = activations.hc_saved
    monkeypatch.setattr(activations, "hc_saved", lambda *a, **k: original(*a, **{**k, "fast_weights": False}))
    monkeypatch.setattr(layer_terms.C, "hc_saved", activations.hc_saved)
    assert ratio(tiny, 1) > 1.3


def test_a_shared_router_input_fails_the_fast_check(tiny, monkeypatch):
    """A deliberately broken variant: the shared expert's input taken as the router's (the planner's count
    before: one ``xb * H`` per token short with bf16 weights) falls short of what the MoE layers keep."""
    from megaseq.plan import mlp

    original = mlp.shared_expert_saved
    monkeypatch.setattr(layer_terms.MLP, "shared_expert_saved", lambda spec, n, xb, *a, **k: original(
        spec, n, xb, *a, **k) - n * xb * spec.hidden_size)
    assert ratio(tiny, 1) < 1 - TOL and ratio(tiny, 3) < 1 - TOL


def test_reference_norms_in_dsa_fail_the_fast_check(tiny, monkeypatch):
    """A deliberately broken variant: DSA's q_a / kv_a norms counted as the torch norm's (the fp32 input and the
    normalised value) though the Triton norm runs them: over by more than the tolerance."""
    from megaseq.plan import sparse_attention

    original = sparse_attention.dsa_saved
    monkeypatch.setattr(layer_terms.SA, "dsa_saved", lambda *a, **k: original(*a, **{**k, "fast_norm": False}))
    assert ratio(tiny, 3) > 1 + TOL


def test_fast_terms_by_hand():
    """The fast set's terms at glm5-flash-1gpu's widths, written out (bytes a token, bf16 weights)."""
    from megaseq.models.glm5.spec import glm5_flash_1gpu
    from megaseq.plan import linear_mixers, mlp, sparse_attention
    from megaseq.plan.mesh import Mesh, precision_for

    spec, prec = glm5_flash_1gpu(), precision_for("bf16", "bf16")
    N, M = spec.hc_mult, (2 + spec.hc_mult) * spec.hc_mult
    # hc_mix's u [M] and r, hc_weights' mix [M], hc_collapse's pre [N], all fp32
    assert activations.hc_saved(spec, prec, fast=True, fast_weights=True) == 4 * (M + 1) + 4 * (M + N) == 212
    assert activations.hc_saved(spec, prec, fast=True) == 4 * (M + 1) + 4 * (39 * (N * N + N) + 3 * N * N + 4 * N)
    # fla's gate keeps the gate projection's bf16 output [D], the reference g and the sigmoid in fp32
    D = 16 * 128
    fast = linear_mixers.kda_saved(spec, 1, 2, prec, fast_gate=True)["kda forget gate"]
    assert (fast, linear_mixers.kda_saved(spec, 1, 2, prec)["kda forget gate"]) == (2 * D, 8 * D)
    # DSA's q_a / kv_a norms (1536, 512) under the Triton norm: input + rstd, and q_b's bf16 input
    dsa = sparse_attention.dsa_saved(spec, 1, 1, 1, 2, prec, Mesh(), "gather_kv", True, impl="triton",
                                     fast_norm=True)
    assert dsa["dsa q/kv norms + q_b input"] == (2 * 1536 + 4) + (2 * 512 + 4) + 2 * 1536
    # the shared expert keeps its bf16 input (the router keeps its own fp32 copy), gate/up/product
    assert mlp.shared_expert_saved(spec, 1, 2, prec, fast=True) == 2 * 2048 + 3 * 2 * 1024


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA (fla's kernels)")
def test_fla_forget_gate_keeps_its_input():
    """fla's fused_kda_gate (op ``kda_gate``, the fast set's) keeps the gate projection's output, what the planner
    counts with ``kda_gate`` among the fast ops, not the reference's fp32 g and sigmoid."""
    pytest.importorskip("fla")
    from megaseq.models.common.kda import ForgetGate
    from megaseq.models.glm5.spec import glm5_flash_1gpu
    from megaseq.ops.kernels import FAST
    from megaseq.plan import linear_mixers
    from megaseq.plan.mesh import precision_for

    spec, S = glm5_flash_1gpu(), 4096
    gate = ForgetGate(spec).cuda().to(torch.bfloat16)
    for name in ("A_log", "dt_bias"):
        getattr(gate, name).data = getattr(gate, name).data.float()  # kept fp32, as build_model keeps them
    x = torch.randn(1, S, spec.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with dispatch.configured(preferred={"kda_gate": [FAST["kda_gate"].impl]}):
        by_op = saved_by_op(lambda: gate(x * 1.0), gate.parameters())
    planned = linear_mixers.kda_saved(spec, S, 2, precision_for("bf16", "bf16"), fast_gate=True)["kda forget gate"]
    assert by_op["kda_gate"] == planned, (by_op, planned)



@pytest.mark.parametrize("fast_norm,within", [(True, True), (False, False)], ids=["fast", "broken-reference-norms"])
def test_fast_mla_saved_set_matches_the_kernels(fast_norm, within):
    """Dense MLA (DeepSeek-V3's, bf16 weights) with the Triton norm keeps what ``mla_saved(fast_norm=True)`` says,
    within 3%; the broken variant, the torch norm's terms (the fp32 input and the normalised value), is over."""
    from megaseq.models.build import build_model
    from megaseq.models.presets import get_preset
    from megaseq.plan import layers
    from megaseq.plan.mesh import precision_for

    if CUDA:
        pytest.skip("the CPU interpreter's run")
    spec, S = get_preset("deepseek-v3-tiny"), 128
    mixer = build_model(spec, dtype=torch.bfloat16, seed=0).layers[spec.layer_types.index("mla")].self_attn
    x = torch.randn(1, S, spec.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    with triton_on_cpu():
        by_op = saved_by_op(lambda: mixer(x * 1.0, SeqContext()), mixer.parameters())
    assert by_op["rms_norm"]
    planned = sum(layers.mla_saved(spec, S, 2, precision_for("bf16", "bf16"), fast_norm=fast_norm).values())
    assert (abs(planned / sum(by_op.values()) - 1) < TOL) == within, (planned / S, by_op)

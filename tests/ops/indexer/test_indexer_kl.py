"""Op ``indexer_kl`` (the indexer's side of the indexer objective): the torch reference against the written-out
formula in float64, and the fused Triton kernel against the reference (KL and the gradients of q, w and keys).

Shapes: c queries, I indexer heads, D head dim, P pooled keys, K selected pools per query.

CPU: the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1`` from conftest.py; the ``device`` fixture sets
``kl.CPU_INTERPRETER`` for these tests only) in fp32 and fp16 (the interpreter computes bf16 wrongly, so bf16 runs
on the GPU) against the float64 reference on the same rounded inputs: a pool selected several times in a row, a
row without a candidate, K not a multiple of the kernel's block, I and D not powers of two, a non-uniform
incoming gradient (the backward's rerun). Broken kernels (the softmax without the candidate mask, the keys'
gradient atomics dropped, the relu's gate ignored) must fail the same check. GPU (``-m gpu``): bf16 and fp32 at
glm5-flash-1gpu's indexer shape (I 32, D 128, K 512, c 256) against float64.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

triton = pytest.importorskip("triton")

from kl_cases import grads_of, make_inputs  # noqa: E402

from devices import GPU  # noqa: E402
from megaseq.ops import dispatch  # noqa: E402
from megaseq.ops.indexer import kl  # noqa: E402
from megaseq.ops.indexer.kl_kernel import _scores  # noqa: E402
from triton_compile import broken_helper_fails, compile_in_child, interpreter_device  # noqa: E402

torch.set_num_threads(1)
CUDA = torch.cuda.is_available()
# max |x - x64| / max |x64| for (kl, dq, dw, dkeys): fp32 operands are exact to rounding; 16-bit ones round the
# inputs (shared with the reference) and the gradient's terms to the operands' dtype before the two dots
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# at the GPU's 4M dots a few may sit within fp32's rounding of 0, where the relu's gate (the gradient's) can flip
# against float64: one term of a few hundred in a dq or dkeys row, about 1e-3 of the largest
GPU_TOL = {torch.float32: 1e-3, torch.bfloat16: 2e-2}


@pytest.fixture
def device(monkeypatch) -> str:
    """cuda when present, else the cpu under the interpreter (skipped if triton was imported without it)."""
    return interpreter_device(monkeypatch, kl)


def reference64(q, w, keys, pools, t, cand, scale: float, weight=None):
    """The reference in float64 on the inputs as the op reads them: the keys rounded to the queries' dtype (the
    dots' operands; the gradient of that rounding is the identity)."""
    pools = torch.where(cand, pools, 0)  # the reference gathers every slot; the kernel reads only candidates
    return grads_of(kl.indexer_kl_reference, q.double(), w.double(), keys.to(q.dtype).double(), pools, t.double(),
                    cand, scale, None if weight is None else weight.double())


def check(q, w, keys, pools, t, cand, scale: float, tol: float, config=None, weight=None) -> None:
    """The kernel's KL and gradients against the float64 reference, each relative to the largest reference value."""
    from megaseq.ops.indexer import kl_kernel as K

    def fused(*a):
        return kl.indexer_kl_triton(*a) if config is None else _with_config(K, config, *a)

    got, g = grads_of(fused, q, w, keys, pools, t, cand, scale, weight)
    want, g64 = reference64(q, w, keys, pools, t, cand, scale, weight)
    assert got.dtype == torch.float32 and [x.dtype for x in g] == [q.dtype, w.dtype, keys.dtype]
    for name, a, b in zip(("kl", "dq", "dw", "dkeys"), (got, *g), (want, *g64), strict=True):
        err = ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
        assert err <= tol, f"{name}: max |x - x64| / max |x64| = {err:.3e}"
    has = cand.any(-1)
    assert (got[~has] == 0).all() and (g[0][~has] == 0).all() and (g[1][~has] == 0).all()


def _with_config(K, config, q, w, keys, pools, t, cand, scale):
    """The kernel at a launch configuration (small blocks: K not a multiple of BK), through ``FusedKL``."""
    real = K.default_config
    K.default_config = lambda *a: config
    try:
        return kl.indexer_kl_triton(q, w, keys, pools, t, cand, scale)
    finally:
        K.default_config = real


# ---- the kernel against the reference (CPU interpreter or GPU) ----------------------------------------------
@pytest.mark.parametrize("c,I,D,P,K,bk", [
    (5, 5, 24, 20, 37, 16),    # heads padded to 16, D to 32, K = 37 in blocks of 16 (the last partial)
    (4, 16, 32, 9, 70, None),  # more slots than pools: most repeat
    (3, 20, 16, 40, 33, 32),   # 20 heads in a block of 32
])
def test_kernel_matches_reference_fp32(device, c, I, D, P, K, bk):
    from megaseq.ops.indexer import kl_kernel as Kk

    args = make_inputs(1, c, I, D, P, K, device=device)
    assert kl.indexer_kl_supports(*args, 0.5) is None
    check(*args, 0.5, TOL[torch.float32], None if bk is None else Kk.Config(bk, 4, 1))


def test_kernel_matches_reference_fp16(device):
    args = make_inputs(2, 5, 6, 32, 25, 41, dtype=torch.float16, device=device)
    check(*args, 0.4, TOL[torch.float16])


def test_keys_of_another_dtype_are_read_in_the_queries(device):
    """fp32 keys with fp16 queries (the pooled keys of an autocast run can be wider than the queries): the dots take
    them rounded to fp16, as the reference's, and their gradient comes back in fp32."""
    q, w, keys, pools, t, cand = make_inputs(9, 4, 5, 16, 12, 21, dtype=torch.float16, device=device)
    check(q, w, keys.float(), pools, t, cand, 0.5, TOL[torch.float16])


def test_a_non_uniform_gradient_reruns_the_kernel_with_row_weights(device):
    """The backward of ``sum(weight * kl)``: not one value per row, so the kernel runs again with the weights."""
    args = make_inputs(3, 5, 4, 16, 20, 30, device=device)
    weight = torch.tensor([0.5, 2.0, -1.0, 3.0, 0.0], device=device)
    check(*args, 0.5, TOL[torch.float32], weight=weight)


def test_forward_without_gradients(device):
    q, w, keys, pools, t, cand = make_inputs(4, 3, 4, 16, 10, 12, device=device)
    got = kl.indexer_kl_triton(q, w, keys, pools, t, cand, 0.5)
    want, _ = reference64(q, w, keys, pools, t, cand, 0.5)
    assert got.grad_fn is None and (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


def test_dispatcher_runs_triton_only_when_preferred(device):
    q, w, keys, pools, t, cand = make_inputs(5, 3, 4, 16, 10, 12, device=device)
    args = (q, w, keys, torch.where(cand, pools, 0), t, cand)  # the reference gathers every slot's pool
    dispatch.reset_records()
    kl_ref = dispatch.call("indexer_kl", *args, 0.5, layer="layers.3.self_attn.indexer")
    with dispatch.configured(preferred={"indexer_kl": ["triton"]}):
        kl_tri = dispatch.call("indexer_kl", *args, 0.5, layer="layers.3.self_attn.indexer")
    assert [r.impl for _, r in dispatch.records()] == ["torch_gather", "triton"]
    assert (kl_tri - kl_ref).abs().max() <= 1e-5 * kl_ref.abs().max()


# ---- broken kernels fail the check (the interpreter reads the kernel module's globals at run time) ---------
tl = triton.language


@triton.jit
def _logits_unmasked(s_K, cand):
    """Broken: the softmax runs over every slot, not only the candidates."""
    return s_K


@triton.jit
def _no_key_grads(dk_ptr, pool, cand, offs_d, D: tl.constexpr, dk_KD):
    """Broken: the keys' gradient atomics dropped."""
    pass


@triton.jit
def _scores_linear(q_ID, w_I, keys_KD, scale, DOT_PREC: tl.constexpr):
    """Broken: the dots handed back unscaled, so the gradient's relu gate and scale miss (the score is right)."""
    dots_IK, s_K = _scores(q_ID, w_I, keys_KD, scale, DOT_PREC)
    return dots_IK / scale, s_K


BROKEN = {"softmax_over_every_slot": ("_candidate_logits", _logits_unmasked),
          "key_atomics_dropped": ("_add_key_grads", _no_key_grads),
          "dots_unscaled_in_the_gradient": ("_scores", _scores_linear)}


@pytest.mark.skipif(CUDA, reason="replaces the kernel's helpers, which only the interpreter reads at run time")
@pytest.mark.parametrize("name", list(BROKEN))
def test_a_broken_kernel_fails(device, monkeypatch, name):
    from megaseq.ops.indexer import kl_kernel as K

    args = make_inputs(6, 4, 5, 16, 12, 21, device=device)
    cfg = K.Config(16, 4, 1)
    broken_helper_fails(monkeypatch, K, BROKEN[name], lambda: check(*args, 0.5, TOL[torch.float32], cfg))


# ---- what supports refuses; the GPU code compiles for sm_90 (no GPU needed) ---------------------------
def test_supports_gives_reasons(monkeypatch):
    q, w, keys, pools, t, cand = make_inputs(7, 3, 4, 16, 10, 12)
    rest = (pools, t, cand, 0.5)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "device cpu" in kl.indexer_kl_supports(q, w, keys, *rest)  # CPU_INTERPRETER unset
    monkeypatch.setattr(kl, "CPU_INTERPRETER", True)
    assert kl.indexer_kl_supports(q, w, keys, *rest) is None
    assert kl.indexer_kl_supports(q, w, keys, pools.int(), t, cand, 0.5) is None
    assert "bfloat16" in kl.indexer_kl_supports(q.bfloat16(), w, keys.bfloat16(), *rest)
    assert "float64" in kl.indexer_kl_supports(q.double(), w, keys.double(), *rest)
    assert kl.indexer_kl_supports(q.half(), w, keys, *rest) is None
    assert "keys" in kl.indexer_kl_supports(q, w, keys.double(), *rest)
    assert "bfloat16" in kl.indexer_kl_supports(q, w, keys.bfloat16(), *rest)
    assert "fp32" in kl.indexer_kl_supports(q, w.double(), keys, *rest)
    assert "bool" in kl.indexer_kl_supports(q, w, keys, pools, t, cand.float(), 0.5)
    assert "[c, I]" in kl.indexer_kl_supports(q, w[:2], keys, *rest)
    assert "[c, K]" in kl.indexer_kl_supports(q, w, keys, pools[:, :5], t, cand, 0.5)
    assert "I = 65" in kl.indexer_kl_supports(torch.zeros(3, 65, 16), torch.zeros(3, 65), keys, *rest)
    assert "[P, D]" in kl.indexer_kl_supports(q, w, keys[:, :8], *rest)


COMPILE_SM90 = textwrap.dedent("""
    import torch
    from megaseq.ops.indexer.kl_kernel import compile_ptx
    for dtype, I, D, K, grads in [(torch.bfloat16, 32, 128, 512, True), (torch.bfloat16, 32, 128, 512, False),
                                  (torch.float32, 32, 128, 512, True), (torch.bfloat16, 64, 128, 2048, True),
                                  (torch.float16, 5, 24, 37, True)]:
        ptx, smem = compile_ptx(dtype, I, D, K, grads=grads, keys_dtype=torch.float32 if I == 64 else None)
        assert smem <= 232448, (dtype, I, D, smem)  # an H200's shared memory per block
        assert ("atom.global" in ptx) == grads, (dtype, I, D, grads)  # the keys' gradient atomics
        print(dtype, I, D, "ok", flush=True)
""")


def test_kernel_compiles_for_sm90():
    """Triton's interpreter accepts code the compiler refuses: compile the default launches for an H200 in a process
    without TRITON_INTERPRET (glm5-flash's indexer in bf16, with and without the gradients; fp32; 64 heads with
    fp32 keys; an odd small shape), each within its shared memory, the gradient launches with their atomics."""
    lines = compile_in_child(COMPILE_SM90).splitlines()
    assert len(lines) == 5 and all(line.endswith(" ok") for line in lines), lines


# ---- the objective runs the op ------------------------------------------------------------------------
def objective(device: str, preferred: dict[str, list[str]]):
    """One glm5-shaped DSA layer's sparse-stage objective (pools of 4, 64 tokens, chunks of 16 queries) in fp32:
    ``(KL, the indexer's gradients, the implementations of indexer_kl that ran)``."""
    from megaseq.models.common.context import SeqContext
    from megaseq.models.common.mla_dsa import MLASparseAttention
    from megaseq.models.glm5.spec import glm5_flash_tiny

    torch.manual_seed(0)
    spec = glm5_flash_tiny().replace(index_kpool=4, index_topk=32, index_n_heads=4)
    m = MLASparseAttention(spec, 0).to(device)
    with torch.no_grad():
        for p in m.indexer.parameters():
            p.add_(0.3 * torch.randn_like(p))
    m.indexer.kl_coef, m.indexer.query_chunk, m.layer = 1.0, 16, "layers.3.self_attn"
    m.indexer.layer = f"{m.layer}.indexer"
    x = torch.randn(1, 64, m.q_a_proj.in_features, device=device)
    q, latent, q_resid = m.project(x, SeqContext())
    prep = m.indexer.prepare(x, q_resid.detach(), SeqContext())
    idx = m.indexer.select(prep)
    dispatch.reset_records()
    with dispatch.configured(preferred=preferred):
        kl = sparse_objective_backward(m, prep, q, latent, idx)
    ran = sorted({r.impl for _, r in dispatch.records() if r.op == "indexer_kl"})
    return kl, {n: p.grad.clone() for n, p in m.indexer.named_parameters() if p.grad is not None}, ran


def sparse_objective_backward(m, prep, q, latent, idx) -> float:
    """The sparse stage's objective as the layer's backward runs it (``SparseObjective``), without the attention
    (no head-summed probabilities and no lse: op ``indexer_target`` makes the target): its summed KL."""
    from megaseq.models.common import indexer_objective

    objective = indexer_objective.SparseObjective(m, prep, q, latent, m.kv_b_proj.weight, idx)
    objective.attach(q).sum().backward()
    return m.indexer.stats.read().kl_sum


def test_the_objective_runs_the_kernel_when_preferred(device, monkeypatch):
    """The sparse stage's KL and the indexer's gradients (keys, head weights, query projection) with the kernel
    preferred equal the reference's; without the preference the reference runs (the kernel is opt-in). The kernel
    runs once per chunk of 16 queries: ``chunk_grads`` sums the rows."""
    from megaseq.ops import workspace
    from megaseq.ops.indexer import kl_kernel as K

    launches, sized = [], []
    real, chunk = K.indexer_kl, workspace.indexer_kl_chunk
    monkeypatch.setattr(K, "indexer_kl", lambda *a, **k: launches.append(k.get("row_weight")) or real(*a, **k))
    monkeypatch.setattr(workspace, "indexer_kl_chunk",
                        lambda *a, **k: sized.append(k.get("fused_kl")) or chunk(*a, **k))
    kl_ref, g_ref, ran_ref = objective(device, {})
    kl_tri, g, ran = objective(device, {"indexer_kl": ["triton"]})
    assert (ran_ref, ran) == (["torch_gather"], ["triton"])
    assert sized == [False, True]  # the chunks sized for the implementation that runs them
    assert len(launches) == 4 and all(w is None for w in launches), launches
    assert abs(float(kl_tri) - float(kl_ref)) <= 1e-5 * abs(float(kl_ref)), (float(kl_tri), float(kl_ref))
    assert g.keys() == g_ref.keys() and len(g) > 2
    for n in g:
        err = (g[n] - g_ref[n]).abs().max() / g_ref[n].abs().max()
        assert err < 1e-4, (n, float(err))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_allocates_what_the_chunk_counts(device, dtype):
    """What the op allocates through a forward and the backward of its sum (the objective's use), beyond its
    inputs, is ``ops.workspace``'s count for the kernel: per row ``indexer_kl_kernel_row_bytes`` and per chunk
    ``indexer_kl_fixed_bytes``. The count sizes the objective's chunks where the kernel runs."""
    from megaseq.bench.live import CreatedStorages
    from megaseq.ops import workspace

    c, I, D, P, K = 24, 6, 32, 40, 19
    q, w, keys, pools, t, cand = make_inputs(3, c, I, D, P, K, dtype=dtype, device=device)
    q, w, keys = (x.detach().requires_grad_() for x in (q, w, keys))
    with CreatedStorages() as live:
        kl.indexer_kl_triton(q, w, keys, pools, t, cand, 0.5).sum().backward()
    work = torch.finfo(dtype).bits // 8
    count = (c * workspace.indexer_kl_kernel_row_bytes(I, D, K, work)
             + workspace.indexer_kl_fixed_bytes(P, D, keys.element_size()))
    # at most the backward's scalar gradient above the count; on a GPU the kernels free a temporary before the
    # next is made, where the interpreter holds it (about 2 KB here)
    assert 0.9 * count <= live.peak <= count + 64, (live.peak, count)


# ---- GPU: glm5-flash-1gpu's indexer shape --------------------------------------------------------------
@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_matches_float64_at_the_glm5_flash_shape(dtype):
    """I = 32 heads of D = 128, K = 512 selected pools of P = 4096 (16K tokens in pools of 4), c = 256 queries:
    the kernel's KL and gradients against float64 on the same rounded inputs; the bf16 torch reference's own error
    is printed beside the kernel's."""
    args = make_inputs(8, 256, 32, 128, 4096, 512, dtype=dtype, device="cuda")
    assert kl.indexer_kl_supports(*args, 0.5) is None
    check(*args, 0.5, GPU_TOL[dtype])
    got, g = grads_of(kl.indexer_kl_triton, *args, 0.5)
    want, g64 = reference64(*args, 0.5)
    pools = torch.where(args[5], args[3], 0)
    ref, g_ref = grads_of(kl.indexer_kl_reference, *args[:3], pools, *args[4:], 0.5)
    for name, a, r, b in zip(("kl", "dq", "dw", "dkeys"), (got, *g), (ref, *g_ref), (want, *g64), strict=True):
        scale = b.abs().max().item()
        print(f"\n{dtype} {name}: kernel {(a.double() - b).abs().max().item() / scale:.2e}, "
              f"torch reference {(r.double() - b).abs().max().item() / scale:.2e} (relative to max |x64|)")

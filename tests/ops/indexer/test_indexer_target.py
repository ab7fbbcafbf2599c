"""Op ``indexer_target`` (the sparse stage's target of the indexer objective): the Triton kernel against the torch
reference ``torch_gather``, and the objective's chunks sized for the implementation that runs.

Shapes: c queries, Hh heads, C latent width, S keys, W selected slots per query.

CPU: the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1`` from conftest.py; the ``device`` fixture sets
``target.CPU_INTERPRETER`` for these tests only) in fp32 and fp16 against the float64 reference on the same
(rounded) inputs: empty slots (-1 and >= S), a query with no valid slot, duplicated keys, head counts that are not
powers of two (4, 20; 20 also in two blocks of 16), C = 512 and a small odd C. Broken kernels (the empty slots'
mask skipped, one normaliser for all heads, the partial head block dropped) must fail the same check. GPU
(``-m gpu``): bf16 at glm5-flash-1gpu's shape (Hh 16, C 512, W 2063, S 32K) against float64, and its working set;
the same with the fused sparse MLA's log-sum-exp (one pass). ``test_indexer_target_lse.py`` holds the CPU tests of
the one-pass kernel.
The byte formulas, the plan and the kernel sets are in ``test_indexer_target_plan.py`` (no Triton needed).
"""

from __future__ import annotations

import textwrap

import pytest
import torch

triton = pytest.importorskip("triton")

from devices import GPU  # noqa: E402
from megaseq.ops import dispatch, workspace  # noqa: E402
from megaseq.ops.indexer import target as tgt  # noqa: E402
from megaseq.ops.indexer.target_kernel import _head_block_lse, _head_block_probs  # noqa: E402
from megaseq.ops.sparse_mla.kernels import LOG2E, _gather_latents  # noqa: E402
from triton_compile import broken_helper_fails, compile_in_child, interpreter_device  # noqa: E402

torch.set_num_threads(1)
CUDA = torch.cuda.is_available()
TOL = {torch.float32: 1e-5, torch.float16: 1e-5}  # max |m - m64|, m64 in [0, Hh]: the inputs' rounding is shared


@pytest.fixture
def device(monkeypatch) -> str:
    """cuda when present, else the cpu under the interpreter (skipped if triton was imported without it)."""
    return interpreter_device(monkeypatch, tgt)


def make_inputs(seed: int, c: int, Hh: int, C: int, S: int, W: int, dtype=torch.float32, device: str = "cpu"):
    """``q_abs [c, Hh, C]``, latents ``[S, C]`` (logits of a few units), ``idx [c, W]`` int32 with -1 and >= S
    slots scattered, query 1 without a valid slot, query 2 reading one key three times and query 0 every slot."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(c, Hh, C, generator=gen) * 2 * C**-0.25
    lat = torch.randn(S, C, generator=gen) * C**-0.25
    idx = torch.randint(0, S, (c, W), generator=gen, dtype=torch.int32)
    empty = torch.rand(c, W, generator=gen) < 0.3
    idx = torch.where(empty, torch.where(torch.rand(c, W, generator=gen) < 0.5, -1, S + 3), idx).to(torch.int32)
    idx[0] = torch.randint(0, S, (W,), generator=gen, dtype=torch.int32)
    idx[1] = -1
    idx[1, ::3] = S
    idx[2, :3] = 7
    return q.to(device, dtype), lat.to(device, dtype), idx.to(device)


def reference64(q, lat, idx, scale: float) -> torch.Tensor:
    return tgt.indexer_target_reference(q.double(), lat.double(), idx, scale)


def check(q, lat, idx, scale: float, tol: float, config=None) -> torch.Tensor:
    """The kernel's ``m`` and ``lse2`` against the float64 reference; returns ``m``."""
    from megaseq.ops.indexer import target_kernel as K

    m, lse2 = K.target(q.contiguous(), lat.contiguous(), idx.contiguous(), scale, config)
    want = reference64(q, lat, idx, scale)
    assert m.dtype == torch.float32 and m.shape == idx.shape
    err = (m.double() - want).abs()
    assert err.max() <= tol, f"max |m - m64| {err.max():.3e} at {divmod(int(err.argmax()), idx.shape[1])}"
    ok = tgt.selected(idx, lat.shape[0])
    assert (m[~ok] == 0).all(), "an empty slot has mass"
    s = torch.einsum("chr,cwr->chw", q.double(), lat.double()[idx.long().clamp(0, lat.shape[0] - 1)]) * scale
    lse_want = s.masked_fill(~ok[:, None], float("-inf")).logsumexp(-1) / torch.log(torch.tensor(2.0)).double()
    has = ok.any(-1)
    assert torch.isinf(lse2[~has]).all() and (lse2[has].double() - lse_want[has]).abs().max() <= 1e-4
    return m


# ---- CPU (interpreter) or GPU: odd shapes --------------------------------------------------------------
@pytest.mark.parametrize("c,Hh,C,S,W,bh", [
    (7, 4, 48, 40, 21, None),     # heads padded to a block of 16, C padded to 64, a partial slot block
    (6, 20, 512, 30, 37, None),   # 20 heads in one block of 32, C = 512 (glm5's latent)
    (5, 20, 48, 50, 37, 16),      # 20 heads in two blocks of 16: lse2 written then read back
    (4, 3, 16, 9, 70, None),      # more slots than keys: most repeat or are empty
])
def test_kernel_matches_reference_fp32(device, c, Hh, C, S, W, bh):
    from megaseq.ops.indexer import target_kernel as K

    q, lat, idx = make_inputs(0, c, Hh, C, S, W, device=device)
    cfg = None if bh is None else K.Config(bh, 16, 4, 1)
    assert tgt.indexer_target_supports(q, lat, idx, 0.37) is None
    m = check(q, lat, idx, 0.37, TOL[torch.float32], cfg)
    assert torch.allclose(m.sum(-1)[[0, 2]], torch.full((2,), float(Hh), device=device))  # sum_w m = Hh
    assert m[1].abs().max() == 0 and m[2, :3].sum() > 0


def test_kernel_matches_reference_fp16(device):
    q, lat, idx = make_inputs(1, 6, 5, 32, 25, 19, dtype=torch.float16, device=device)
    check(q, lat, idx, 0.5, TOL[torch.float16])


def test_dispatcher_runs_triton_when_preferred(device):
    q, lat, idx = make_inputs(2, 3, 4, 16, 12, 9, device=device)
    dispatch.reset_records()
    with dispatch.configured(preferred={"indexer_target": ["triton"]}):
        m = dispatch.call("indexer_target", q, lat, idx, 0.4, layer="layers.3.self_attn")
        assert [r.impl for _, r in dispatch.records()] == ["triton"]
    assert (m.double() - reference64(q, lat, idx, 0.4)).abs().max() <= TOL[torch.float32]


# ---- broken kernels fail the check (the interpreter reads the kernel module's globals at run time) ---------
tl = triton.language


@triton.jit
def _gather_unmasked(c_row0, idx_row, w0, W: tl.constexpr, S, offs_r, R: tl.constexpr, RP: tl.constexpr,
                     BW: tl.constexpr):
    """Broken: the empty slots read as zero latents and counted as keys."""
    c_WR, row, valid = _gather_latents(c_row0, idx_row, w0, W, S, offs_r, R, RP, BW)
    return c_WR, row, (w0 + tl.arange(0, BW)) < W


@triton.jit
def _lse_joint(q_row, c_ptr, idx_row, offs_h, offs_c, S, scale_log2, W: tl.constexpr, Hh: tl.constexpr,
               C: tl.constexpr, CP: tl.constexpr, BH: tl.constexpr, BW: tl.constexpr, DOT_PREC: tl.constexpr):
    """Broken: one normaliser over every (head, slot) of the block instead of one per head."""
    qa, lse2 = _head_block_lse(q_row, c_ptr, idx_row, offs_h, offs_c, S, scale_log2, W, Hh, C, CP, BH, BW, DOT_PREC)
    fin = tl.where((offs_h < Hh) & (lse2 < float("inf")), lse2, float("-inf"))
    top = tl.max(fin, 0)
    joint = top + tl.log2(tl.sum(tl.where(fin > float("-inf"), tl.exp2(fin - top), 0.0), 0))
    return qa, tl.where(lse2 < float("inf"), joint, lse2)


@triton.jit
def _probs_whole_blocks(qa_HC, c_WC, valid, lse2_H, mask_h, scale_log2, DOT_PREC: tl.constexpr):
    """Broken: only blocks whose heads are all real are summed (a partial head block dropped)."""
    keep = mask_h & (tl.sum(mask_h.to(tl.int32), 0) == lse2_H.shape[0])
    return _head_block_probs(qa_HC, c_WC, valid, lse2_H, keep, scale_log2, DOT_PREC)


BROKEN = {"unmasked_empty_slots": ("_gather_latents", _gather_unmasked),
          "one_normaliser": ("_head_block_lse", _lse_joint),
          "partial_head_block_dropped": ("_head_block_probs", _probs_whole_blocks)}


@pytest.mark.skipif(CUDA, reason="replaces the kernel's helpers, which only the interpreter reads at run time")
@pytest.mark.parametrize("name", list(BROKEN))
def test_a_broken_kernel_fails(device, monkeypatch, name):
    """20 heads in two blocks of 16: the kernel passes, each broken variant fails the same check."""
    from megaseq.ops.indexer import target_kernel as K

    q, lat, idx = make_inputs(3, 5, 20, 48, 50, 37, device=device)
    cfg = K.Config(16, 16, 4, 1)
    broken_helper_fails(monkeypatch, K, BROKEN[name], lambda: check(q, lat, idx, 0.37, TOL[torch.float32], cfg))


# ---- what supports refuses; the GPU code compiles for sm_90 (no GPU needed) ---------------------------
def test_supports_gives_reasons(monkeypatch):
    q, lat, idx = make_inputs(5, 3, 4, 16, 12, 9)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "device cpu" in tgt.indexer_target_supports(q, lat, idx, 0.5)  # CPU_INTERPRETER unset
    monkeypatch.setattr(tgt, "CPU_INTERPRETER", True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "device cpu" in tgt.indexer_target_supports(q, lat, idx, 0.5)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tgt.indexer_target_supports(q, lat, idx, 0.5) is None
    assert tgt.indexer_target_supports(q, lat, idx.long(), 0.5) is None
    assert "bfloat16" in tgt.indexer_target_supports(q.bfloat16(), lat.bfloat16(), idx, 0.5)
    assert "float64" in tgt.indexer_target_supports(q.double(), lat.double(), idx, 0.5)
    assert "latents" in tgt.indexer_target_supports(q, lat.double(), idx, 0.5)
    wide = torch.zeros(1, 4, 1040), torch.zeros(12, 1040)
    assert "C = 1040" in tgt.indexer_target_supports(*wide, idx[:1], 0.5)
    assert "[c, W]" in tgt.indexer_target_supports(q, lat, idx[:2], 0.5)
    assert "int32" in tgt.indexer_target_supports(q, lat, idx.float(), 0.5)
    assert "[S, C]" in tgt.indexer_target_supports(q, lat[None], idx, 0.5)


COMPILE_SM90 = textwrap.dedent("""
    import torch
    from megaseq.ops.indexer.target_kernel import compile_ptx
    for dtype, Hh, C, W in [(torch.bfloat16, 16, 512, 2063), (torch.bfloat16, 20, 512, 2063),
                            (torch.bfloat16, 64, 512, 2063), (torch.float32, 16, 512, 2063),
                            (torch.bfloat16, 128, 576, 2048), (torch.float16, 4, 48, 37)]:
        ptx, smem = compile_ptx(dtype, Hh, C, W)
        assert smem <= 232448, (dtype, Hh, C, smem)  # an H200's shared memory per block
        print(dtype, Hh, C, "ok", flush=True)
""")


def test_kernel_compiles_for_sm90():
    """Triton's interpreter accepts code the compiler refuses (a loop-carried variable whose type changes): compile
    the default launches for an H200 in a process without TRITON_INTERPRET, each within its shared memory: one
    block of 16 or 32 heads, several blocks (64, 128 heads), fp32, a latent of 576 (DeepSeek's, C padded to 1024)."""
    lines = compile_in_child(COMPILE_SM90).splitlines()
    assert len(lines) == 6 and all(line.endswith(" ok") for line in lines), lines


# ---- the objective runs the implementation it sized its chunks for -------------------------------------
KL_CHUNK = workspace.indexer_kl_chunk


def objective(device: str, monkeypatch, preferred: dict[str, list[str]]):
    """One glm5-shaped DSA layer's sparse-stage objective (pools of 4, 64 tokens, chunks of 16 queries) in fp32:
    ``(KL, the indexer's gradients, the implementations of indexer_target that ran, fused_target per chunk
    sizing)``."""
    from megaseq.models.common import indexer_objective
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
    m.indexer.layer = m.layer
    x = torch.randn(1, 64, m.q_a_proj.in_features, device=device)
    ctx = SeqContext()
    q, latent, q_resid = m.project(x, ctx)
    prep = m.indexer.prepare(x, q_resid.detach(), ctx)
    idx = m.indexer.select(prep)
    sized = []
    monkeypatch.setattr(workspace, "indexer_kl_chunk", lambda *a, **k: sized.append(k.get("fused_target"))
                        or KL_CHUNK(*a, **k))
    dispatch.reset_records()
    with dispatch.configured(preferred=preferred):  # the objective as the layer's backward runs it, no attention
        objective = indexer_objective.SparseObjective(m, prep, q, latent, m.kv_b_proj.weight, idx)
        objective.attach(q).sum().backward()
    ran = [r.impl for _, r in dispatch.records() if r.op == "indexer_target"]
    grads = {n: p.grad.clone() for n, p in m.indexer.named_parameters() if p.grad is not None}
    return m.indexer.stats.read().kl_sum, grads, ran, sized


def test_the_objective_runs_the_kernel_and_sizes_its_chunks_for_it(device, monkeypatch):
    """The sparse stage's KL and the indexer's gradients with the kernel (preferred, as ``model.kernels fast`` does
    on a GPU) equal the reference's; the implementation is chosen once per batch row and the chunks are sized
    with the kernel's bytes (``fused_target``) only where it runs."""
    kl_ref, g_ref, ran_ref, sized_ref = objective(device, monkeypatch, {})
    kl, g, ran, sized = objective(device, monkeypatch, {"indexer_target": ["triton"]})
    assert (ran_ref, sized_ref) == (["torch_gather"], [False])
    assert (ran, sized) == (["triton"], [True])
    assert abs(float(kl) - float(kl_ref)) <= 1e-5 * abs(float(kl_ref)), (float(kl), float(kl_ref))
    assert g.keys() == g_ref.keys() and len(g) > 2
    for n in g:
        err = (g[n] - g_ref[n]).abs().max() / g_ref[n].abs().max()
        assert err < 1e-4, (n, float(err))


# ---- GPU: glm5-flash-1gpu's shape ----------------------------------------------------------------------
def glm5_inputs(dtype: torch.dtype, c: int = 384, S: int = 32768, seed: int = 0):
    """The last ``c`` queries of 32K keys with the indexer's layout (128 random pools of 16 and the query's tail:
    W = 2063), 16 heads, C = 512, logits of a few units (up to about 15); query 5 with no valid slot, query 6
    reading one key 16 times."""
    from megaseq.ops.sparse_mla.fused import causal_pool_selection

    gen = torch.Generator(device="cuda").manual_seed(seed)
    idx = causal_pool_selection(1, c, S, generator=gen, device="cuda")[0]
    idx[5] = -1
    idx[6, :16] = idx[6, 0]
    q = (torch.randn(c, 16, 512, device="cuda", generator=gen) * 3 * 512**-0.25).to(dtype)
    lat = (torch.randn(S, 512, device="cuda", generator=gen) * 512**-0.25).to(dtype)
    return q, lat, idx


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_matches_float64_at_the_glm5_flash_shape(dtype):
    """bf16 (and fp32) against float64 on the same rounded inputs. Bound: 2^-9, bf16's rounding unit at 1, on
    ``m`` (a sum of 16 probabilities). The kernel's logits are fp32 sums of exact bf16 products (errors near 1e-6
    of the logits' scale, a probability's relative error the same), far inside it; rounding each logit to bf16, as
    the torch reference computing in bf16 does, costs 2^-9 of the logit in every probability (logits here reach
    about 15): the torch path's own error is printed and must not be smaller than the kernel's. Broken kernels
    (per-head normalisation, an unmasked empty slot) are off by 1e-1 and more (the CPU tests show them)."""
    q, lat, idx = glm5_inputs(dtype)
    assert idx.shape == (384, 2063) and tgt.indexer_target_supports(q, lat, idx, 1.0) is None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    m = tgt.indexer_target_triton(q, lat, idx, 1.0)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    want = reference64(q, lat, idx, 1.0)
    err = (m.double() - want).abs().max().item()
    torch_err = (tgt.indexer_target_reference(q, lat, idx, 1.0).double() - want).abs().max().item()
    print(f"\n{dtype}: kernel max |m - m64| {err:.2e}, the torch reference in {dtype} {torch_err:.2e}, "
          f"peak {peak} bytes")
    if dtype == torch.bfloat16:
        assert err <= 2**-9 and err <= torch_err, (err, torch_err)
    else:  # fp32 operands, ieee dots: as exact as the fp32 reference
        assert err <= 1e-5, err
    assert (m[5] == 0).all() and (m[~tgt.selected(idx, lat.shape[0])] == 0).all()
    sums = m.sum(-1)
    assert ((sums[torch.arange(384, device="cuda") != 5] - 16).abs() <= 1e-3).all()
    # nothing of size [c, W, C] or [c, Hh, W]: the kernel's output and lse2, within the objective's row bytes
    assert peak <= 384 * workspace.indexer_target_row_bytes(16, 2063, 512, 4, dtype.itemsize, fused=True)


@pytest.mark.gpu
@GPU
def test_gpu_one_pass_with_the_attentions_lse_matches_float64():
    """bf16 at glm5-flash-1gpu's shape with the log-sum-exp the fused sparse MLA's forward computes over the same
    queries, latents and selection (its saved ``lse2 [Hh, N]``, read through the ``[c, Hh]`` view the op hands out;
    +inf on the query without a valid slot): the kernel's one pass against float64, within the two-pass bound, and
    against the two-pass kernel (the two lse differ only in the dot's summation order)."""
    from megaseq.ops.sparse_mla import kernels as SK

    q, lat, idx = glm5_inputs(torch.bfloat16)
    _, lse_HN = SK.forward(q.transpose(0, 1).contiguous(), lat[None], idx[None], 1.0)
    lse = lse_HN.t()
    assert not lse.is_contiguous() and torch.isinf(lse[5]).all()
    assert tgt.indexer_target_supports(q, lat, idx, 1.0, lse=lse) is None
    m = tgt.indexer_target_triton(q, lat, idx, 1.0, lse=lse)
    two = tgt.indexer_target_triton(q, lat, idx, 1.0)
    want = reference64(q, lat, idx, 1.0)
    err = (m.double() - want).abs().max().item()
    print(f"\none pass with the attention's lse: max |m - m64| {err:.2e}, from the two-pass "
          f"{(m - two).abs().max().item():.2e}")
    assert err <= 2**-9 and (m - two).abs().max() <= 1e-4, err
    assert (m[5] == 0).all() and (m[~tgt.selected(idx, lat.shape[0])] == 0).all()
    for name, bad in {"natural base": lse / LOG2E, "heads permuted": lse.roll(1, -1)}.items():
        wrong = (tgt.indexer_target_triton(q, lat, idx, 1.0, lse=bad).double() - want).abs().max().item()
        assert wrong > 1e-2, (name, wrong)


@pytest.mark.gpu
@GPU
def test_gpu_the_objective_runs_the_kernel_under_the_default_kernels(monkeypatch):
    """glm5-flash-1gpu's default ``model.kernels`` (fast) on a GPU: the objective's target runs the kernel, and
    its KL and gradients in fp32 equal the reference's (the CPU test's check, here compiled for the GPU)."""
    from megaseq.config import build_config
    from megaseq.train.build import kernel_settings

    cfg = build_config({"model": {"name": "glm5-flash-1gpu", "train_indexer": True}})
    preferred = kernel_settings(cfg, torch.device("cuda"))["preferred"]
    kl_ref, g_ref, ran_ref, _ = objective("cuda", monkeypatch, {})
    kl, g, ran, sized = objective("cuda", monkeypatch, preferred)
    assert (ran_ref, ran, sized) == (["torch_gather"], ["triton"], [True])
    assert abs(float(kl) - float(kl_ref)) <= 1e-4 * abs(float(kl_ref)), (float(kl), float(kl_ref))
    for n in g:
        assert (g[n] - g_ref[n]).abs().max() <= 1e-3 * g_ref[n].abs().max(), n

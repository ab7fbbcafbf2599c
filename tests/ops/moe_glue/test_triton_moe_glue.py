"""Ops ``moe_permute`` / ``moe_combine``: the Triton kernels (``ops/moe_glue/fused.py``) against the torch
references (``ops/moe_glue/reference.py``).

Without a GPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest.py before
Triton is imported) in fp32 and fp16 (the interpreter's bf16 is broken), on odd shapes: N = 37 tokens, K = 3 of E = 5
experts (one expert unused), H = 600 (two column blocks). The dtype cases are the MoE's: an fp32 stream with
fp32 sigmoid-router weights and half expert outputs, a half stream with half softmax-router weights, and
all fp32. The ``gpu`` tests add bf16 at glm5-flash-1gpu's shapes, through ``Experts.forward``.

What must hold: the permutation's rows bit for bit (a gather and a cast); the combine's output and all
gradients within fp32 rounding of the references (the kernels sum in their own order), with each product
rounded where torch rounds it. A kernel that drops one of the K rows, or skips the rounding of half products,
fails.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

pytest.importorskip("triton")  # on the CPU under the interpreter conftest.py selects

from devices import BF16, DEV, F16, F32, GPU  # noqa: E402
from megaseq.models.common import moe  # noqa: E402
from megaseq.ops import _triton_util, dispatch  # noqa: E402
from megaseq.ops.moe_glue import fused as glue  # noqa: E402
from megaseq.ops.moe_glue import reference as moe_ref  # noqa: E402
from numerics import assert_close  # noqa: E402
from triton_compile import compile_in_child  # noqa: E402

torch.set_num_threads(1)
HALF = BF16 if DEV == "cuda" else F16


def _routing(N: int, K: int, E: int, seed: int = 0):
    """``order_M``, ``inverse_M`` as ``Experts.forward`` builds them; expert E-1 gets no row."""
    gen = torch.Generator().manual_seed(seed)
    experts_NK = torch.stack([torch.randperm(E - 1, generator=gen)[:K] for _ in range(N)])
    order_M = torch.argsort(experts_NK.reshape(-1), stable=True)
    inverse_M = torch.empty_like(order_M)
    inverse_M[order_M] = torch.arange(order_M.numel())
    return order_M.to(DEV), inverse_M.to(DEV)


def _close(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float) -> None:
    assert got.dtype == want.dtype, (name, got.dtype, want.dtype)
    assert_close(name, got, want, rtol)


def _grads(out: torch.Tensor, inputs: list[torch.Tensor], seed: int = 7):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(DEV, out.dtype)
    return torch.autograd.grad(out, inputs, g)


# ---- moe_permute -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("x_dtype,dtype", [(F32, F32), (F32, HALF), (HALF, HALF)])
def test_permute_matches_reference(x_dtype, dtype):
    N, K, E, H = 37, 3, 5, 600
    order_M, inverse_M = _routing(N, K, E)
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(1)).to(DEV, x_dtype).requires_grad_()
    assert glue.moe_permute_triton_supports(x, order_M, inverse_M, K, dtype) == (
        None if DEV == "cuda" else "device cpu (Triton kernels need cuda)")
    got = glue.moe_permute_triton(x, order_M, inverse_M, K, dtype)
    want = moe_ref.moe_permute_reference(x, order_M, inverse_M, K, dtype).to(dtype)  # grouped_mm's cast
    assert got.dtype == dtype and torch.equal(got, want)
    (gx,) = _grads(got, [x])
    (wx,) = _grads(want, [x])
    _close("permute grad x", gx, wx, 2e-6 if x_dtype == F32 else 2e-3)


# ---- moe_combine -----------------------------------------------------------------------------------------
# (y, weights, out): all fp32; glm5's fp32 stream (half expert outputs, fp32 sigmoid weights); a half
# stream with half softmax weights; half softmax weights into an fp32 stream
COMBINE_CASES = [(F32, F32, F32), (HALF, F32, F32), (HALF, HALF, HALF), (HALF, HALF, F32)]


def _combine_inputs(y_dtype, w_dtype, N=37, K=3, E=5, H=600, seed=2):
    order_M, inverse_M = _routing(N, K, E, seed)
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(N * K, H, generator=gen).to(DEV, y_dtype).requires_grad_()
    w = torch.rand(N, K, generator=gen).add(0.1).to(DEV, w_dtype).requires_grad_()
    return y, order_M, inverse_M, w


@pytest.mark.parametrize("y_dtype,w_dtype,dtype", COMBINE_CASES)
def test_combine_matches_reference(y_dtype, w_dtype, dtype):
    y, order_M, inverse_M, w = _combine_inputs(y_dtype, w_dtype)
    got = glue.moe_combine_triton(y, order_M, inverse_M, w, dtype)
    want = moe_ref.moe_combine_reference(y, order_M, inverse_M, w, dtype)
    half = dtype != F32 or y_dtype != F32
    _close("combine out", got, want, 2e-3 if dtype != F32 else 2e-6)
    for name, a, b in zip(("grad y", "grad w"), _grads(got, [y, w]), _grads(want, [y, w])):
        _close(f"combine {name}", a, b, 4e-3 if half else 2e-6)


def test_combine_rounds_half_products_as_torch():
    """Half y and weights: torch rounds each product to half before the sum; without that rounding the
    kernel's output moves by more than its fp32 summation order can (checked against a no-rounding run)."""
    y, order_M, inverse_M, w = _combine_inputs(HALF, HALF, seed=4)
    want = moe_ref.moe_combine_reference(y, order_M, inverse_M, w, F32).detach()
    got = glue.moe_combine_triton(y, order_M, inverse_M, w, F32).detach()
    out = torch.empty_like(got)
    glue._sum_rows(y.detach(), inverse_M, w.detach().reshape(-1).contiguous(), out, 3, round_p=False)
    err_ok = (got - want).abs().max().item()
    err_unrounded = (out - want).abs().max().item()
    assert err_ok < 1e-5 and err_unrounded > 10 * max(err_ok, 1e-7), (err_ok, err_unrounded)


def test_combine_with_one_row_dropped_fails(monkeypatch):
    """The deliberately broken kernel (each token sums K - 1 of its rows) is caught."""
    K_mod = _triton_util.kernels(glue.KERNELS)
    real = K_mod.sum_rows_kernel

    class OneShort:
        def __getitem__(self, grid):
            return lambda *a, **kw: real[grid](*a[:6], a[6] - 1, *a[7:], **kw)

    monkeypatch.setattr(K_mod, "sum_rows_kernel", OneShort())
    y, order_M, inverse_M, w = _combine_inputs(F32, F32)
    with pytest.raises(AssertionError, match="combine out"):
        _close("combine out", glue.moe_combine_triton(y, order_M, inverse_M, w, F32),
               moe_ref.moe_combine_reference(y, order_M, inverse_M, w, F32), 2e-6)


def test_the_dispatcher_keeps_the_reference_on_the_cpu():
    """The Triton ops are opt-in and never chosen for CPU tensors (the kernels are called directly above)."""
    y, order_M, inverse_M, w = _combine_inputs(F32, F32)
    if DEV == "cpu":
        assert glue.moe_combine_triton_supports(y, order_M, inverse_M, w, F32).startswith("device cpu")
    assert dispatch.implementations("moe_combine")["triton"].opt_in
    assert dispatch.implementations("moe_permute")["triton"].opt_in


# ---- on a GPU: through Experts.forward ---------------------------------------------------------------------
@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("stream", [F32, BF16])
def test_experts_forward_matches_reference_on_the_gpu(stream):
    """glm5-flash-1gpu's routed experts (32 of 2048 -> 1024, top 8) over 4K tokens under bf16 autocast, the
    fast permute/combine against the references: output and every gradient."""
    torch.manual_seed(0)
    N, H, E, K, I = 4096, 2048, 32, 8, 1024
    ex = moe.Experts(E, H, I, swiglu_limit=10.0).cuda().to(stream)
    x = torch.randn(N, H, device="cuda", dtype=stream, requires_grad=True)
    e_NK = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(N)])
    w = torch.rand(N, K, device="cuda", requires_grad=True)
    g = torch.randn(N, H, device="cuda", dtype=stream)
    runs = {}
    for name, prefer in (("fast", {"moe_permute": ["triton"], "moe_combine": ["triton"]}), ("ref", {})):
        with dispatch.configured(prefer, {}, False), torch.autocast("cuda", torch.bfloat16):
            out, _ = ex(x, e_NK, w)
        grads = torch.autograd.grad(out, [x, w, ex.gate_up_proj, ex.down_proj], g)
        runs[name] = (out, *grads)
    for name, a, b in zip(("out", "grad x", "grad w", "grad gate_up", "grad down"), runs["fast"], runs["ref"]):
        _close(name, a, b, 1e-2)


# ---- the GPU code compiles for sm_90 (no GPU needed) ------------------------------------------------------
COMPILE_SM90 = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from megaseq.ops.moe_glue import kernels as K

    def build(kernel, sig, consts, cfg):
        fn = kernel.fn  # the autotuner's JITFunction
        names = list(fn.arg_names)
        consts = {**consts, **cfg.kwargs}
        sig = {**sig, **dict.fromkeys(consts, "constexpr")}
        aligned = [n for n, ty in sig.items() if ty.startswith("*")]
        src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()},
                        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
        out = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
        return out.metadata.shared

    ints = {"H": "i32", "K": "i32"}
    for cfg in K._ROW_CONFIGS:
        build(K.gather_rows_kernel, {"x_ptr": "*fp32", "order_ptr": "*i64", "scale_ptr": "*fp32",
                                     "out_ptr": "*bf16", "M": "i32", **ints, "stride_x": "i32"},
              {"HAS_SCALE": True, "PRE_ROUND": True}, cfg)
        for rounding in (False, True):
            build(K.sum_rows_kernel, {"y_ptr": "*bf16", "inv_ptr": "*i64", "w_ptr": "*bf16", "out_ptr": "*bf16",
                                      "N": "i32", **ints}, {"HAS_W": True, "ROUND_P": rounding, "ROUND_D": rounding},
                  cfg)
    for cfg in K._DOT_CONFIGS:
        build(K.row_dot_kernel, {"g_ptr": "*fp32", "y_ptr": "*bf16", "inv_ptr": "*i64", "out_ptr": "*fp32",
                                 "M": "i32", **ints}, {}, cfg)
    print("compiled", len(K._ROW_CONFIGS) * 3 + len(K._DOT_CONFIGS))
""")


def test_kernels_compile_for_sm90():
    """The interpreter accepts code the compiler refuses: every autotune config of the three kernels compiles
    for an H200 (sm_90) in a process without TRITON_INTERPRET."""
    assert compile_in_child(COMPILE_SM90).strip() == f"compiled {3 * 5 + 4}"

"""Activation memory formulas, in bytes, as plain functions of the shapes: the terms shared by every layer
kind (layer inputs and SCO's boundaries, linear and norm inputs, the mHC streams, the vocabulary loss,
communication buffers, the allocator's reserve). The parameter terms are in ``components.py``, which
re-exports these, the mesh, dtypes and calibration in ``mesh.py``.

Pure Python (no torch): the planner must size the full 45-layer model for 64 GPUs on a laptop.
Every formula is written out with its arithmetic in ``docs/planner.md``; the per-layer-kind working
sets are in ``layers.py`` (``kda_saved``, ``dsa_saved``, ...), their named coefficients in
``Calibration`` (``mesh.py``), so that a measured H200 peak can recalibrate one number.

Notation (per GPU): ``n = B * S / cp`` tokens this GPU holds, ``S`` the sequence length, ``H`` hidden,
``N`` = hc_mult residual streams, ``D`` = KDA heads x head dim, ``c`` compute bytes (bf16 = 2),
``f`` float32 bytes (4), ``s`` residual-stream bytes (the parameter dtype: fp32 master weights under
bf16 autocast keep the stream, norms and embeddings in fp32).

What "saved" means: the tensors autograd keeps from a layer's forward until its backward, in the
megaseq implementation (``models/blocks``), op by op, under ``torch.autocast(bf16)`` with fp32
parameters (the trainer's mode), or in a bf16 model (``optimizer_offload``: see ``precision_for``).
"""

from __future__ import annotations

from dataclasses import dataclass

from megaseq.memory.rules import WEIGHT_GRAD_ROWS, round_up
from megaseq.models.spec import ModelSpec
from megaseq.ops.workspace import LIGER_CHUNK_ROWS
from megaseq.plan.mesh import CAL, Calibration, Mesh, Precision

# a layer's projections whose weight gets a gradient, by name within the layer (LoRA,
# ``train.trainable``: an adapter counts, its ``A`` reads the same input); None: every one
Trains = frozenset[str] | None


# ---- small shared pieces -----------------------------------------------------------------------------
def layer_input_bytes(tokens: int, hidden: int, hc_mult: int, dtype_bytes: int) -> int:
    """One layer input: ``tokens x hc x H`` elements (4 x a hidden state for mHC)."""
    return tokens * hc_mult * hidden * dtype_bytes


def boundary_bytes(spec: ModelSpec, n: int, prec: Precision) -> int:
    """One checkpoint boundary (a layer input): ``n * N * H * s`` (4 x a hidden state with mHC)."""
    return layer_input_bytes(n, spec.hidden_size, spec.hc_mult, prec.stream)


@dataclass
class SCOPlan:
    num_offloaded: int  # layers whose boundary goes to host memory (the first ones)
    slot_bytes: int  # one boundary, rounded up to SLOT_ALIGN
    host_pinned_bytes: int  # the pool: num_offloaded x slot_bytes, exactly
    gpu_boundary_bytes: int  # boundaries resident on the GPU at the peak of backward


def sco_plan(num_layers: int, boundary: int, host_budget: int) -> SCOPlan:
    """What SCO (``memory/offload.py``: ``BoundaryOffloader`` sizes its pool with ``round_up``) keeps where,
    given one boundary's bytes and the host budget.

    GPU boundary bytes: the kept layers' boundaries plus at most two offloaded ones (the one in use and
    the one prefetched); with no offload (``host_budget`` 0) this is plain recompute, ``L x boundary``.
    """
    slot = round_up(boundary)
    k = min(num_layers, host_budget // slot) if slot else 0
    gpu = (num_layers - k + min(k, 2)) * boundary
    return SCOPlan(num_offloaded=k, slot_bytes=slot, host_pinned_bytes=k * slot, gpu_boundary_bytes=gpu)


def linear_inputs(width: int, num_linears: int, in_bytes: int, prec: Precision) -> int:
    """Per token: what ``num_linears`` linears reading one tensor save. Under autocast a tensor wider
    than bf16 is cast per linear (``k * c * width``: autocast caches weights, not activations);
    otherwise they share the tensor itself (``in_bytes * width``, counted once here)."""
    if prec.autocast and in_bytes != prec.compute:
        return num_linears * prec.compute * width
    return in_bytes * width


def trained_inputs(width: int, names: list[str], in_bytes: int, prec: Precision, trains: Trains) -> int:
    """``linear_inputs`` of the linears ``names`` reading one tensor, counting only those that train."""
    k = len(names) if trains is None else sum(n in trains for n in names)
    return linear_inputs(width, k, in_bytes, prec) if k else 0


def if_trained(name: str, trains: Trains) -> int:
    """1 where the projection ``name`` trains (its input is kept for its weight's gradient), else 0."""
    return 1 if trains is None or name in trains else 0


def norm_saved(width: int, in_bytes: int, prec: Precision, fast: bool = False) -> tuple[int, int]:
    """RMSNorm (``blocks/norm.py``) per token: (saved bytes, output bytes per element).

    Saved: the fp32 input (``x.to(f32)``; the input itself when already fp32) for the variance and the
    normalised value cast back to the input dtype (kept by ``weight *``): ``(f + in) * width``. The
    output is ``weight * x``, promoted to the wider of the weight and input dtypes. A frozen weight needs
    no gradient, so the normalised value is not kept: ``f * width``.

    ``fast``: the fast set's Triton norm (``ops/rms_norm/fused.py``) keeps the input itself and the fp32
    ``rstd`` of each row, ``in * width + 4``, whether the weight trains or not."""
    out = max(prec.norm or prec.param, in_bytes)
    if fast:
        return in_bytes * width + 4, out
    kept = 0 if prec.frozen_norms else in_bytes
    return (prec.f32 + kept) * width, out


def hc_saved(spec: ModelSpec, prec: Precision, cal: Calibration = CAL, fn_trains: bool = True,
             fast: bool = False, fast_weights: bool = False) -> int:
    """One HyperConnection (``blocks/mhc.py``) per token, its residual input not counted.

    The flattened streams in fp32 (a copy unless the stream is fp32), the normalised flat input of the
    ``fn`` linear (its bf16 cast under autocast, else fp32; kept only when ``fn`` trains) and the small
    [N]/[N, N] weights, of which Sinkhorn's ``2 * iters - 1`` divisions each save comb and its sums.
    ``fast``: the Triton ``hc_mix`` (``ops/mhc/mix_triton.py``) keeps the streams themselves (no copy) and
    its fp32 GEMM output ``u`` and RMS scale ``r``: ``f * (M + 1)`` with ``M = (2 + N) * N``, whether ``fn``
    trains or not (``cal.hc_mix_torch``: the closed-form torch op's, the streams and their copy in the GEMM's
    dtype where that differs from theirs).

    ``fast_weights``: the Triton ``hc_weights`` (``ops/mhc/weights_triton.py``) keeps only its fp32 copy of the
    mix ``[M]`` and recomputes the Sinkhorn iterations in its backward, and the Triton ``hc_collapse`` keeps
    ``pre`` ``[N]``: ``f * (M + N)`` in place of the reference's Sinkhorn divisions and weights."""
    N, H, f = spec.hc_mult, spec.hidden_size, prec.f32
    M = (2 + N) * N  # the mix's width: pre, post and the N x N comb
    if fast and cal.hc_mix_torch:  # ``torch_fused``: the streams and their copy in the GEMM's dtype
        mm = prec.compute if prec.autocast else f
        flat, normed = (0 if mm == prec.stream else mm * N * H), 0
    elif fast:
        flat, normed = 0, f * (M + 1)
    else:
        flat = 0 if prec.stream == f else f * N * H
        normed = (prec.compute * N * H if prec.autocast else f * N * H) if fn_trains else 0
    if fast_weights:
        return flat + normed + f * (M + N)
    sink = (2 * spec.hc_sinkhorn_iters - 1) * (N * N + N) if cal.sinkhorn_saved else 0
    return flat + normed + f * (sink + 3 * N * N + 4 * N)


def merge_temp(spec: ModelSpec, prec: Precision) -> int:
    """``HyperConnection.merge``'s forward temporaries per token: ``post * y`` in the stream dtype, the
    matmul's output (bf16 under autocast) and their sum, the new streams: ``(2s + c) * N * H``."""
    N, H, s = spec.hc_mult, spec.hidden_size, prec.stream
    return (2 * s + (prec.compute if prec.autocast else s)) * N * H


def merge_saved(spec: ModelSpec, y_bytes: int, prec: Precision, fast: bool = False) -> int:
    """``HyperConnection.merge`` per token: the block output ``y`` (kept by ``post * y``), ``post`` and
    ``comb``, and under autocast the bf16 cast of the residual that ``matmul(comb^T, residual)`` saves
    (``c * N * H``; without autocast the residual itself, counted elsewhere). ``fast``: the Triton merge
    (``ops/mhc/streams_triton.py``) keeps the residual itself, so no cast."""
    N, H, c = spec.hc_mult, spec.hidden_size, prec.compute
    cast = c * N * H if (prec.autocast and prec.stream != c and not fast) else 0
    return y_bytes * H + cast + prec.f32 * N + c * N * N


# ---- loss, communication, allocator ------------------------------------------------------------------
def vocab_loss_bytes(N: int, H: int, V: int, chunk_tokens: int, dtype_bytes: int,
                     vocab_chunk: int | None = None, weight_grad: bool = True) -> dict[str, int]:
    """Peak working bytes of the loss's forward + backward, beyond its inputs (hidden, weight, labels)
    (``memory/vocab_loss.py``; ``WEIGHT_GRAD_ROWS`` from ``memory.rules``).

    ``d`` = dtype_bytes, ``a`` = accumulation bytes (4 for half inputs, else d), ``C x Vc`` one strip.

    plain:   the logits and what cross-entropy keeps and makes of them: ``N*V*(2a + 2d)`` for half
             inputs (logits, their fp32 copy, the log-softmax, its gradient; 12 bytes per logit measured
             on an H200 in bf16), ``N*V*3a`` otherwise. Its peak comes before the input gradients exist.
    chunked: the input gradient ``N*H*d``, the per-token lse and loss ``2*N*a``, and in backward one
             strip ``C*Vc*(d + a)`` (recomputed logits, then the fp32 softmax and the input-dtype result)
             with the chunk's fp32 input-gradient accumulator ``C*H*a`` and, for half inputs, the fp32
             addmm output temporary of one block of weight-gradient rows ``min(Vc, WEIGHT_GRAD_ROWS)*H*4``;
             for half inputs the fp32 weight gradient ``V*H*4`` is held throughout and cast to ``V*H*d`` at
             the end (after the strips), otherwise the weight gradient ``V*H*d`` is the accumulator itself.
             Independent of N but for the two per-token terms. A frozen head (``weight_grad`` False) has no
             weight gradient: the strips and the per-token terms only.
    """
    d = dtype_bytes
    half = d < 4
    a = 4 if half else d
    C, Vc = min(chunk_tokens, N), min(vocab_chunk or V, V)
    plain = N * V * (2 * a + 2 * d) if half else N * V * 3 * a
    strip = C * Vc * (d + a) + C * H * a + (min(Vc, WEIGHT_GRAD_ROWS) * H * 4 if half else 0)
    per_token = 2 * N * a + N * H * d
    chunked = per_token + (V * H * 4 + max(strip, V * H * d) if half else V * H * d + strip)
    if not weight_grad:
        chunked = per_token + strip
    return {"plain": plain, "chunked": chunked}


def liger_loss_bytes(N: int, H: int, V: int, d: int, weight_grad: bool = True) -> int:
    """The fast set's loss (``ops/vocab_loss/liger.py``: Liger's fused linear cross-entropy, chunked or not), beyond
    its inputs: the input gradient ``N*H*d`` and the weight gradient ``V*H*d`` it fills during the forward
    (in the head's dtype), one chunk of logits ``rows*V*d`` written over in place by its softmax gradient
    (``rows``: at most ``ops.workspace.LIGER_CHUNK_ROWS``, ``ops.vocab_loss.liger.CHUNK_ROWS``'s default), the
    per-token fp32 loss ``4*N``; for a half head, the weight gradient's fp32 copy ``V*H*4`` at the backward
    (the cast to an fp32 parameter's gradient: counted for a bf16 parameter too, an upper bound). Measured
    at 32K x V 154,880 x H 4096 in bf16 on an H200: 1.73 GiB with Liger's own chunks of 1,024 rows
    (``benchmarks/kernels/glue_gpu.py``), these terms without the cast."""
    rows = min(LIGER_CHUNK_ROWS, N)
    grads = N * H * d + (V * H * d if weight_grad else 0)
    return grads + rows * V * d + 4 * N + (V * H * 4 if weight_grad and d < 4 else 0)


def loss_bytes(spec: ModelSpec, n: int, d: int, chunked: bool, chunk_tokens: int, weight_grad: bool = True,
               fast: bool = False) -> int:
    """The vocabulary projection + cross-entropy working set of ``spec``'s head over ``n`` tokens
    (``vocab_loss_bytes``; with the fast kernels ``liger_loss_bytes``, chunked or not), ``d`` the hidden's
    bytes."""
    if fast:
        return liger_loss_bytes(n, spec.hidden_size, spec.vocab_size, d, weight_grad)
    both = vocab_loss_bytes(n, spec.hidden_size, spec.vocab_size, chunk_tokens or n, d, weight_grad=weight_grad)
    return both["chunked" if chunked else "plain"]


def comm_buffer_bytes(spec: ModelSpec, n: int, kind: str, prec: Precision, mesh: Mesh, mode: str) -> int:
    """Context-parallel staging: send + receive copies of the largest tensor one collective moves.

    Ulysses moves ``[n, heads, d]`` blocks (KDA's g and attention's q after RoPE are fp32 under
    autocast); gather-KV receives the whole sequence's latent + indexer keys (``S * width``)."""
    if mesh.cp == 1:
        return 0
    if kind == "kda":
        return 2 * n * spec.linear_num_heads * spec.linear_head_dim * prec.f32
    if kind == "attention":
        D = spec.head_dim or spec.hidden_size // spec.num_attention_heads
        return 2 * n * spec.num_attention_heads * D * prec.f32
    if kind == "mla":  # dense MLA goes through Ulysses: q and k (fp32 under autocast) are the widest
        return 2 * n * spec.num_attention_heads * spec.qk_head_dim * prec.f32
    if kind == "gdn":  # Ulysses: q/k/v and the gate per value head
        Hv = spec.linear_num_value_heads or spec.linear_num_heads
        return 2 * n * Hv * max(spec.linear_head_dim, spec.linear_value_head_dim or 0) * prec.compute
    if mode == "ulysses":
        return 2 * n * spec.num_attention_heads * spec.qk_head_dim * prec.compute
    width = (spec.kv_lora_rank + spec.qk_rope_head_dim) * prec.f32 + 2 * spec.index_head_dim * prec.compute
    return n * mesh.cp * width + n * width


def allocator_reserve(tensor_bytes: int, cal: Calibration = CAL) -> int:
    """Caching-allocator slack: a fixed 2 GiB plus 5% of the tensors (fragmentation)."""
    return int(cal.allocator_fixed + cal.allocator_fraction * tensor_bytes)

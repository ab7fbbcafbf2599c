"""Working sets of the linear-attention token mixers: Kimi Delta Attention (KDA, whole or in segments)
and Gated DeltaNet (GDN), what each saves for backward and its temporaries, in bytes for ``n`` tokens on
one GPU, following the megaseq blocks op by op.

Pure Python. Notation and ``trains`` as in ``layers``; ``docs/planner.md`` has the arithmetic.
"""

from __future__ import annotations

from dataclasses import replace

from megaseq.models.spec import ModelSpec
from megaseq.plan.activations import Trains, if_trained, trained_inputs
from megaseq.plan.mesh import CAL, Calibration, Precision


# ---- token mixers: saved per layer, and temporaries --------------------------------------------------
def kda_saved(spec: ModelSpec, n: int, xb: int, prec: Precision, cal: Calibration = CAL,
              trains: Trains = None, fast_norm: bool = False, fast_gate: bool = False) -> dict[str, int]:
    """KDA (``blocks/kda.py``) with fla's ``chunk_kda`` on the GPU; ``xb`` bytes of the normed input.

    Per token: the six projections' inputs (q, k, v, f_a, b, g_a); the conv's input ``c * 3D`` (fla's
    conv fuses the SiLU and saves only its input; ``kda_conv_copies``); the forget gate ``2 * f * D``
    (g before the decay product, the sigmoid output; Kimi-Linear's softplus gate without a lower bound
    ``(3 f + 1) * D``; ``fast_gate``: fla's ``fused_kda_gate`` keeps only its input, the gate projection's output
    ``c * D``, and recomputes the rest in its backward); chunk_kda's ``q, k`` (l2-normed), ``v`` in bf16,
    ``g`` and its chunk cumsum in fp32, the intra-chunk ``Aqk, Akk`` ``2 * c * heads * 64`` (fla 0.6
    keeps them in the input dtype); the gated output norm ``4 * f * D`` + o_proj's input ``c * D``
    (``fast_norm``: fla's fused norm keeps its input and gate and an fp32 ``rstd`` per row, ``2 * c * D + f * Hh``,
    unless ``cal.hc_mix_torch``).
    """
    H, Hh, Dk = spec.hidden_size, spec.linear_num_heads, spec.linear_head_dim
    D, c, f = Hh * Dk, prec.compute, prec.f32
    p = "self_attn."
    six = [p + x for x in ("q_proj", "k_proj", "v_proj", "forget_gate.f_a_proj", "b_proj", "g_a_proj")]
    late = if_trained(p + "o_proj", trains) * c * D + (if_trained(p + "forget_gate.f_b_proj", trains)
                                                 + if_trained(p + "g_b_proj", trains)) * c * Dk
    return {
        "kda projections' inputs": n * trained_inputs(H, six, xb, prec, trains),
        "kda conv": n * cal.kda_conv_copies * c * 3 * D,
        # the safe gate (lower_bound * sigmoid): g and the sigmoid's output; without a lower bound (Kimi-Linear)
        # exp(g), 1 + exp(g), the where's bool mask and its output
        "kda forget gate": n * (c * D if fast_gate else 2 * f * D if spec.linear_lower_bound is not None
                                else (3 * f + 1) * D),
        "kda chunk state (q,k,v,g,A)": n * (3 * c * D + 2 * f * D + 2 * c * Hh * 64 + 2 * f * Hh),
        "kda output norm + o_proj input": n * ((2 * c * D + f * Hh if fast_norm and not cal.hc_mix_torch
                                                else (3 + if_trained(p + "o_norm", trains)) * f * D) + late),
    }


def kda_temp(spec: ModelSpec, n: int, prec: Precision, backward: bool, cal: Calibration = CAL) -> int:
    """KDA temporaries above the saved set: forward ``7 c D`` + the chunk states
    ``heads * Dk * Dv * c / 64`` per token; backward fp32 grads ``8 f D`` + recomputed ``4 c D`` + the
    states, their fp32 grads and the recomputed states ``heads * Dk * Dv * (2c + f) / 64``."""
    Hh, Dk, c, f = spec.linear_num_heads, spec.linear_head_dim, prec.compute, prec.f32
    D, states = Hh * Dk, Hh * Dk * Dk / 64
    if not backward:
        return int(n * (cal.kda_fwd_temp_cd * c * D + c * states))
    return int(n * (cal.kda_bwd_temp_fd * f * D + cal.kda_bwd_temp_cd * c * D + (2 * c + f) * states))


def kda_segmented(
    spec: ModelSpec, n: int, batch: int, T: int, xb: int, prec: Precision, cal: Calibration = CAL,
    trains: Trains = None,
    fast_norm: bool = False,
    fast_gate: bool = False,
) -> tuple[dict[str, int], int, int]:
    """KDA in segments of ``T`` tokens (``memory/kda_segments.py``): (saved, forward temp, backward temp).

    Saved: the layer's input ``xb * H`` per token (the tensor itself) and one recurrent state
    ``f * Hh * Dk * Dk`` per segment and row (``segmented_saved_bytes``). Forward: one segment's
    no-grad forward (``kda_temp`` over ``T + K - 1`` tokens plus ``nograd_fraction`` of its saved set)
    and the output ``c * H`` per token being filled. Backward: one segment's saved set and backward
    temporaries over ``T + K - 1`` tokens, and the input's gradient ``f * H`` per token."""
    H, Hh, Dk, c, f = spec.hidden_size, spec.linear_num_heads, spec.linear_head_dim, prec.compute, prec.f32
    m = min(T + spec.linear_conv_kernel - 1, n)
    segments = -(-n // (batch * T)) if batch else 0
    seg_saved = sum(kda_saved(spec, m * batch, xb, prec, cal, trains, fast_norm, fast_gate).values())
    saved = {"kda segmented: input": n * xb * H, "kda segmented: states": segments * batch * f * Hh * Dk * Dk}
    fwd = kda_temp(spec, m * batch, prec, False, cal) + int(cal.nograd_fraction * seg_saved) + n * c * H
    seg_cal = replace(cal, kda_bwd_temp_fd=cal.kda_segment_bwd_temp_fd)
    bwd = seg_saved + kda_temp(spec, m * batch, prec, True, seg_cal) + n * f * H
    return saved, fwd, bwd


def gdn_dims(spec: ModelSpec) -> tuple[int, int, int, int]:
    """(Hk, Dk, Hv, Dv): gated DeltaNet key / value heads and head dims."""
    Hk, Dk = spec.linear_num_heads, spec.linear_head_dim
    return Hk, Dk, spec.linear_num_value_heads or Hk, spec.linear_value_head_dim or Dk


def gdn_saved(spec: ModelSpec, n: int, xb: int, prec: Precision, cal: Calibration = CAL,
              trains: Trains = None) -> dict[str, int]:
    """Gated DeltaNet (``models/common/gdn.py``) with fla's ``chunk_gated_delta_rule`` on the GPU, per token.

    Hk/Dk key heads and dim, Hv/Dv value heads and dim, C = 2 Hk Dk + Hv Dv conv channels. The two
    projections' inputs (in_proj_qkvz, in_proj_ba); the gates: beta = sigmoid(b) ``c * Hv`` and the decay's
    softplus input and output ``2 f * Hv``; the conv's input ``c * C`` (``[q | k | v]`` concatenated;
    fla's conv saves only its input, the torch reference its output too: ``kda_conv_copies``); the chunk
    kernel's q and k (repeated to the Hv value heads when Hv > Hk: ``repeat_interleave`` copies), v, beta,
    the per-head fp32 decay cumsum and q/k rstd ``3 f * Hv`` and the intra-chunk ``A`` ``c * Hv * 64``;
    the gated norm ``(4 f + c) * Hv * Dv`` (fp32 input, its bf16 cast for the weight, the gate's fp32 copy,
    the weighted value and silu's output; without a cast and with Hv = Hk the gate is a view that keeps
    in_proj_qkvz's whole output)
    and out_proj's input ``c * Hv * Dv``."""
    H, c, f = spec.hidden_size, prec.compute, prec.f32
    Hk, Dk, Hv, Dv = gdn_dims(spec)
    C = 2 * Hk * Dk + Hv * Dv
    p = "linear_attn."
    # silu(z.to(fp32)) keeps z's fp32 copy; without a cast z itself: its reshape's copy when value heads are
    # grouped (Hv > Hk), else a view that keeps in_proj_qkvz's whole output
    gate = f * Hv * Dv if (c != f or Hv != Hk) else c * (2 * Hk * Dk + 2 * Hv * Dv)
    return {
        "gdn projections' inputs": n * trained_inputs(H, [p + "in_proj_qkvz", p + "in_proj_ba"], xb, prec, trains),
        "gdn gates (beta, decay)": n * (c * Hv + 2 * f * Hv),
        "gdn conv": n * cal.kda_conv_copies * c * C,
        "gdn chunk state (q,k,v,beta,g,A)": n * (c * Hv * (2 * Dk + Dv + 1 + 64) + 3 * f * Hv),
        "gdn gated norm + o_proj input": n * ((3 * f + c) * Hv * Dv + gate
                                              + c * Hv * Dv * if_trained(p + "out_proj", trains)),
    }


def gdn_temp(spec: ModelSpec, n: int, prec: Precision, backward: bool, cal: Calibration = CAL) -> int:
    """Gated DeltaNet temporaries above the saved set, KDA's coefficients (``kda_temp``: fla's chunk kernels
    of both share their structure; not fitted to GDN on a GPU) with ``D = Hv * max(Dk, Dv)`` and the chunk
    states ``Hv * Dk * Dv / 64`` per token; forward also the q and k copies before the concatenation,
    ``2 c * Hk * Dk``."""
    c, f = prec.compute, prec.f32
    Hk, Dk, Hv, Dv = gdn_dims(spec)
    D, states = Hv * max(Dk, Dv), Hv * Dk * Dv / 64
    if not backward:
        return int(n * (cal.kda_fwd_temp_cd * c * D + c * states + 2 * c * Hk * Dk))
    return int(n * (cal.kda_bwd_temp_fd * f * D + cal.kda_bwd_temp_cd * c * D + (2 * c + f) * states))

"""Working sets of the MLP kinds: a dense SwiGLU MLP, the routed experts' rows (MoE) with their router,
and the shared expert, what each saves for backward and its temporaries, in bytes on one GPU.

Pure Python. Notation and ``trains`` as in ``layers``; ``docs/planner.md`` has the arithmetic.
"""

from __future__ import annotations

from megaseq.models.spec import ModelSpec
from megaseq.plan.activations import Trains, if_trained, trained_inputs
from megaseq.plan.mesh import CAL, Calibration, Mesh, Precision


# ---- MLP and MoE -------------------------------------------------------------------------------------
def swiglu_saved_ci(spec: ModelSpec, fast: bool = False) -> int:
    """SwiGLU (``blocks/mlp.py: swiglu``) per row, in units of ``c * I``: the gate/up outputs (kept by
    the clamps or the SiLU and product), the clamped gate, SiLU output, clamped up and the product
    (down_proj's input): 6 with GLM's clamp, 4 without. ``fast``: the fast set's fused kernel
    (``ops/swiglu/fused.py``) keeps gate and up only (views of their producer) and recomputes the rest:
    with the product, 3 either way."""
    if fast:
        return 3
    return 6 if spec.swiglu_limit is not None else 4


def mlp_saved(spec: ModelSpec, n: int, intermediate: int, xb: int, prec: Precision, trains: Trains = None,
              prefix: str = "mlp.", fast: bool = False) -> int:
    """Dense SwiGLU: gate/up inputs + ``swiglu * c * I`` per token (its last, the product, is down_proj's
    input: kept only when down_proj trains; ``fast``: the fused kernel's set, ``swiglu_saved_ci``)."""
    gate_up = [prefix + "gate_proj", prefix + "up_proj"]
    swiglu = swiglu_saved_ci(spec, fast) - 1 + if_trained(prefix + "down_proj", trains)
    return n * (trained_inputs(spec.hidden_size, gate_up, xb, prec, trains) + swiglu * prec.compute * intermediate)


def moe_rows(spec: ModelSpec, tokens: int, mesh: Mesh, imbalance: float) -> int:
    """Routed rows one GPU computes for ``tokens`` tokens: ``tokens * K``. With expert parallelism a GPU
    receives rows from its ep group: ``imbalance`` (max/mean load) times the mean, and never more than
    every token of the group routed to its ``E/ep`` experts (under tiling: every token of a tile)."""
    K = spec.num_experts_per_tok
    if mesh.ep == 1:
        return tokens * K
    local = max(1, spec.num_experts // mesh.ep)
    return int(min(tokens * K * imbalance, tokens * mesh.ep * min(K, local)))


def moe_row_saved(spec: ModelSpec, xb: int, prec: Precision, trains: Trains = None, fast: bool = False) -> int:
    """Per routed row: the expert input (a cast copy; kept only when ``gate_up_proj`` trains), the SwiGLU set
    (its product, ``down_proj``'s input, only when ``down_proj`` trains) and the expert output ``c * H`` kept
    by the weighting."""
    H, I, c = spec.hidden_size, spec.moe_intermediate_size, prec.compute
    swiglu = swiglu_saved_ci(spec, fast) - 1 + if_trained("mlp.experts.down_proj", trains)
    return trained_inputs(H, ["mlp.experts.gate_up_proj"], xb, prec, trains) + swiglu * c * I + c * H


def moe_row_temp(spec: ModelSpec, xb: int, prec: Precision, backward: bool, cal: Calibration = CAL) -> float:
    """Per routed row: the temporaries above the saved set (forward, or backward)."""
    coef = cal.moe_bwd_temp_rows if backward else cal.moe_fwd_temp_rows
    extra = cal.mlp_bwd_temp_ci if backward else cal.mlp_fwd_temp_ci
    return coef * xb * spec.hidden_size + extra * prec.compute * spec.moe_intermediate_size + 24


def moe_router_saved(spec: ModelSpec, n: int, prec: Precision, trains: Trains = None) -> int:
    """The router's cast input (kept only when the router trains) and its scores ``2 * c * E``, the group
    mask, the top-k indices (int64)."""
    # the router casts x to fp32 first
    router_in = trained_inputs(spec.hidden_size, ["mlp.gate"], prec.f32, prec, trains)
    logits = prec.compute if prec.autocast else prec.f32  # autocast runs the fp32 router linear in bf16
    E, K = spec.num_experts, spec.num_experts_per_tok
    return n * (router_in + logits * E + E + 8 * (K + 3))


def moe_saved(
    spec: ModelSpec, n: int, xb: int, prec: Precision, mesh: Mesh, imbalance: float, trains: Trains = None,
    fast: bool = False,
) -> dict[str, int]:
    """MoE (``blocks/moe.py``): the router (``moe_router_saved``), per routed row ``moe_row_saved``, and the
    shared expert as a dense SwiGLU (``fast``: the fused SwiGLU's saved set)."""
    rows = moe_rows(spec, n, mesh, imbalance)
    out = {
        "moe router": moe_router_saved(spec, n, prec, trains),
        "moe routed rows (x, SwiGLU, y)": rows * moe_row_saved(spec, xb, prec, trains, fast),
    }
    if spec.num_shared_experts:
        out["moe shared expert"] = shared_expert_saved(spec, n, xb, prec, trains, fast)
    return out


def shared_expert_saved(spec: ModelSpec, n: int, xb: int, prec: Precision, trains: Trains = None,
                        fast: bool = False) -> int:
    """The shared expert as a dense SwiGLU of ``shared_expert_intermediate_size`` (or ``moe_intermediate_size``
    x shared experts); Qwen3-Next's gated one (``mlp.shared_expert``) also keeps its gate linear's input, the
    sigmoid's output and the expert's output for ``sigmoid(gate) * expert``, ``c * H`` each (+ the gate)."""
    H, c = spec.hidden_size, prec.compute
    I = spec.shared_expert_intermediate_size or spec.moe_intermediate_size * spec.num_shared_experts
    prefix = "mlp.shared_expert." if spec.shared_expert_gate else "mlp.shared_experts."
    out = mlp_saved(spec, n, I, xb, prec, trains, prefix, fast)
    gate = [prefix[:-1] + "_gate"] if spec.shared_expert_gate else []
    names = [prefix + "gate_proj", prefix + "up_proj"] + gate
    uncast = not (prec.autocast and xb != c)  # the linears keep the MoE input itself, not casts of their own
    # ... which the router's input already is, but for the sigmoid router's fp32 copy of a narrower input
    # (``x.to(float32)``: a tensor of its own with bf16 weights)
    shares = spec.router != "sigmoid_bias" or xb == prec.f32
    if uncast and shares and trained_inputs(H, ["mlp.gate"], prec.f32, prec, trains):
        out -= n * trained_inputs(H, names[:2], xb, prec, trains)
    elif gate:
        out += n * (trained_inputs(H, names, xb, prec, trains) - trained_inputs(H, names[:2], xb, prec, trains))
    return out + (n * c * (H + 1) if gate else 0)  # sigmoid(gate) * expert: the expert's output and the sigmoid


def mlp_temp(
    spec: ModelSpec,
    n: int,
    kind: str,
    xb: int,
    prec: Precision,
    mesh: Mesh,
    imbalance: float,
    backward: bool,
    cal: Calibration = CAL,
) -> int:
    """MLP/MoE temporaries above the saved set, per token (dense) or per routed row (MoE)."""
    c = prec.compute
    if kind == "dense":
        coef = cal.mlp_bwd_temp_ci if backward else cal.mlp_fwd_temp_ci
        return int(n * coef * c * spec.intermediate_size)
    rows = moe_rows(spec, n, mesh, imbalance)
    dispatch = 2 * rows * c * spec.hidden_size if mesh.ep > 1 else 0  # all-to-all send + receive
    return int(rows * moe_row_temp(spec, xb, prec, backward, cal) + dispatch)

"""Model FLOPs (for MFU), the time shares the planner prices its fixes with, and communication volume.

Pure Python. Conventions (``docs/planner.md`` has the arithmetic):

- A matmul ``[m, k] @ [k, n]`` is ``2 m k n`` FLOPs. Training = forward + backward = 3 x forward for
  everything that gets gradients. The DSA indexer runs under ``no_grad`` (HF and megaseq alike), so
  its projections and scoring count once. Recompute is not counted (model FLOPs, not hardware FLOPs).
- Causal attention counts the keys each query really attends: DSA ``min(t + 1, topk + tail)`` keys at
  position t (tail = the incomplete pool, on average ``(kpool - 1) / 2`` tokens), softmax attention
  ``t + 1``; the indexer scores the ``(t + 1) / kpool`` complete pools before each query.
- KDA's chunked delta rule (chunk C = 64, head dims dk = dv = d): per token and head ``Aqk`` and ``Akk``
  within the chunk ``2 * 2 * (C/2) * d``, ``w = A k`` and ``u = A v`` ``2 * 2 * (C/2) * d``, output
  ``Aqk @ v_new`` ``2 * (C/2) * d``, and the state terms ``q h``, ``w h`` and ``k^T v_new`` ``3 * 2 d^2``.
- MoE counts the router and the K active experts (plus the shared ones) per token.
"""

from __future__ import annotations

from dataclasses import dataclass

from megaseq.models.spec import ModelSpec
from megaseq.plan.mesh import Mesh, Precision

H200_BF16_DENSE = 989.4e12  # NVIDIA H200 SXM datasheet, dense bf16 (the MFU denominator)
H200_BF16_MEASURED = 775e12  # bf16 matmul 8192^3 on one H200
# the share of the measured matmul rate a training step reaches (the fix costs' time model): glm5-flash-1gpu
# at 32K with the fast set and bf16 weights (benchmarks/results/speed/glm5-flash-1gpu/2026-12-04_8k-32k-baseline.md):
# 53,413 tokens/s x 5.73 GFLOP = 306 TFLOP/s; the same job measured 0.30 at 8K and 0.26 at 1M, where launches
# and the indexer's quadratic scoring weigh more)
ACHIEVED_FRACTION = 0.395
PINNED_BYTES_PER_S = 55e9  # host <-> device, pinned
DEVICE_BYTES_PER_S = 4.24e12  # device copy
KDA_CHUNK = 64


def causal_keys(seq_len: int, window: float) -> float:
    """``sum_{t=0}^{S-1} min(t + 1, window)``: keys attended over a causal sequence."""
    S, K = seq_len, min(window, seq_len)
    return K * (K + 1) / 2 + (S - K) * K


@dataclass
class LayerFlops:
    """Forward FLOPs of one layer over one sequence, by part."""

    mixer: float = 0.0  # projections + attention / recurrence (trainable)
    indexer: float = 0.0  # DSA indexer (no grad: forward only)
    mlp: float = 0.0
    hc: float = 0.0  # mHC weights + collapse/merge
    core: float = 0.0  # the part of ``mixer`` with no weight: attention's scores and values, a recurrence's chunks


def _kda_core(spec: ModelSpec, S: int) -> float:
    """KDA's chunked delta rule (no weight), per token and head (see the module docstring)."""
    C, d = KDA_CHUNK, spec.linear_head_dim
    return S * spec.linear_num_heads * (2 * 2 * (C / 2) * d * 2 + 2 * (C / 2) * d + 3 * 2 * d * d)


def kda_flops(spec: ModelSpec, S: int) -> float:
    H, Hh, d = spec.hidden_size, spec.linear_num_heads, spec.linear_head_dim
    D = Hh * d
    proj = 2 * S * (3 * H * D + H * d + d * D + H * Hh + H * d + d * D + D * H)
    conv = 2 * S * 3 * D * spec.linear_conv_kernel
    return proj + conv + _kda_core(spec, S)


def dsa_flops(spec: ModelSpec, S: int, full_indexer: bool) -> tuple[float, float]:
    """(trainable mixer FLOPs, indexer FLOPs) of one DSA layer over a sequence of S tokens."""
    H, Hh = spec.hidden_size, spec.num_attention_heads
    ql, kl, qk, v = spec.q_lora_rank, spec.kv_lora_rank, spec.qk_head_dim, spec.v_head_dim
    proj = (
        2
        * S
        * (
            H * ql
            + ql * Hh * qk
            + H * (kl + spec.qk_rope_head_dim)
            + kl * Hh * (spec.qk_nope_head_dim + v)
            + Hh * v * H
        )
    )
    attn = _mla_core(spec, S, sparse=True)
    if not full_indexer:
        return proj + attn, 0.0
    I, Di, kp = spec.index_n_heads, spec.index_head_dim, max(spec.index_kpool, 1)
    idx_proj = 2 * S * (ql * I * Di + H * Di + H * I + Di * H) + 2 * S * Di * kp  # + pooling
    pools = causal_keys(S, S) / kp  # complete pools before each query, summed
    return proj + attn, idx_proj + 2 * pools * I * Di + 2 * pools * I


def attention_flops(spec: ModelSpec, S: int, window: int = 0) -> float:
    """GQA softmax attention; a sliding layer (``window`` keys, gpt-oss) attends ``min(t + 1, window)`` keys
    at position t (the sinks add one score per query and head: not counted)."""
    H, Hq, Hkv = spec.hidden_size, spec.num_attention_heads, spec.num_key_value_heads
    D = spec.head_dim or H // Hq
    gate = 2 * S * H * Hq * D if spec.attn_output_gate else 0  # Qwen3-Next: q_proj's gate half
    return 2 * S * H * (Hq + 2 * Hkv) * D + gate + 2 * S * Hq * D * H + _attention_core(spec, S, window)


def _attention_core(spec: ModelSpec, S: int, window: int = 0) -> float:
    """Softmax attention's scores and weighted values, ``4 Hq D`` per attended key."""
    D = spec.head_dim or spec.hidden_size // spec.num_attention_heads
    return 4 * spec.num_attention_heads * D * causal_keys(S, window or S)


def _mla_core(spec: ModelSpec, S: int, sparse: bool = False) -> float:
    """MLA's scores and weighted values, ``2 Hh (Dq + Dv)`` per attended key: every earlier key, or (``sparse``,
    DSA) the selected ones, ``topk`` and the average incomplete-pool tail ``(kpool - 1) / 2``."""
    if sparse:
        tail = (spec.index_kpool - 1) / 2 if spec.index_kpool_always_select_tail else 0.0
        keys = causal_keys(S, spec.index_topk + tail)
    else:
        keys = causal_keys(S, S)
    return 2 * spec.num_attention_heads * (spec.qk_head_dim + spec.v_head_dim) * keys


def mla_flops(spec: ModelSpec, S: int) -> float:
    """Dense MLA: the projections (q through q_a/q_b or one q_proj, kv_a, kv_b over every token, o_proj) and
    causal attention over ``t + 1`` keys, ``2 * Hh * (Dq + Dv)`` per key (the zero-padded value dims that
    SDPA multiplies are not counted: model FLOPs)."""
    H, Hh = spec.hidden_size, spec.num_attention_heads
    ql, kl, qk, v = spec.q_lora_rank, spec.kv_lora_rank, spec.qk_head_dim, spec.v_head_dim
    q = H * ql + ql * Hh * qk if ql else H * Hh * qk
    proj = 2 * S * (q + H * (kl + spec.qk_rope_head_dim) + kl * Hh * (spec.qk_nope_head_dim + v) + Hh * v * H)
    return proj + _mla_core(spec, S)


def gdn_flops(spec: ModelSpec, S: int) -> float:
    """Gated DeltaNet: in_proj_qkvz, in_proj_ba, the conv, out_proj, and the chunked delta rule per token and
    value head as KDA's (chunk C = 64) with key / value dims Dk / Dv: ``Aqk``, ``Akk`` ``2 * 2 * (C/2) * Dk``,
    ``w``, ``u`` ``2 * (C/2) * (Dk + Dv)``, the output ``2 * (C/2) * Dv``, the state terms ``3 * 2 Dk Dv``."""
    H, Hk, Dk = spec.hidden_size, spec.linear_num_heads, spec.linear_head_dim
    Hv, Dv = spec.linear_num_value_heads or Hk, spec.linear_value_head_dim or Dk
    proj = 2 * S * (H * (2 * Hk * Dk + 2 * Hv * Dv) + H * 2 * Hv + Hv * Dv * H)
    conv = 2 * S * (2 * Hk * Dk + Hv * Dv) * spec.linear_conv_kernel
    return proj + conv + _gdn_core(spec, S)


def _gdn_core(spec: ModelSpec, S: int) -> float:
    """Gated DeltaNet's chunked delta rule (no weight), per token and value head (see ``gdn_flops``)."""
    Dk, C = spec.linear_head_dim, KDA_CHUNK
    Hv, Dv = spec.linear_num_value_heads or spec.linear_num_heads, spec.linear_value_head_dim or Dk
    return S * Hv * (2 * 2 * (C / 2) * Dk + 2 * (C / 2) * (Dk + Dv) + 2 * (C / 2) * Dv + 3 * 2 * Dk * Dv)


def mlp_flops(spec: ModelSpec, S: int, kind: str) -> float:
    H = spec.hidden_size
    if kind == "dense":
        return 6 * S * H * spec.intermediate_size
    I, K = spec.moe_intermediate_size, spec.num_experts_per_tok
    shared = spec.shared_expert_intermediate_size or I * spec.num_shared_experts
    return 2 * S * H * spec.num_experts + 6 * S * H * (I * K + shared) + (2 * S * H if spec.shared_expert_gate else 0)


def mixer_core_flops(spec: ModelSpec, S: int, i: int) -> float:
    """Layer i's mixer FLOPs that multiply no weight (part of ``layer_flops``' ``mixer``): softmax attention's and
    MLA's scores and weighted values, DSA's over its selected keys, a linear mixer's chunked recurrence. Their
    backward is twice their forward whether or not the layer's weights train."""
    kind = spec.layer_types[i]
    if kind == "kda":
        return _kda_core(spec, S)
    if kind == "gdn":
        return _gdn_core(spec, S)
    if kind in ("mla", "dsa"):
        return _mla_core(spec, S, sparse=kind == "dsa")
    return _attention_core(spec, S, spec.sliding_window if i in spec.sliding_layers else 0)


def layer_flops(spec: ModelSpec, S: int, i: int) -> LayerFlops:
    kind, N, H = spec.layer_types[i], spec.hc_mult, spec.hidden_size
    out = LayerFlops(mlp=mlp_flops(spec, S, spec.mlp_types[i]), core=mixer_core_flops(spec, S, i))
    if N > 1:  # two hyper-connections: fn linear + collapse + merge (N x N mix)
        out.hc = 2 * (2 * S * N * H * (2 + N) * N + 2 * S * N * H + 2 * S * N * N * H)
    if kind == "kda":
        out.mixer = kda_flops(spec, S)
    elif kind == "dsa":
        out.mixer, out.indexer = dsa_flops(spec, S, spec.indexer_types[i] == "full")
    elif kind == "mla":
        out.mixer = mla_flops(spec, S)
    elif kind == "gdn":
        out.mixer = gdn_flops(spec, S)
    else:
        out.mixer = attention_flops(spec, S, spec.sliding_window if i in spec.sliding_layers else 0)
    return out


def segment_ends(S: int, segment_tokens: int = 0) -> int:
    """The sum of the ends of a sequence's segments of ``segment_tokens`` tokens over ``S`` (``S``: one pass)."""
    if not segment_tokens:
        return S
    return sum(min(e, S) for e in range(segment_tokens, S + segment_tokens, segment_tokens))


def segment_attention_rerun(spec: ModelSpec, S: int, segment_tokens: int = 0) -> float:
    """FLOPs sequence segments add to a step for softmax attention and dense MLA layers: each segment's
    attention core (queries against every key so far) is rebuilt in its backward (the checkpointed join of
    the carried keys, ``memory/model_segments.py``, or MLA's ``attend.vjp``), one more forward of the cores:
    ``4 Hq D`` per causal key pair (MLA: ``4 Hh max(Dq, Dv)``, the keys expanded from the latent and the values
    padded to their width). Dense MLA also expands the latent of every key so far to its keys and values in each
    segment (``2 R Hh (Dn + D)`` per key row, ``D = max(Dq, Dv)``: the values are made zero-padded): in the
    forward pass, the rerun's forward, the backward's forward and its backward (twice a forward), ``5 sum(e_j)``
    rows for segments ending at ``e_j`` (``segment_tokens`` apart), where one pass expands ``S`` rows and
    backpropagates them (``3 S``)."""
    keys = causal_keys(S, S)
    ends = segment_ends(S, segment_tokens)
    out = 0.0
    for kind in spec.layer_types:
        if kind == "attention":
            D = spec.head_dim or spec.hidden_size // spec.num_attention_heads
            out += 4 * spec.num_attention_heads * D * keys
        elif kind == "mla":
            Hh, D = spec.num_attention_heads, max(spec.qk_head_dim, spec.v_head_dim)
            out += 4 * Hh * D * keys
            out += max(0, 5 * ends - 3 * S) * 2 * spec.kv_lora_rank * Hh * (spec.qk_nope_head_dim + D)
    return out


@dataclass
class StepFlops:
    """Training FLOPs of one sequence of S tokens (all GPUs together), by part."""

    seq_len: int
    layers: float  # mixers + hc, fwd + bwd
    mlp: float  # dense MLP + MoE, fwd + bwd
    indexer: float  # forward only
    loss: float  # lm_head, fwd + bwd
    layers_forward: float  # one forward of all layers (what full recompute adds)
    cores: float = 0.0  # the weight-free part of ``layers`` (``mixer_core_flops``), fwd + bwd

    @property
    def total(self) -> float:
        return self.layers + self.mlp + self.indexer + self.loss

    @property
    def per_token(self) -> float:
        return self.total / self.seq_len

    @property
    def frozen_share(self) -> float:
        """The share of ``total`` a frozen base does not compute: the weight gradients, a third of every
        weight's matmuls (the attention cores and the no-grad indexer have none)."""
        return (self.total - self.indexer - self.cores) / 3 / self.total if self.total else 0.0


def step_flops(spec: ModelSpec, seq_len: int) -> StepFlops:
    """Model FLOPs of one training sequence (forward + backward = 3x forward; indexer 1x)."""
    parts = [layer_flops(spec, seq_len, i) for i in range(spec.num_layers)]
    mixer = sum(p.mixer + p.hc for p in parts)
    mlp = sum(p.mlp for p in parts)
    idx = sum(p.indexer for p in parts)
    loss = 2 * seq_len * spec.hidden_size * spec.vocab_size
    return StepFlops(
        seq_len=seq_len,
        layers=3 * mixer,
        mlp=3 * mlp,
        indexer=idx,
        loss=3 * loss,
        layers_forward=mixer + mlp + idx,
        cores=3 * sum(p.core for p in parts),
    )


def mfu(tokens_per_s: float, flops_per_token: float, num_gpus: int, peak: float = H200_BF16_DENSE) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the GPUs' peak."""
    return tokens_per_s * flops_per_token / (num_gpus * peak)


def step_seconds(spec: ModelSpec, seq_len: int, batch: int, mesh: Mesh) -> float:
    """Rough step time of one GPU for the fix costs: its share of the FLOPs at an assumed rate."""
    flops = step_flops(spec, seq_len).total * batch / mesh.cp
    return flops / (ACHIEVED_FRACTION * H200_BF16_MEASURED)


# ---- communication volume ---------------------------------------------------------------------------
def comm_volume(spec: ModelSpec, seq_len: int, mesh: Mesh, batch: int = 1,
                prec: Precision | None = None) -> dict[str, dict]:
    """Bytes each GPU sends per layer and step (forward + backward) for context parallelism, per layer
    kind and mode, and the cheaper mode. An all-to-all over P ranks sends ``(P - 1) / P`` of its input;
    an all-gather sends its shard to ``P - 1`` ranks; its backward reduce-scatter moves the same amount.
    ``c`` / ``f`` are ``prec.compute`` / ``prec.f32`` (default the trainer's bf16 autocast: 2 / 4; a
    float32 run is 4 / 4). ``tests/parallel/test_parallel_comm_volume.py`` checks every term against the bytes
    the collectives of a real multi-process step send (``parallel.ulysses.COMM_BYTES``).

    KDA (Ulysses): q, k, v ``3 * D * c``, the per-channel log-decay g ``D * f``, beta ``heads * c`` in;
    o ``D * c`` out; the backward moves the same gradients back.
    MLA/DSA Ulysses: q, k ``Hh * qk``, v ``Hh * v`` in, o ``Hh * v`` out, ``c``. MLA/DSA gather-KV: the
    latent ``(kv_lora + rope)`` of every other rank's tokens, ``f`` under autocast (its RMSNorm output
    is fp32), gathered in forward and its gradient reduce-scattered in backward, plus, in layers with
    their own indexer (``indexer_types`` 'full'; 'shared' ones reuse a selection), the indexer keys and
    pooling gates ``2 * Di * f`` (the LayerNorm output is fp32; forward only: no grad); queries stay
    local. The per-layer ``gather_kv`` figure is a full-indexer layer's; ``gather_kv_per_step`` counts
    each layer (what the runtime moves: it always runs gather-KV), ``per_step`` the cheaper mode's.
    GLM-5.3-Flash is NoPE (rope 0): ``512`` latent + ``2 * 128`` indexer values per token
    (DeepSeek-V3.2's ``576 + 128`` counts its 64 RoPE dims and the keys alone).
    Softmax attention (Ulysses): q and k ``f`` with qk_norm (the RMSNorm's fp32 weight promotes them,
    and RoPE keeps the dtype), else ``c``; v (k and v: repeated KV heads ``Hkv'``) and o ``c``.
    """
    c, f = (2, 4) if prec is None else (prec.compute, prec.f32)
    P = mesh.cp
    n = batch * seq_len // P
    a2a = (P - 1) / P
    out: dict[str, dict] = {}
    kinds = sorted(set(spec.layer_types))
    for kind in kinds:
        if kind == "kda":
            D, Hh = spec.linear_num_heads * spec.linear_head_dim, spec.linear_num_heads
            fwd = n * a2a * (3 * D * c + D * f + Hh * c + D * c)
            out[kind] = {"ulysses": 2 * fwd, "mode": "ulysses"}
        elif kind == "gdn":
            Hk, Dk = spec.linear_num_heads, spec.linear_head_dim
            Hv, Dv = spec.linear_num_value_heads or Hk, spec.linear_value_head_dim or Dk
            # q, k, v, the gate's decay g (fp32) and beta per value head in; o out
            fwd = n * a2a * (2 * Hk * Dk * c + Hv * Dv * c + Hv * (f + c) + Hv * Dv * c)
            out[kind] = {"ulysses": 2 * fwd, "mode": "ulysses"}
        elif kind == "mla":
            Hh, Dr = spec.num_attention_heads, spec.qk_rope_head_dim
            # dense MLA (Ulysses only): q after the fp32 RoPE concatenation (bf16 unrotated: Kimi's NoPE), k after
            # the concatenation with the fp32 latent's rope part (bf16 without one), v and o in c
            q = f if spec.mla_rotate and Dr else c
            k = f if Dr else c
            fwd = n * a2a * (Hh * spec.qk_head_dim * (q + k) + 2 * Hh * spec.v_head_dim * c)
            out[kind] = {"ulysses": 2 * fwd, "mode": "ulysses"}
        elif kind == "attention":
            Hq, Hkv = spec.num_attention_heads, spec.num_key_value_heads
            D = spec.head_dim or spec.hidden_size // Hq
            kv = max(Hkv, P) if P > 1 else Hkv  # KV heads repeated until cp splits them
            qk = f if (spec.qk_norm and not spec.norm_zero_centered) else c  # a zero-centered norm casts back
            fwd = n * a2a * (Hq * D * (qk + c) + kv * D * (qk + c))  # q and o; k and v
            out[kind] = {"ulysses": 2 * fwd, "mode": "ulysses"}
        else:
            Hh = spec.num_attention_heads
            uly = n * a2a * c * (2 * Hh * spec.qk_head_dim + 2 * Hh * spec.v_head_dim)
            latent = n * (P - 1) * 2 * (spec.kv_lora_rank + spec.qk_rope_head_dim) * f
            index = n * (P - 1) * 2 * spec.index_head_dim * f  # indexer keys + gates: no backward
            full = sum(1 for i, t in enumerate(spec.layer_types) if t == kind and _own_indexer(spec, i))
            gather = latent + index
            out[kind] = {
                "ulysses": 2 * uly,
                "gather_kv": gather,
                "mode": "gather_kv" if gather <= 2 * uly else "ulysses",
                "gather_kv_per_step": latent * spec.layer_types.count(kind) + index * full,
            }
    for kind, v in out.items():
        v["layers"] = spec.layer_types.count(kind)
        v["per_step"] = v["gather_kv_per_step"] if v["mode"] == "gather_kv" else v[v["mode"]] * v["layers"]
    return out


def _own_indexer(spec: ModelSpec, i: int) -> bool:
    """Layer i scores with its own indexer (a 'shared' one reuses the previous selection: no gather)."""
    types = spec.indexer_types
    return not types or types[i] != "shared"


def ring_dtp_volume(spec: ModelSpec, seq_len: int, mesh: Mesh, batch: int = 1,
                    prec: Precision | None = None) -> int:
    """Bytes each GPU sends per step in the weight-rotating Ring-DTP loss over the cp group
    (``parallel.ring_dtp.ring_dtp_bytes``, the same count): forward ``P - 1`` hops of a padded shard
    of ``ceil(V / P)`` rows of ``lm_head.weight`` in the *parameter* dtype (fp32 master weights under
    autocast: 4 B), backward ``P - 1`` shard hops plus ``P`` hops of the shard's gradient accumulator
    (``promote(param, fp32)``). Independent of the sequence length. 0 without context parallelism."""
    del seq_len, batch  # the weight variant moves rows of the head, not tokens
    P = mesh.cp
    if P == 1:
        return 0
    w = 4 if prec is None else prec.param
    acc = max(w, 4)
    rows = -(-spec.vocab_size // P)
    return (P - 1) * rows * spec.hidden_size * w * 2 + P * rows * spec.hidden_size * acc


# ---- FSDP traffic ---------------------------------------------------------------------------------------
# Assumed all-gather / reduce-scatter bandwidth per GPU (the bytes one rank sends per second); not measured
# in this repository: NVLink within an H200 host (NCCL reaches roughly this bus bandwidth), one 400 Gb/s NIC
# per GPU across hosts.
FSDP_BYTES_PER_S_HOST = 300e9
FSDP_BYTES_PER_S_NET = 40e9


def fsdp_passes(num_segments: int) -> tuple[int, int]:
    """(all-gathers of every layer, reduce-scatters of its gradients) per step and micro-batch
    (``parallel.fsdp``: a layer is freed after its forward): 2 and 1 for one pass over the sequence; under
    sequence segments each segment's no-grad forward, its rerun's forward and its backward gather again,
    and each segment's backward reduce-scatters: ``3 n`` and ``n``."""
    if num_segments <= 1:
        return 2, 1
    return 3 * num_segments, num_segments


def fsdp_traffic(gathered_params: int, param_bytes: int, reduce_bytes: int, mesh: Mesh, num_segments: int = 1,
                 micro_batches: int = 1) -> dict[str, float]:
    """Bytes one rank sends per step for FSDP (ring collectives: ``(N - 1) / N`` of the gathered tensor per
    all-gather and per reduce-scatter; with ``parallel.fsdp dp`` and cp > 1 the reduced shard is all-reduced
    over cp, ``2 (cp - 1) / cp`` of it) and the seconds they take at ``FSDP_BYTES_PER_S_*`` (upper bound:
    nothing overlapped with compute); ``per_segment`` is what one more sequence segment adds. ``reduce_bytes``
    0: nothing is reduce-scattered (a frozen base: what trains is whole, its gradient all-reduced)."""
    N = mesh.shard
    if N <= 1:
        return {}
    gathers, scatters = fsdp_passes(num_segments)
    gathers, scatters = gathers * micro_batches, scatters * micro_batches if reduce_bytes else 0  # 0: a frozen base
    share = (N - 1) / N
    ag = gathered_params * param_bytes * share
    rs = gathered_params * reduce_bytes * share
    if mesh.fsdp == "dp" and mesh.cp > 1:  # HSDP: the shards' all-reduce over the cp replicas
        rs += gathered_params * reduce_bytes / N * 2 * (mesh.cp - 1) / mesh.cp
    rate = FSDP_BYTES_PER_S_HOST if mesh.hosts == 1 else FSDP_BYTES_PER_S_NET
    total = gathers * ag + scatters * rs
    return {"ranks": N, "all_gathers": gathers, "reduce_scatters": scatters, "all_gather_bytes": gathers * ag,
            "reduce_scatter_bytes": scatters * rs, "bytes": total, "seconds": total / rate,
            "per_segment_bytes": 3 * ag + rs if num_segments > 1 else 0.0,
            "per_segment_seconds": (3 * ag + rs) / rate if num_segments > 1 else 0.0, "bytes_per_s": rate}


def expert_grad_traffic(expert_params: int, reduce_bytes: int, mesh: Mesh) -> dict[str, float]:
    """Bytes one rank sends per step to sum its routed experts' gradients over the dp x cp ranks holding the
    same experts (expert parallelism: ``parallel.env.DistributedEnv.reduce_gradients``, a ring all-reduce,
    ``2 (n - 1) / n`` of them), and the seconds at ``FSDP_BYTES_PER_S_*``; nothing when one rank holds them."""
    n = mesh.dp * mesh.cp
    if mesh.ep == 1 or n == 1 or not expert_params:
        return {}
    total = expert_params * reduce_bytes * 2 * (n - 1) / n
    rate = FSDP_BYTES_PER_S_HOST if mesh.hosts == 1 else FSDP_BYTES_PER_S_NET
    return {"ranks": n, "bytes": total, "seconds": total / rate, "bytes_per_s": rate}

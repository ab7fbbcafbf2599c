"""One layer's working set under a ``Run``: what its token mixer and its MLP (dense, MoE, tiled) save for
backward, their temporaries, the mHC merge and the largest weight gradient, from the per-kind terms of
``layers``, ``linear_mixers``, ``sparse_attention`` and ``mlp``.

Pure Python. ``layer_terms(run, i)`` is layer ``i``'s ``LayerTerms``; ``phases.evaluate`` sweeps them.
"""

from __future__ import annotations

from megaseq.models.spec import ModelSpec
from megaseq.plan import components as C
from megaseq.plan import expert, layers
from megaseq.plan import linear_mixers as LM
from megaseq.plan import mlp as MLP
from megaseq.plan import sparse_attention as SA
from megaseq.plan.run import LayerTerms, Run


# ---- per layer --------------------------------------------------------------------------------------
def _trains(run: Run, i: int) -> frozenset[str] | None:
    """Layer i's projections whose weight gets a gradient (``plan.layers``' ``trains``; None: all)."""
    tr = run.counts.trained
    return None if tr is None else tr.projections[i]


def _mixer(run: Run, i: int, xb: int) -> tuple[dict[str, int], int, int]:
    spec, n, prec, mesh = run.spec, run.n, run.prec, run.mesh
    trains = _trains(run, i)
    kind = spec.layer_types[i]
    comm = C.comm_buffer_bytes(spec, n, kind, prec, mesh, run.mla_mode)
    T = run.memory.kda_segment_tokens
    fast_norm, fast_gate = "gated_rms_norm" in run.fast_ops, "kda_gate" in run.fast_ops
    if kind == "kda" and 0 < T < n:
        return LM.kda_segmented(spec, n, run.batch, T, xb, prec, run.cal, trains, fast_norm, fast_gate)
    if kind == "kda":
        return (
            LM.kda_saved(spec, n, xb, prec, run.cal, trains, fast_norm, fast_gate),
            LM.kda_temp(spec, n, prec, False, run.cal) + comm,
            LM.kda_temp(spec, n, prec, True, run.cal) + comm,
        )
    keys = run.batch * run.seq_len if run.segment else 0  # sequence segments: the last segment's keys
    if kind == "attention":
        window, S = (spec.sliding_window if i in spec.sliding_layers else 0), run.seq_len
        return (
            layers.attention_saved(spec, n, xb, prec, mesh, trains, window, S),
            layers.attention_temp(spec, n, prec, False, mesh, window, S) + comm + layers.attention_segment_temp(
                spec, keys, prec, mesh, False),
            layers.attention_temp(spec, n, prec, True, mesh, window, S) + comm + layers.attention_segment_temp(
                spec, keys, prec, mesh, True),
        )
    if kind == "mla":
        saved = layers.mla_saved(spec, n, xb, prec, trains, fast_norm="rms_norm" in run.fast_ops)
        if run.segment:  # the segment attention keeps its queries (keys rebuilt from the carried latent)
            del saved["mla q,k,v,o (SDPA, v padded) + lse"]
            saved["mla q (segment attention)"] = layers.mla_segment_saved(spec, n, prec)
        return (
            saved,
            layers.mla_temp(spec, n, prec, False) + comm + layers.mla_segment_temp(spec, keys, prec, mesh, False),
            layers.mla_temp(spec, n, prec, True) + comm + layers.mla_segment_temp(spec, keys, prec, mesh, True),
        )
    if kind == "gdn":
        return (
            LM.gdn_saved(spec, n, xb, prec, run.cal, trains),
            LM.gdn_temp(spec, n, prec, False, run.cal) + comm,
            LM.gdn_temp(spec, n, prec, True, run.cal) + comm,
        )
    if kind != "dsa":
        raise ValueError(
            f"the memory planner has no terms for layer kind {kind!r} (layer {i} of {spec.family}): it plans "
            "attention, mla, gdn, kda and dsa layers")
    full = spec.indexer_types[i] == "full"
    B, S, mode = run.batch, run.seq_len, run.mla_mode
    impl = "triton" if "sparse_attention" in run.fast_ops else run.sparse_impl
    saved = SA.dsa_saved(spec, n, B, S, xb, prec, mesh, mode, full, run.cal, impl, trains,
                         fast_norm="rms_norm" in run.fast_ops)
    fwd = SA.dsa_temp(spec, n, B, S, prec, mesh, mode, False, run.cal, impl)
    if full:
        fwd = max(fwd, layers.indexer_temp(spec, n, B, S, run.memory.indexer_query_chunk, prec,
                                           fast="indexer_topk" in run.fast_ops))
    bwd = SA.dsa_temp(spec, n, B, S, prec, mesh, mode, True, run.cal, impl)
    if full and run.indexer_objective:  # the sparse stage's KL in the backward, right after the attention's
        probs = layers.head_probs_bytes(spec, n, impl)  # the target the attention's backward leaves
        kept, work = layers.indexer_objective_bytes(spec, n, B, S, prec,
                                                    fused_target=bool(probs) or "indexer_target" in run.fast_ops,
                                                    given_lse=True, lse_copy=impl != "triton",
                                                    fused_kl="indexer_kl" in run.fast_ops)
        saved = {**saved, "dsa indexer objective (pooled keys' graph)": kept}
        # beside it the attention's gradients: dq [n, Hh, Dq] and the latent's [K/V rows, R] (work dtype)
        R = spec.kv_lora_rank + spec.qk_rope_head_dim
        grads = prec.compute * (n * spec.num_attention_heads * spec.qk_head_dim
                                + SA.dsa_kv_rows(n, B, S, mesh, mode) * R)
        bwd = max(bwd, grads + work) + probs
    return saved, fwd + comm, bwd + comm


def _mlp(run: Run, i: int, xb: int, tokens: int) -> tuple[dict[str, int], int, int]:
    """(saved, forward temp, backward temp) of layer i's MLP over ``tokens`` tokens."""
    spec, prec, mesh = run.spec, run.prec, run.mesh
    kind = spec.mlp_types[i]
    if kind == "moe" and mesh.ep > 1:
        return _moe_ep(run, xb, tokens)
    fast = "swiglu" in run.fast_ops
    if kind == "dense":
        saved = {"mlp (dense SwiGLU)": MLP.mlp_saved(spec, tokens, spec.intermediate_size, xb, prec,
                                                        _trains(run, i), fast=fast)}
    else:
        saved = MLP.moe_saved(spec, tokens, xb, prec, mesh, run.imbalance, _trains(run, i), fast=fast)
    fwd = MLP.mlp_temp(spec, tokens, kind, xb, prec, mesh, run.imbalance, False, run.cal)
    bwd = MLP.mlp_temp(spec, tokens, kind, xb, prec, mesh, run.imbalance, True, run.cal)
    return saved, fwd, bwd


def _moe_ep(run: Run, xb: int, tokens: int) -> tuple[dict[str, int], int, int]:
    """An MoE layer under expert parallelism: the router and the shared expert here, the routed path as the
    dispatch mode runs it (``plan.expert.dispatch_terms``: PipelinedLLEP at its bound)."""
    spec, prec = run.spec, run.prec
    t = expert.dispatch_terms(spec, tokens, run.mesh, run.ep_dispatch, xb, prec, run.imbalance, run.cal)
    saved = {"moe router": MLP.moe_router_saved(spec, tokens, prec), **t.saved}
    if spec.num_shared_experts:
        saved["moe shared expert"] = MLP.shared_expert_saved(spec, tokens, xb, prec,
                                                                fast="swiglu" in run.fast_ops)
    return saved, t.fwd_temp, t.bwd_temp


def _largest_weight(spec: ModelSpec, i: int) -> int:
    """Elements of the layer's largest non-expert weight (its gradient's temporary in backward; the
    experts' per-expert gradients accumulate without a full-size temporary, as measured on an H200)."""
    H = spec.hidden_size
    if spec.mlp_types[i] == "moe":
        mlp = max(H * spec.moe_intermediate_size * max(spec.num_shared_experts, 1), spec.num_experts * H)
    else:
        mlp = H * spec.intermediate_size
    kind = spec.layer_types[i]
    if kind == "kda":
        mix = H * spec.linear_num_heads * spec.linear_head_dim
    elif kind in ("dsa", "mla"):
        Hh = spec.num_attention_heads
        mix = max(
            (spec.q_lora_rank or H) * Hh * spec.qk_head_dim,  # q_b_proj, or q_proj without a q LoRA rank
            Hh * spec.v_head_dim * H,
            spec.kv_lora_rank * Hh * (spec.qk_nope_head_dim + spec.v_head_dim),
        )
    elif kind == "gdn":
        Hk, Dk, Hv, Dv = LM.gdn_dims(spec)
        mix = H * (2 * Hk * Dk + 2 * Hv * Dv)  # in_proj_qkvz
    else:
        gate = 2 if spec.attn_output_gate else 1  # Qwen3-Next's q_proj carries the output gate
        mix = gate * H * spec.num_attention_heads * (spec.head_dim or H // spec.num_attention_heads)
    return max(mlp, mix)


def layer_terms(run: Run, i: int) -> LayerTerms:
    spec, n, prec = run.spec, run.n, run.prec
    N, H, s, c, f = spec.hc_mult, spec.hidden_size, prec.stream, prec.compute, prec.f32
    norm, xb = C.norm_saved(H, s, prec, fast="rms_norm" in run.fast_ops)
    mixer, mixer_fwd, mixer_bwd = _mixer(run, i, xb)
    # with a plain residual (N = 1) an fp32 stream is the norms' own fp32 input: count it once
    resid = N * H * s if (N > 1 or s == f) else 0
    attn = {"layer input (boundary)": n * resid}
    ffn = {"mid-layer residual": n * resid}
    if N > 1:
        trains = _trains(run, i)
        attn["mHC"], ffn["mHC"] = (n * C.hc_saved(spec, prec, run.cal, trains is None or f"{hc}.fn" in trains,
                                                  fast="hc_mix" in run.fast_ops,
                                                  fast_weights="hc_weights" in run.fast_ops)
                                   for hc in ("attn_hc", "ffn_hc"))
    attn["input norm"] = ffn["post-attention norm"] = n * norm - (n * resid if N == 1 else 0)
    attn.update(mixer)
    tr = run.counts.trained
    if tr is not None and (tr.lora_rows_attn[i] or tr.merged[i]):  # models.common.lora: B's saved input
        attn["LoRA intermediates"] = n * tr.lora_rows_attn[i] * c + tr.merged[i] * c
    tiled = run.memory.tiled_mlp
    tile = min(run.memory.mlp_tile_tokens, n) if tiled else n
    mlp, mlp_fwd, mlp_bwd = _mlp(run, i, xb, tile)
    if tr is not None and tr.lora_rows_mlp[i]:
        mlp["LoRA intermediates (mlp)"] = tile * tr.lora_rows_mlp[i] * c
    # backward: the gradient of the sublayer's input (in its dtype, xb: the norm's output; a tiled MLP's
    # replay fills one such buffer) and of its output where that is a tensor of its own: a cast of the
    # stream's gradient (a bf16 output added to an fp32 stream) or mHC's merge backward (N > 1); with a
    # plain residual in the output's dtype it is the stream's gradient itself, counted in ``agrad`` (counting an fp32
    # input gradient and the output's again would count that gradient twice).
    y_mlp = c if spec.mlp_types[i] == "dense" else xb
    grad_attn = n * H * (xb + (c if (c != s or N > 1) else 0))
    grad_mlp = n * H * (xb + (y_mlp if (y_mlp != s or N > 1) else 0))
    if tiled:  # the tiles run without a graph: their weights' bf16 copies live only inside backward
        tile_saved = sum(mlp.values())
        mlp_params = sum(C.mlp_params(spec, spec.mlp_types[i])) if tr is None else tr.mlp[i]
        mlp_fwd = int(run.cal.nograd_fraction * tile_saved) + mlp_fwd
        mlp_bwd = tile_saved + mlp_bwd + 2 * C.grad_bytes(mlp_params, C.state_mesh(run.counts, run.mesh), prec)
        mlp_bwd += C.weight_copy_bytes(mlp_params, prec, run.mesh)
        mlp = {"mlp (tiled: input only)": n * xb * H}
    if N > 1:
        fast_merge = "hc_merge" in run.fast_ops
        attn["mHC merge"] = n * C.merge_saved(spec, c, prec, fast_merge)
        y_mlp = c if spec.mlp_types[i] == "dense" else xb
        ffn["mHC merge (mlp)"] = n * C.merge_saved(spec, y_mlp, prec, fast_merge)
    if tiled and N > 1:
        # Glm5DecoderLayer.token_tile: the mHC maps, norms, merges and the MLP run tile by tile with
        # recompute; the layer keeps its input (the boundary), the first half's mHC weights post/comb,
        # the mixer's own saved set and the mixer output y (the second tiled half's input). The tiles'
        # full per-token sets become one tile's temporaries in backward.
        per_token = sum(v for k, v in {**attn, **ffn}.items()
                        if k not in mixer and k != "layer input (boundary)") // max(n, 1) - xb * H
        tile_part = tile * per_token
        mlp_fwd += int(run.cal.nograd_fraction * tile_part)
        mlp_bwd += tile_part
        attn = {"layer input (boundary)": n * resid, "mHC maps (post, comb)": n * f * (N + N * N), **mixer}
        ffn = {"mixer output (tiled input)": n * H * c}
    else:
        ffn.update(mlp)
    wgrad = prec.grad * (_largest_weight(spec, i) if tr is None else tr.largest[i])
    merge = (tile if tiled else n) * C.merge_temp(spec, prec) if N > 1 else 0
    return LayerTerms(
        attn=attn,
        ffn=ffn,
        mixer_fwd=mixer_fwd,
        mixer_bwd=mixer_bwd + grad_attn,
        mlp_fwd=mlp_fwd,
        mlp_bwd=mlp_bwd + grad_mlp,
        merge_fwd=merge,
        wgrad=wgrad,
        boundary_term=attn["layer input (boundary)"],
        tiled=tiled,
        kept_attention=0 if run.segment else layers.kept_attention_bytes(spec, spec.layer_types[i], n, prec),
        kept_attention_host=0 if run.segment else layers.kept_attention_host_bytes(spec, spec.layer_types[i], n,
                                                                                   prec, run.mesh),
    )


def all_layer_terms(run: Run) -> list[LayerTerms]:
    """Per layer, computing each distinct (mixer, MLP, indexer) combination once."""
    cache: dict[tuple, LayerTerms] = {}
    out = []
    spec = run.spec
    for i in range(spec.num_layers):
        key = (spec.layer_types[i], spec.mlp_types[i], spec.indexer_types[i] if spec.indexer_types else "",
               i in spec.sliding_layers)
        tr = run.counts.trained
        if tr is not None:  # adapters may differ per layer (lora.targets naming layers)
            key += (tr.lora_rows_attn[i], tr.lora_rows_mlp[i], tr.merged[i], tr.mlp[i], tr.largest[i],
                    tr.projections[i])
        if key not in cache:
            cache[key] = layer_terms(run, i)
        out.append(cache[key])
    return out

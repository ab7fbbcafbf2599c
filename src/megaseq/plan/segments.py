"""Sequence segments (``memory.model_segment_tokens``; ``memory/model_segments.py``): the stores that
hold every earlier segment's keys and states across a step, on the GPU (K/V caches and their fp32
gradients, MLA latents, GDN and KDA states) or, with ``segment_kv_host``, on the host.

Pure Python. ``phases`` adds these to a step's state.
"""

from __future__ import annotations

from megaseq.plan import layers
from megaseq.plan import linear_mixers as LM
from megaseq.plan import sparse_attention as SA
from megaseq.plan.run import Run


def segment_store_bytes(run: Run) -> dict[str, int]:
    """What sequence segments keep over the whole sequence (``memory/model_segments.py``): per DSA layer
    the latent ``c * R`` and the indexer's keys + gates ``f * 2 Di`` per token (fp32: LayerNorm under
    autocast) and the latent's fp32 gradient accumulator; during a DSA layer's backward one more fp32
    ``[s, R]`` (the earlier latents' gradient) and the latents gathered for its graph ``c * R`` (in
    ``dsa_saved``); per KDA layer the fp32 state ``[Hh, D, D]`` and the ``K - 1`` halo inputs at every
    segment start (this rank's cp share of the heads: the halo is carried after the q/k/v projections,
    ``3 * Hh / cp * D`` wide); with ``segment_keep_selection`` every full-indexer DSA layer's selection ``4 W``
    per token (all kept when the backward begins); with the indexer objective the fp32 gradient of every full
    indexer's keys + gates ``f * 2 Di`` per token."""
    spec, prec, B, S, T = run.spec, run.prec, run.batch, run.seq_len, run.segment
    c, f = prec.compute, prec.f32
    R = spec.kv_lora_rank + spec.qk_rope_head_dim
    dsa = spec.layer_types.count("dsa")
    kda = spec.layer_types.count("kda")
    segs = -(-S // T)
    # per rank: its cp share of the KDA heads' state [Hh/cp, D, D] (fp32) and halo [K - 1, 3 * Hh/cp * D]
    Hl, D = spec.linear_num_heads // run.mesh.cp, spec.linear_head_dim
    state = Hl * D * D * f + (spec.linear_conv_kernel - 1) * 3 * Hl * D * c
    full = sum(1 for i, k in enumerate(spec.layer_types) if k == "dsa" and spec.indexer_types[i] == "full")
    kept = full * SA.dsa_selection_bytes(spec, B * S) if run.memory.segment_keep_selection else 0
    out = {
        "segment DSA selections (kept)": kept,
        "segment caches (DSA latents, indexer keys)": dsa * B * S * (R * c + 2 * spec.index_head_dim * f),
        "segment latent gradients (fp32)": (dsa + (1 if dsa else 0)) * B * S * R * f,
        "segment KDA states": kda * segs * B * state,
        # model.train_indexer: the indexer keys' gradient from later segments, fp32 [B, S, 2 Di] per full indexer
        "segment indexer key gradients (fp32)": (full * B * S * 2 * spec.index_head_dim * f
                                                 if run.indexer_objective else 0),
    }
    out.update(_segment_mixer_store(run, segs))
    return out


def _segment_mixer_store(run: Run, segs: int) -> dict[str, int]:
    """Sequence segments' store of softmax attention, dense MLA and gated DeltaNet layers (the rest of
    ``segment_store_bytes``): per attention layer the K and V caches of every token, this rank's KV heads
    (``kv / cp``, after ``seq_to_heads``), and their fp32 gradient accumulators, ``2 (c + f) kv D`` per token;
    per MLA layer the latent ``[c | k_rot]`` (gathered: all tokens on every rank) and its fp32 accumulator,
    ``(c + f) (R + Dr)``; per GDN layer the fp32 state ``[Hv / cp, Dk, Dv]`` and the ``K - 1`` conv inputs
    ``C / cp`` wide at every segment start but the first."""
    spec, prec, B, S, cp = run.spec, run.prec, run.batch, run.seq_len, run.mesh.cp
    c, f = prec.compute, prec.f32
    kinds = spec.layer_types
    Hk, Dk, Hv, Dv = LM.gdn_dims(spec)
    gdn_state = Hv // cp * Dk * Dv * f + (spec.linear_conv_kernel - 1) * (2 * Hk * Dk + Hv * Dv) // cp * c
    out = {}
    rows = segment_kv_rows(run)
    if run.memory.segment_kv_host and rows:  # the store in host memory (segment_kv_host_bytes), two layers here
        out["segment K/V in flight (host-kept store)"] = B * S * max(rows) * in_flight_per_element(run)
    elif "attention" in kinds:  # (only softmax attention's heads constrain cp: ask only then)
        D = spec.head_dim or spec.hidden_size // spec.num_attention_heads
        kv = max(1, layers.kv_heads(spec, run.mesh) // cp)
        out["segment K/V caches + fp32 gradients"] = kinds.count("attention") * B * S * 2 * (c + f) * kv * D
    if "mla" in kinds and not run.memory.segment_kv_host:
        out["segment MLA latents + fp32 gradients"] = (kinds.count("mla") * B * S * (c + f)
                                                       * (spec.kv_lora_rank + spec.qk_rope_head_dim))
    if "gdn" in kinds:
        out["segment GDN states"] = kinds.count("gdn") * max(segs - 1, 0) * B * gdn_state  # none into the first
    return out


def in_flight_per_element(run: Run) -> int:
    """Bytes the host-kept store has on the device per element of a layer's rows (``segment_kv_rows``): the rows
    and fp32 accumulators of the layer in its backward and of the next one fetched ahead, ``2 (c + f)``, and for
    softmax attention the rows' gradient its backward makes, ``c`` (dense MLA forms its latent's gradient inside
    its attention's backward: ``layers.mla_segment_temp``)."""
    c, f = run.prec.compute, run.prec.f32
    return 2 * (c + f) + (c if "attention" in run.spec.layer_types else 0)


def segment_kv_rows(run: Run) -> list[int]:
    """Elements per token of each softmax-attention layer's K and V (this rank's KV heads) and each dense MLA
    layer's latent ``[c | k_rot]``: the rows sequence segments keep for every token (``attend_seq``)."""
    spec, out = run.spec, []
    for kind in spec.layer_types:
        if kind == "attention":
            D = spec.head_dim or spec.hidden_size // spec.num_attention_heads
            out.append(2 * max(1, layers.kv_heads(spec, run.mesh) // run.mesh.cp) * D)
        elif kind == "mla":
            out.append(spec.kv_lora_rank + spec.qk_rope_head_dim)
    return out


def segment_kv_host_bytes(run: Run) -> int:
    """``memory.segment_kv_host``: the host memory of the K/V (or latent) rows of every token and layer with their
    fp32 gradient accumulators, ``(c + f) * rows`` per token and layer (``memory/segment_host.py``); 0 when off.
    The device holds about two layers' worth instead (``_segment_mixer_store``, ``in_flight_per_element``): the
    rows and the accumulator of the layer in its backward and of the next layer, fetched ahead."""
    if not (run.segment and run.memory.segment_kv_host):
        return 0
    return run.batch * run.seq_len * sum(segment_kv_rows(run)) * (run.prec.compute + run.prec.f32)

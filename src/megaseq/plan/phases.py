"""One evaluation of a memory setting: each layer's saved set and temporaries (``layer_terms``), swept over
a step's phases with the step's state (parameters, optimizer, FSDP buffers, ``segments``' stores).

Pure Python. ``evaluate(Run)`` (``run.Run``) returns the peak GPU bytes (and at which phase), the component breakdown
at that peak, and the host bytes. The phases (``docs/planner.md``, "Peak model"):

    forward  at layer l   state + saved(layers < l) + layer l's own forward (its saved part + temporaries)
    loss                  state + saved(all layers) + final norm + vocabulary projection
    backward at layer l   state + saved(layers <= l) + layer l's backward temporaries + grads(layers >= l)
    step                  parameters + gradients + optimizer state

Under recompute "saved" is the boundaries kept on the GPU (SCO moves the first layers' to the host; at
most two of those are back on the GPU at once) and the kept attention outputs (the first kept layers' in host
memory: at most two layers' worth on the GPU at once), and layer l's graph is rebuilt in its backward. State is
the parameters, the optimizer state (steady state: after the first step), gradients when accumulated
over micro-batches, and FSDP buffers when parameters are sharded.
"""

from __future__ import annotations

import itertools

from megaseq.memory.rules import kept_attention_layers
from megaseq.models.spec import ModelSpec
from megaseq.plan import components as C
from megaseq.plan import sparse_attention as SA
from megaseq.plan import stream
from megaseq.plan.layer_terms import all_layer_terms
from megaseq.plan.run import Evaluation, LayerTerms, Run
from megaseq.plan.segments import segment_kv_host_bytes, segment_store_bytes

KEPT = "kept attention outputs"  # the GPU-kept layers'
KEPT_HOST = "kept attention outputs (host-kept, on the GPU)"  # the host-kept layers' copies in flight or in use
KEPT_PINNED = "kept attention outputs (pinned)"  # the host-kept layers' pool (host memory)
PROCESS_HOST = "process (Python, torch, CUDA host state)"  # the one host term not page-locked


# ---- the sweep ---------------------------------------------------------------------------------------
def _readers(spec: ModelSpec) -> list[bool]:
    """Per layer: a full-indexer DSA layer whose selection a later shared layer reads."""
    out = [False] * spec.num_layers
    last = None
    for i, kind in enumerate(spec.layer_types):
        if kind != "dsa":
            continue
        if spec.indexer_types[i] == "full":
            last = i
        elif last is not None:
            out[last] = True
    return out


def _state(run: Run) -> tuple[dict[str, int], list[int], int, int]:
    """(persistent state, per-layer gradients, head gradient, embedding gradient)."""
    counts, mesh, prec, m = run.counts, run.mesh, run.prec, run.memory
    state = {
        "parameters": C.param_bytes(counts, mesh, prec),
        "optimizer state": C.optimizer_gpu_bytes(counts, mesh, prec, m.optimizer_offload, m.optimizer_bucket_params),
    }
    if run.segment:
        state.update(segment_store_bytes(run))
    state.update(stream.gpu_terms(run, state["parameters"]))  # a frozen base streamed from the host
    acc = run.accumulates
    kept = counts.fp32_kept if prec.master else [0] * len(counts.layers)
    tr = counts.trained
    if tr is not None:  # a frozen base: only what trains has a gradient (the kept fp32 tensors taken as frozen),
        kept = [0] * len(counts.layers)  # whole on every rank under FSDP (C.state_mesh)
        mesh = C.state_mesh(counts, mesh)
    whole = [counts.layer_trained(i)[1] if mesh.ep > 1 else 0 for i in range(len(kept))]  # the experts under ep
    g_layers = [C.grad_bytes(sum(counts.layer_trained(i)), mesh, prec, k, acc, w)
                for i, (k, w) in enumerate(zip(kept, whole))]
    tied = run.spec.tie_word_embeddings
    head, embed, norm = (counts.head, counts.embed, counts.final_norm) if tr is None else (tr.head, tr.embed,
                                                                                            tr.final_norm)
    g_head = C.grad_bytes(norm + (embed if tied else head), mesh, prec, 0, acc)
    g_embed = 0 if tied else C.grad_bytes(embed, mesh, prec, 0, acc)
    return state, g_layers, g_head, g_embed


def fsdp_per_layer(run: Run) -> tuple[list[int], int, int]:
    """(parameters FSDP gathers for each layer, for the embedding (0 when tied: it is the root's head), the
    root's head + final norm)."""
    counts, mesh, prec = run.counts, run.mesh, run.prec
    layers = [C.gathered_params(counts, i, mesh, prec) for i in range(len(counts.layers))]
    tied = run.spec.tie_word_embeddings
    tr = counts.trained
    if tr is not None:  # a frozen base: its frozen part only (what trains is whole on every rank)
        return layers, 0 if tied else tr.frozen_embed, tr.frozen_final_norm + (tr.frozen_embed if tied
                                                                                 else tr.frozen_head)
    head = counts.final_norm + (counts.embed if tied else counts.head)
    return layers, 0 if tied else counts.embed, head


def _copies(run: Run, i: int, cached_only: bool) -> int:
    """bf16 weight copies of layer i (autocast). ``cached_only``: the autocast cache of a no-grad forward
    keeps the leaf weights' casts, not the experts' (cast per expert from a view). A tiled MLP runs its
    tiles without a graph, so the layer's graph holds no copies of the MLP's weights."""
    dense, experts, _ = run.counts.layers[i]
    if run.counts.trained is not None:  # a frozen base is stored in the compute dtype: nothing to cast
        dense, experts = run.counts.layer_trained(i)
        return C.weight_copy_bytes(dense + (0 if cached_only else experts), run.prec, run.mesh)
    if cached_only:
        experts = 0
    elif run.memory.tiled_mlp:
        dense -= C.mlp_params(run.spec, run.spec.mlp_types[i])[0]
        experts = 0
    return C.weight_copy_bytes(dense + experts, run.prec, run.mesh)


def _sco_offloaded(run: Run, bnd: int) -> int:
    m = run.memory
    if not (m.recompute and m.checkpoint_offload) or bnd == 0:
        return 0
    return C.sco_plan(run.spec.num_layers, bnd, m.offload_host_budget).num_offloaded


def kept_layers(run: Run) -> tuple[range, range]:
    """(the layers keeping attention's output in host memory, those keeping it on the GPU), under recompute: of
    the last ``keep_attention_layers`` layers the first ``keep_attention_host_layers`` are the host's."""
    m = run.memory
    if not m.recompute:
        return range(0), range(0)
    return kept_attention_layers(run.spec.num_layers, m.keep_attention_layers, m.keep_attention_host_layers)


def _host_kept_on_gpu(terms: list[LayerTerms], host: range, phase: str, i: int) -> int:
    """The host-kept layers' attention outputs on the GPU (``memory.offload.KeptHostStore``): in layer i's forward
    its own and the layer before's (their copies out may still run); at the loss the last layer's; in layer i's
    backward the one prefetched for the next host-kept layer (layer i's own are its rerun's saved output, in
    "recomputed layer"): with layer i's own, at most two layers' worth."""
    if phase == "forward":
        return sum(terms[j].kept_attention for j in (i - 1, i) if j in host)
    if phase == "loss":
        return terms[i].kept_attention if i in host else 0
    before = [j for j in host if j < i]
    return terms[before[-1]].kept_attention if before else 0


def _phases(run: Run, terms: list[LayerTerms]) -> list[tuple[str, dict[str, int], str]]:
    spec, prec, mesh, n = run.spec, run.prec, run.mesh, run.n
    L, H, s = spec.num_layers, spec.hidden_size, prec.stream
    rec = run.memory.recompute
    state, g_layers, g_head, g_embed = _state(run)
    # gradients accumulate over micro-batches, and over sequence segments (a segment's forward runs with
    # the later segments' gradients held)
    acc = run.grad_accum > 1 or bool(run.segment)
    g_all = sum(g_layers) + g_head + g_embed
    gathered, embed_block, head = fsdp_per_layer(run)
    frozen = run.counts.trained is not None  # a frozen base: FSDP gathers it in its storage dtype, no gradient
    blocks = ([embed_block] if embed_block else []) + gathered  # FSDP units in forward order (root apart)
    first = 1 if embed_block else 0

    def fsdp(i: int, backward: bool) -> int:  # layer i running, its neighbour's all-gather prefetched
        j = first + i
        other = blocks[j - 1] if backward and j > 0 else (blocks[j + 1] if not backward and j + 1 < len(blocks)
                                                          else 0)
        return C.fsdp_buffers(blocks[j], other, head, mesh, prec, run.reduce_bytes, backward, frozen)
    bnd = C.boundary_bytes(spec, n, prec)
    final = n * (C.norm_saved(H, s, prec, fast="rms_norm" in run.fast_ops)[0] + s * H)
    # under autocast the trainer casts the hidden states and the head to the compute dtype for the loss
    cast = prec.autocast and run.loss_in_compute_dtype
    d_loss = prec.compute if cast else s
    head_trains = run.counts.head_trained()  # a frozen head: no weight gradient, already in the compute dtype
    loss = C.loss_bytes(
        spec, n, d_loss, run.memory.chunked_loss, run.memory.loss_chunk_tokens, weight_grad=head_trains,
        fast="linear_cross_entropy" in run.fast_ops,
    ) + ((n + (spec.vocab_size if head_trains else 0)) * H * d_loss if cast else 0)
    sel = SA.dsa_selection_bytes(spec, n) if "dsa" in spec.layer_types else 0
    readers = _readers(spec)
    k = _sco_offloaded(run, bnd)
    # kept attention (under recompute): the last layers' attention outputs, held from their forward to their
    # backward, on the GPU ([i]: what layers 0 .. i - 1 keep there) or, the first of them, in host memory
    host_kept, gpu_kept = kept_layers(run)
    kept_upto = list(itertools.accumulate((t.kept_attention if i in gpu_kept else 0 for i, t in enumerate(terms)),
                                          initial=0))
    fwd_state = dict(state, **{"gradients": g_all if acc else 0})
    # each layer's weight copies and DSA selection once, with running sums (the phases read prefixes of them)
    copies_cached = [_copies(run, i, cached_only=True) for i in range(L)]
    copies_full = [_copies(run, i, cached_only=False) for i in range(L)]
    copies_upto = list(itertools.accumulate(copies_full, initial=0))  # [i]: layers 0 .. i - 1
    sel_upto = list(itertools.accumulate((sel if readers[j] else 0 for j in range(L)), initial=0))
    out: list[tuple[str, dict[str, int], str]] = []
    saved_before, copies_before, carry = 0, 0, 0
    for i, t in enumerate(terms):  # forward
        A, F = sum(t.attn.values()), t.saved - sum(t.attn.values())
        kind = f"layer {i} ({spec.layer_types[i]} + {spec.mlp_types[i]})"
        carry += sel if (rec and readers[i]) else 0
        if rec:
            copies_before += copies_cached[i]
            kept = max(0, i + 1 - k) + (1 if i < k else 0)
            work = int(run.cal.nograd_fraction * (t.saved - t.boundary_term))
            work += max(t.mixer_fwd, t.mlp_fwd, t.merge_fwd)
            comps = {"checkpoint boundaries": kept * bnd, "layer working set": work, KEPT: kept_upto[i + 1],
                     KEPT_HOST: _host_kept_on_gpu(terms, host_kept, "forward", i)}
        else:
            copies_before += copies_full[i]
            part, work = max(
                (t.before_mixer_output, t.mixer_fwd), (A + F, t.mlp_fwd), (A + F, t.merge_fwd), key=sum
            )
            comps = {"saved activations": saved_before + part, "layer working set": work}
            saved_before += t.saved
        out.append(
            (
                f"forward, {kind}",
                dict(
                    fwd_state,
                    **comps,
                    **{"weight copies (bf16)": copies_before, "DSA selections (carry)": carry,
                       "FSDP buffers": fsdp(i, False)},
                ),
                kind,
            )
        )
    loss_comps = {
        "vocabulary projection (loss)": loss,
        "final norm + hidden": final,
        "DSA selections (carry)": carry,
    }
    if rec:
        loss_comps["checkpoint boundaries"] = (L - k) * bnd
        loss_comps[KEPT] = kept_upto[L]
        loss_comps[KEPT_HOST] = _host_kept_on_gpu(terms, host_kept, "loss", L - 1)
    else:
        loss_comps.update({"saved activations": saved_before, "weight copies (bf16)": copies_before})
    loss_comps["FSDP buffers"] = C.fsdp_buffers(0, 0, head, mesh, prec, run.reduce_bytes, False, frozen)
    out.append(("loss", dict(fwd_state, **loss_comps), "loss"))
    grads = g_head + (g_embed if acc else 0) + (sum(g_layers) if acc else 0)
    for i in range(L - 1, -1, -1):  # backward
        t = terms[i]
        A, F = sum(t.attn.values()), t.saved - sum(t.attn.values())
        grads += 0 if acc else g_layers[i]
        kind = f"layer {i} ({spec.layer_types[i]} + {spec.mlp_types[i]})"
        common = dict(state, **{"gradients": grads, "FSDP buffers": fsdp(i, True)})
        # layer i's own peak, as (saved part, temporaries, activation gradients) at each moment: its
        # backward (the MLP half first, then the mixer with the MLP half freed); under recompute first its
        # rerun forward, when only the incoming gradient exists, and in its backward the rerun's output,
        # which memory/offload.py keeps alive while autograd.grad runs
        out_alive = bnd if rec else 0
        agrad = 2 * bnd + t.wgrad + out_alive
        branches = [(A + F, t.mlp_bwd, agrad), (A, t.mixer_bwd, agrad)]
        if rec:
            pre = t.before_mixer_output
            branches += [(pre, t.mixer_fwd, bnd), (A + F, t.mlp_fwd, bnd), (A + F, t.merge_fwd, bnd)]
        part, work, agrad = max(branches, key=sum)
        if rec:
            kept = max(0, i + 1 - k) + min(2, min(i + 1, k))
            live = sel_upto[i + 1]
            comps = {
                "checkpoint boundaries": kept * bnd,
                "recomputed layer": part - t.boundary_term,
                "layer working set": work,
                "activation gradients": agrad,
                "weight copies (bf16)": copies_full[i],
                "DSA selections (carry)": live,
                KEPT: kept_upto[i],  # layer i's own are its rerun's saved output, in "recomputed layer"
                KEPT_HOST: _host_kept_on_gpu(terms, host_kept, "backward", i),
            }
        else:
            saved_before -= t.saved
            copies = copies_upto[i + 1]
            comps = {
                "saved activations": saved_before + part,
                "layer working set": work,
                "activation gradients": agrad,
                "weight copies (bf16)": copies,
            }
        out.append((f"backward, {kind}", dict(common, **comps), kind))
    out.append(("optimizer step", dict(state, gradients=g_all), "step"))
    return out


def pinned_host_bytes(host: dict[str, int]) -> int:
    """The page-locked host bytes of one GPU's process (``memory.host_memory``): its host terms but the process's."""
    return sum(v for k, v in host.items() if k != PROCESS_HOST)


def evaluate(run: Run) -> Evaluation:
    """The peak over the phases of one step, its breakdown, and the host memory."""
    terms = all_layer_terms(run)
    phases = _phases(run, terms)
    name, comps, where = max(phases, key=lambda p: sum(p[1].values()))
    tensors = sum(comps.values())
    reserve = C.allocator_reserve(tensors, run.cal)
    breakdown = {k: v for k, v in comps.items() if v} | {
        "allocator reserve": reserve,
        "CUDA context": run.cal.cuda_context_bytes,
    }
    summary: dict[str, int] = {}
    for label, _, _ in (("forward", 0, 0), ("loss", 0, 0), ("backward", 0, 0), ("optimizer step", 0, 0)):
        summary[label] = max(sum(c.values()) for p, c, _ in phases if p.startswith(label))
    saved_terms: dict[str, int] = {}
    for t in terms:
        for k, v in list(t.attn.items()) + list(t.ffn.items()):
            saved_terms[k] = saved_terms.get(k, 0) + v
    bnd = C.boundary_bytes(run.spec, run.n, run.prec)
    k = _sco_offloaded(run, bnd)
    host = {
        PROCESS_HOST: run.cal.process_host_bytes,
        "SCO pinned boundaries": k * C.round_up(bnd),
        KEPT_PINNED: sum(terms[j].kept_attention_host for j in kept_layers(run)[0]),
        "segment K/V + fp32 gradients (memory.segment_kv_host)": segment_kv_host_bytes(run),
        "optimizer state (OffloadStreamAdamW)": C.optimizer_host_bytes(
            run.counts, run.mesh, run.memory.optimizer_offload, run.prec
        ),
        **stream.host_terms(run),
    }
    notes = {"layer working set": where, "recomputed layer": where, "saved activations": name}
    # torch's AdamW makes its moments in the first update; MasterAdamW (bf16 weights) makes its state with
    # the optimizer, so the first step has it too
    eager = bool(run.prec.master) and not run.memory.optimizer_offload
    first = max(sum(v for k, v in c.items() if k != "optimizer state" or p == "optimizer step" or eager)
                for p, c, _ in phases)
    return Evaluation(
        first_step_tensors=first,
        peak_tensors=tensors,
        peak_gpu=tensors + reserve + run.cal.cuda_context_bytes,
        phase=name,
        breakdown=breakdown,
        notes=notes,
        phases=summary,
        host_per_gpu=host,
        peak_host=sum(host.values()) * run.mesh.gpus_on_host,
        saved_terms=saved_terms,
        offloaded_layers=k,
    )

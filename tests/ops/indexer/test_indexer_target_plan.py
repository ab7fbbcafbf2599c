"""Op ``indexer_target``'s working set as the objective's chunks and the memory plan count it, and where the fast
set runs its kernel (no Triton needed: the kernel's own tests are ``test_indexer_target.py``).

Shapes: Hh heads, W selected slots, C latent width, I indexer heads, K selected pools, D indexer head dim.
"""

from __future__ import annotations

import torch

from megaseq.ops import dispatch, kernels, workspace


def test_the_fast_set_runs_the_kernel_and_base_the_reference():
    """``model.kernels fast`` (the default, glm5-flash-1gpu's too) puts the kernel first on a GPU; ``base`` runs the
    reference (the kernel is opt-in), and so does the CPU."""
    from megaseq.config import build_config
    from megaseq.train.build import kernel_settings

    cfg = build_config({"model": {"name": "glm5-flash-1gpu", "train_indexer": True}})
    assert cfg.model.kernels == "fast"
    assert kernel_settings(cfg, torch.device("cuda"))["preferred"]["indexer_target"] == ["triton"]
    assert "indexer_target" not in kernels.preferred_kernels("cuda", "base")
    assert "indexer_target" not in kernels.preferred_kernels("cpu", "fast")
    assert dispatch.implementations("indexer_target")["triton"].opt_in


# ---- the working set: what the chunk of the objective counts --------------------------------------------
def test_row_bytes_of_the_kernel_have_no_gather_and_no_head_scores():
    """glm5-flash-1gpu's DSA layer (Hh 16, W 2063, C 512, bf16 work, fp32 compute; the indexer's 32 heads of 128 on a
    1536-wide query latent): the reference's row holds the gathered latents and two [Hh, W] fp32 tensors, the
    kernel's its [W] output; the objective's chunk grows from about 840 to about 11K queries in the same 2 GiB."""
    Hh, W, C, I, K, D, Qr = 16, 2063, 512, 32, 128, 128, 1536
    ref = workspace.indexer_target_row_bytes(Hh, W, C, 4, 2)
    fused = workspace.indexer_target_row_bytes(Hh, W, C, 4, 2, fused=True)
    assert ref - fused == W * C * 2 + 2 * Hh * W * 4 - (5 * W + 4 * Hh)
    assert fused == Hh * C * 2 + 5 * W + 4 * Hh  # the absorbed queries, m and the validity, lse2
    rows = [workspace.indexer_kl_chunk(Hh, W, I, K, D, gathered=W, latent=C, itemsize=4, gathered_itemsize=2,
                                       fused_target=f, query_width=Qr) for f in (False, True)]
    assert 800 < rows[0] < 900 and 10000 < rows[1] < 12000, rows
    # the indexer's side: its queries (the projection's fp32 input and output, the rotated copy), the head scores
    # and their relu mask and gradient, the gathered pool keys and their int64 indices, six [K] rows
    indexer = (Qr + 2 * I * D) * 4 + I * K * 13 + K * (D * 4 + 16) + 6 * K * 4
    assert workspace.indexer_kl_row_bytes(Hh, W, I, K, D, W, C, 4, 2, True, Qr) == fused + indexer
    dense = workspace.indexer_kl_row_bytes(Hh, 4096, I, 256, D, query_width=Qr)
    assert dense == workspace.indexer_kl_row_bytes(Hh, 4096, I, 256, D, fused_target=True, query_width=Qr)


def test_the_plan_counts_the_attentions_probabilities(monkeypatch):
    """The objective's chunk at 32K is the kernel's rows of the kernel's bytes where the target comes from op
    ``indexer_target``'s kernel or from the attention's backward, the reference's elsewhere (the same
    ``ops.workspace`` formula ``_Row.bounds`` sizes its chunks with). Both sparse-attention implementations the
    planner plans (``absorbed``, ``triton``) leave the head-summed probabilities, so a plan with
    ``model.train_indexer`` sizes the objective for a given target whatever its fast ops, and its DSA layers'
    backward holds the ``[n, W]`` fp32 buffer (``layers.head_probs_bytes``; none under ``torch_masked``)."""
    from megaseq.models.glm5.spec import glm5_flash_1gpu
    from megaseq.plan import layer_terms, layers
    from megaseq.plan.mesh import Precision
    from megaseq.plan.planner import plan

    assert "indexer_target" in kernels.PLANNED_FAST_OPS
    spec, S = glm5_flash_1gpu(), 32768
    W, C, P = layers.dsa_width(spec), spec.kv_lora_rank, S // 16
    rows = {}
    for fused in (False, True):
        kept, work = layers.indexer_objective_bytes(spec, S, 1, S, Precision(), fused_target=fused)
        per_row = workspace.indexer_kl_row_bytes(16, W, 32, 128, 128, W, C, 4, 2, fused, spec.q_lora_rank)
        rows[fused] = workspace.indexer_kl_chunk(16, W, 32, 128, 128, W, C, 4, gathered_itemsize=2,
                                                 fused_target=fused, query_width=spec.q_lora_rank)
        assert kept == 4 * (2 * S * 128 + P * 128)  # the pooled keys' graph, from the forward to the objective
        assert work == rows[fused] * per_row + 4 * (P * 128 + S * 32)  # a chunk and the gradients it sums
    assert rows[True] > 10 * rows[False]
    assert layers.head_probs_bytes(spec, S, "triton") == layers.head_probs_bytes(spec, S, "absorbed") == 4 * S * W
    assert layers.head_probs_bytes(spec, S, "torch_masked") == 0
    asked = []
    real = layers.indexer_objective_bytes
    monkeypatch.setattr(layers, "indexer_objective_bytes", lambda *a, fused_target=False, **k:
                        asked.append(fused_target) or real(*a, fused_target=fused_target, **k))
    for fast in (frozenset(), kernels.PLANNED_FAST_OPS, kernels.PLANNED_FAST_OPS - {"indexer_target"}):
        asked.clear()
        plan(spec, S, fast_ops=fast, indexer_objective=True)
        assert asked and set(asked) == {True}, (sorted(fast), asked)
    # the buffer in the DSA layer's backward: that layer's backward working set without it is lower by its bytes
    from megaseq.plan import components as C
    from megaseq.plan.choice import base_settings
    from megaseq.plan.mesh import Mesh
    from megaseq.plan.run import Run

    monkeypatch.setattr(layers, "indexer_objective_bytes", real)
    run = Run(spec=spec, seq_len=S, batch=1, mesh=Mesh(), model_dtype="bf16", memory=base_settings(None, S),
              counts=C.count_params(spec), fast_ops=kernels.PLANNED_FAST_OPS, indexer_objective=True)
    i = spec.layer_types.index("dsa")
    with_probs = layer_terms._mixer(run, i, 2)[2]
    monkeypatch.setattr(layers, "head_probs_bytes", lambda *a: 0)
    assert with_probs - layer_terms._mixer(run, i, 2)[2] == 4 * S * W


def test_the_attentions_lse_in_the_row_bytes_and_the_plan(monkeypatch):
    """Given the attention's log-sum-exp the kernel writes no ``lse2 [Hh]`` and the reference exponentiates its scores
    in place (one ``[Hh, W]`` fp32 tensor fewer); the plan's objective reads it in the sparse stage and counts it as
    a tensor of its own (``[Q, Hh]`` fp32) only where ``sparse_attention`` is not the Triton op (whose lse is a view
    of what it saves)."""
    from megaseq.models.glm5.spec import glm5_flash_1gpu
    from megaseq.plan import layers
    from megaseq.plan.mesh import Precision
    from megaseq.plan.planner import plan

    Hh, W, C = 16, 2063, 512
    for fused, fewer in ((True, 4 * Hh), (False, 4 * Hh * W)):
        plain = workspace.indexer_target_row_bytes(Hh, W, C, 4, 2, fused=fused)
        assert plain - workspace.indexer_target_row_bytes(Hh, W, C, 4, 2, fused=fused, given_lse=True) == fewer
    spec, S = glm5_flash_1gpu(), 32768
    base = sum(layers.indexer_objective_bytes(spec, S, 1, S, Precision(), fused_target=True, given_lse=True))
    copy = sum(layers.indexer_objective_bytes(spec, S, 1, S, Precision(), fused_target=True, given_lse=True,
                                              lse_copy=True))
    assert copy - base == S * Hh * 4
    asked = []
    real = layers.indexer_objective_bytes
    monkeypatch.setattr(layers, "indexer_objective_bytes", lambda *a, **k: asked.append(k) or real(*a, **k))
    for fast in (frozenset(), kernels.PLANNED_FAST_OPS):
        asked.clear()
        plan(spec, S, fast_ops=fast, indexer_objective=True)
        assert asked and all(k["given_lse"] and k["lse_copy"] == ("sparse_attention" not in fast) for k in asked)


def test_the_fused_kl_row_has_no_head_scores_and_no_gathered_keys(monkeypatch):
    """glm5-flash-1gpu's DSA layer at 1M (P = 64K pools of 16; and at 16K): with op ``indexer_kl``'s kernel the
    row's indexer side is its queries, the kernel's own rows (``indexer_kl_kernel_row_bytes``) and the pools, target
    and candidates it reads, not ``[I, K]`` head scores and ``[K, D]`` gathered keys; the chunk holds the pooled
    keys' gradient once, and grows from about 11K to about 20K queries. The plan counts the kernel only where its
    fast ops hold it."""
    from megaseq.models.glm5.spec import glm5_flash_1gpu
    from megaseq.plan import layers
    from megaseq.plan.mesh import Precision

    Hh, W, C, I, K, D, Qr, P = 16, 2063, 512, 32, 128, 128, 1536, 1 << 16
    target = workspace.indexer_target_row_bytes(Hh, W, C, 4, 2, fused=True)
    row = workspace.indexer_kl_row_bytes(Hh, W, I, K, D, W, C, 4, 2, True, Qr, fused_kl=True)
    assert row == target + (Qr + 2 * I * D) * 4 + 8 + 8 * I * (D + 1) + 2 * I * D + 4 * K + 13 * K
    rows = [workspace.indexer_kl_chunk(Hh, W, I, K, D, W, C, 4, gathered_itemsize=2, fused_target=True, query_width=Qr,
                                       fused_kl=f, num_pools=P) for f in (False, True)]
    assert 10000 < rows[0] < 12000 and 19000 < rows[1] < 21000, rows
    assert rows[1] == (workspace.INDEXER_KL_BUDGET_BYTES - 8 * P * D) // row
    # the dense warm-up has no kernel: the same row either way
    assert workspace.indexer_kl_row_bytes(Hh, 4096, I, 256, D, query_width=Qr, fused_kl=True) == \
        workspace.indexer_kl_row_bytes(Hh, 4096, I, 256, D, query_width=Qr)
    # at 16K one chunk of the kernel's holds every query, below the budget the reference's chunks fill
    spec, S = glm5_flash_1gpu(), 1 << 14
    P16 = S // spec.index_kpool
    ref, fused = (layers.indexer_objective_bytes(spec, S, 1, S, Precision(), fused_target=True, given_lse=True,
                                                 fused_kl=f) for f in (False, True))
    assert ref[0] == fused[0] and fused[1] < ref[1] < workspace.INDEXER_KL_BUDGET_BYTES + 4 * (P16 * D + S * I)
    # the kernel's chunk holds the pooled keys' gradient cast to bf16 keys: 2 bytes a value more than fp32 keys
    b16, b32 = (workspace.indexer_kl_bytes(S, S, Hh, I, D, P16, spec.index_topk // spec.index_kpool, W, C, False,
                                           gathered_itemsize=2, fused_target=True, query_width=Qr, given_lse=True,
                                           fused_kl=True, keys_itemsize=k) for k in (2, 4))
    assert b16 - b32 == 2 * P16 * D
    seen, real_bytes = [], layers.indexer_kl_bytes
    monkeypatch.setattr(layers, "indexer_kl_bytes", lambda *a, **k: seen.append(k["keys_itemsize"]) or
                        real_bytes(*a, **k))
    layers.indexer_objective_bytes(spec, S, 1, S, Precision(), fused_target=True, given_lse=True, fused_kl=True)
    assert seen == [Precision().compute]  # the pooled keys are the activations' dtype
    from megaseq.plan.planner import plan

    asked, real = [], layers.indexer_objective_bytes
    monkeypatch.setattr(layers, "indexer_objective_bytes", lambda *a, fused_kl=False, **k:
                        asked.append(fused_kl) or real(*a, fused_kl=fused_kl, **k))
    for fast in (kernels.PLANNED_FAST_OPS, kernels.PLANNED_FAST_OPS | {"indexer_kl"}):
        asked.clear()
        plan(spec, S, fast_ops=fast, indexer_objective=True)
        assert asked and set(asked) == {"indexer_kl" in fast}, (sorted(fast), asked)

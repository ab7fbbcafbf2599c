"""GLM-5.3-Flash layers tiled (``memory.tiling.tile_layer``): the token-separable parts run in tiles with
recompute, and
the result equals the untiled layer (float64, CPU): outputs, the input gradient, every parameter
gradient, the MoE load counts, the DSA selection handed to a shared layer."""

from __future__ import annotations

import pytest
import torch

from megaseq.memory.tiling import tile_layer, token_tiled
from megaseq.models.build import build_model
from megaseq.models.common.context import SeqContext, positions_from_doc_ids
from megaseq.models.spec import from_hf_config

pytest.importorskip("transformers")
from test_glm5_parity import make_config, randomize_, rel_err  # noqa: E402

torch.set_num_threads(1)
F64 = torch.float64


def _model(mlp: str, seed: int = 0):
    cfg = make_config(mlp)
    model = build_model(from_hf_config(cfg.to_dict()), dtype=F64, seed=seed)
    randomize_(model, seed=seed + 1)
    return model, cfg


def _run(model, ids, doc_ids, w, tile):
    for layer in model.layers:
        tile_layer(layer, tile)
    model.zero_grad(set_to_none=True)
    ctx = SeqContext(doc_ids=doc_ids, position_ids=positions_from_doc_ids(doc_ids))
    hidden = model.embed(ids)
    for layer in model.layers:  # the streams themselves (model() ends in a float32-statistics norm)
        hidden = layer(hidden, ctx)
    (hidden * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    counts = {i: l.mlp.last_tokens_per_expert.clone() for i, l in enumerate(model.layers)
              if hasattr(l.mlp, "last_tokens_per_expert")}
    return hidden.detach(), grads, counts


@pytest.mark.parametrize("mlp", ["dense", "mixed"])
def test_tiled_model_equals_untiled(mlp):
    """All 8 layers (KDA, full and shared DSA; dense and MoE) tiled by 7 tokens over 2 x 31 tokens."""
    model, cfg = _model(mlp)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(1, cfg.vocab_size, (2, 31), generator=gen)
    doc_ids = torch.tensor([[0] * 12 + [1] * 19, [0] * 31])
    w = torch.randn(2, 31, cfg.hc_mult, cfg.hidden_size, generator=gen, dtype=F64)
    h0, g0, c0 = _run(model, ids, doc_ids, w, None)
    h1, g1, c1 = _run(model, ids, doc_ids, w, 7)
    rtol = 1e-12  # MoE too: the router computes in float64 for a float64 model (moe.py)
    assert rel_err(h1, h0) < rtol
    assert g1.keys() == g0.keys()
    worst = max(rel_err(g1[n], g0[n]) for n in g0)
    print(f"\ntiled ({mlp}): hidden {rel_err(h1, h0):.2e}, worst grad {worst:.2e} (rtol {rtol:g})")
    assert worst < rtol
    for i in c0:  # the load counts of the whole sequence, and not counted again by the recompute
        assert torch.equal(c1[i], c0[i]) and int(c1[i].sum()) == 2 * 31 * cfg.num_experts_per_tok


def test_tiled_layer_input_grad_and_no_grad_path():
    model, cfg = _model("dense", seed=3)
    layer = model.layers[3]  # full DSA + dense MLP
    gen = torch.Generator().manual_seed(4)
    h = torch.randn(1, 29, cfg.hc_mult, cfg.hidden_size, generator=gen, dtype=F64).requires_grad_()
    w = torch.randn(h.shape, generator=gen, dtype=F64)
    outs = {}
    for tile in (None, 5, 64):
        tile_layer(layer, tile)
        out = layer(h, SeqContext())
        outs[tile] = (out, torch.autograd.grad((out * w).sum(), h)[0])
        with torch.no_grad():
            assert rel_err(layer(h, SeqContext()), out) < 1e-13  # the plain tile loop, no autograd Function
    for tile in (5, 64):
        assert rel_err(outs[tile][0], outs[None][0]) < 1e-12
        assert rel_err(outs[tile][1], outs[None][1]) < 1e-12
    with pytest.raises(ValueError, match="mlp_tile_tokens"):  # refused when applied, before any forward
        tile_layer(layer, 0)


def test_recompute_keeps_the_forward_autocast():
    """Backward runs outside autocast; the tiles' recompute must restore the forward's bf16 autocast.
    With one tile (B = 1, tile >= S) the tiled layer runs the same bf16 ops as the plain one, so the
    gradients agree to float32 summation order (~1e-7); a recompute in float32 would be ~1e-2 off."""
    model = build_model(from_hf_config(make_config("dense").to_dict()), dtype=torch.float32, seed=0)
    layer = model.layers[0]  # KDA + dense MLP (the DSA indexer is not run under CPU bf16)
    gen = torch.Generator().manual_seed(6)
    h = torch.randn(1, 19, 4, 36, generator=gen).requires_grad_()
    w = torch.randn(h.shape, generator=gen)
    grads = []
    for tile in (None, 64):
        tile_layer(layer, tile)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(h, SeqContext())
        grads.append(torch.autograd.grad((out.float() * w).sum(), [h, *layer.parameters()], allow_unused=True))
    for a, b in zip(*grads):
        assert (a is None) == (b is None)
        if a is not None:
            assert rel_err(a, b) < 1e-6


def test_token_tiled_function_several_inputs_and_outputs():
    gen = torch.Generator().manual_seed(8)
    lin = torch.nn.Linear(5, 3).double()
    a = torch.randn(13, 5, generator=gen, dtype=F64).requires_grad_()
    b = torch.randn(13, 3, generator=gen, dtype=F64)  # no grad: its gradient is not asked for

    def fn(x, y):
        z = lin(x)
        return z * y, z.sum(-1)

    ga, gb = torch.randn(13, 3, generator=gen, dtype=F64), torch.randn(13, generator=gen, dtype=F64)
    ref = fn(a, b)
    g_ref = torch.autograd.grad((ref[0] * ga).sum() + (ref[1] * gb).sum(), [a, *lin.parameters()])
    out = token_tiled(fn, [lin], 4, a, b)
    g_out = torch.autograd.grad((out[0] * ga).sum() + (out[1] * gb).sum(), [a, *lin.parameters()])
    for x, y in zip((*out, *g_out), (*ref, *g_ref)):
        assert rel_err(x, y) < 1e-14

"""Per-layer-kind working sets (megaseq.plan.layers): hand-computed values on small shapes, and the
saved set predicted for whole layers against what autograd really saves in the megaseq blocks (CPU)."""

from __future__ import annotations

import contextlib
import importlib

import pytest
from test_plan_components import small_spec

from megaseq.models.spec import ModelSpec
from megaseq.plan import layers as LY
from megaseq.plan.mesh import Calibration, Mesh, Precision

AUTOCAST = Precision()


def test_kda_saved_by_hand():
    spec = small_spec()  # H 8, KDA 2 heads x 3 (D = 6); input: the fp32 norm output (xb 4)
    got = LY.kda_saved(spec, 10, 4, AUTOCAST)
    assert got["kda projections' inputs"] == 10 * 6 * 2 * 8  # six linears, a bf16 cast each
    assert got["kda conv"] == 10 * 1 * 2 * 3 * 6  # fla's conv saves its bf16 input only, 3D channels
    assert got["kda forget gate"] == 10 * 2 * 4 * 6
    # q, k, v bf16 (3 * 2 * 6) + g and its cumsum fp32 (2 * 4 * 6) + Aqk, Akk bf16 (2 * 2 * 2 heads * 64)
    # + rstd
    assert got["kda chunk state (q,k,v,g,A)"] == 10 * (36 + 48 + 512 + 16)
    # gated norm 4 fp32 tensors (4 * 4 * 6) + o_proj input (2 * 6) + f_a, g_a outputs (2 * 2 * 3)
    assert got["kda output norm + o_proj input"] == 10 * (96 + 12 + 12)
    # forward temporaries: 7 * c * D + the chunk states heads*dk*dv*c/64 = 84 + 0.5625 per token
    assert LY.kda_temp(spec, 10, AUTOCAST, False) == int(10 * (84 + 2 * 2 * 3 * 3 / 64))


def test_dsa_saved_by_hand():
    spec = small_spec()  # MLA 2 heads, q_lora 6, kv_lora 4, qk 3, v 5; topk 8, kpool 4
    got = LY.dsa_saved(spec, 12, 1, 12, 4, AUTOCAST, Mesh(), "gather_kv", full_indexer=True)
    assert got["dsa projections' inputs"] == 12 * 2 * 2 * 8
    # q_a norm (4 + 2) * 6, kv_a norm (4 + 2) * 4, q_b's bf16 cast of the fp32 q_resid 2 * 6
    assert got["dsa q/kv norms + q_b input"] == 12 * (36 + 24 + 12)
    assert got["dsa q"] == 12 * 2 * 2 * 3
    # per K/V row: kv_b's cast input 2 * 4, keys 2 * 2 * 3, kv_b output 2 * 2 * (3 + 5)
    assert got["dsa K/V (kv_b input, k, kv_b output)"] == 12 * (8 + 12 + 32)
    assert got["dsa o_proj input"] == 12 * 2 * 2 * 5
    # one query block (12 queries x 2 heads x 12 keys): fp32 softmax + bf16 probabilities
    assert got["dsa attention scores (one block)"] == 6 * 12 * 2 * 12
    assert "dsa selection (int32)" not in got
    small_blocks = Calibration(attn_block_elems=48)
    blocked = LY.dsa_saved(spec, 12, 1, 12, 4, AUTOCAST, Mesh(), "gather_kv", True, small_blocks)
    assert blocked["dsa selection (int32)"] == 4 * 12 * (8 + 3)  # topk + the kpool - 1 tail
    assert "dsa attention scores (one block)" not in blocked


def test_dsa_kv_rows_by_mode():
    # gather-KV expands the whole sequence's K/V on every rank; Ulysses the local share
    assert LY.dsa_kv_rows(256, 2, 512, Mesh(cp=4), "gather_kv") == 1024
    assert LY.dsa_kv_rows(256, 2, 512, Mesh(cp=4), "ulysses") == 256
    assert LY.dsa_kv_rows(1024, 2, 512, Mesh(), "gather_kv") == 1024


def test_indexer_scoring_matches_memory_module():
    pytest.importorskip("torch")
    from megaseq.ops.indexer.scoring import indexer_scoring_bytes

    assert LY.indexer_scoring_bytes(37, 1001, 5, 13) == indexer_scoring_bytes(37, 1001, 5, 13)
    # by hand: 2 queries x (3 pools x ((2 heads + 1) x 4 + 9) + 1 selected x 13)
    assert LY.indexer_scoring_bytes(2, 3, 2, 1) == 2 * (3 * 21 + 13)


def test_moe_by_hand():
    spec = small_spec()  # H 8, E 4, K 2, I 6, 1 shared expert, GLM clamp (6 bf16 tensors of I per row)
    got = LY.moe_saved(spec, 10, 4, AUTOCAST, Mesh(), 4.0)
    # router: bf16 cast of x (2 * 8), scores (2 * 4), group mask (4), top-k int64 indices 8 * (2 + 3)
    assert got["moe router"] == 10 * (16 + 8 + 4 + 40)
    # 20 routed rows: cast x (2 * 8) + SwiGLU (6 * 2 * 6) + expert output (2 * 8)
    assert got["moe routed rows (x, SwiGLU, y)"] == 20 * (16 + 72 + 16)
    assert got["moe shared expert"] == 10 * (2 * 2 * 8 + 72)
    assert LY.moe_rows(spec, 10, Mesh(), 4.0) == 20  # one GPU: exactly N * K rows, whatever the routing
    assert LY.moe_rows(spec, 10, Mesh(ep=2), 4.0) == 40  # capped: every token to this GPU's 2 experts
    assert LY.moe_rows(spec, 10, Mesh(ep=2), 1.5) == 30  # imbalance x the mean of 20


def test_attention_by_hand():
    spec = ModelSpec(family="qwen3_moe", vocab_size=50, hidden_size=8, num_layers=1,
                     layer_types=("attention",), mlp_types=("dense",), intermediate_size=12,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=3, qk_norm=True)
    got = LY.attention_saved(spec, 10, 4, AUTOCAST, Mesh())
    assert got["attention projections' inputs"] == 10 * 3 * 2 * 8
    assert got["attention q/k norms + rope"] == 10 * ((4 + 2) * (4 + 2) * 3 + 2 * 4 * 3)
    assert got["attention q,k,v,o + lse"] == 10 * (2 * (8 + 4) * 3 + 4 * 4)
    # cp 4 > 2 KV heads: each KV head repeated twice before the all-to-all
    rep = LY.attention_saved(spec, 10, 4, AUTOCAST, Mesh(cp=4))
    assert rep["attention q,k,v,o + lse"] == 10 * (2 * (8 + 8) * 3 + 4 * 4)


# ---- the formulas against autograd's saved tensors in the real blocks ------------------------------------
def saved_bytes(module, x, autocast: bool, skip_params: bool = False) -> int:
    """Bytes of the distinct storages autograd saves during ``module(x, SeqContext())`` (``bench.saved``);
    ``skip_params``: the module's parameters' own storages left out (the planner counts those as state, and
    autocast's bf16 copies of them as weight copies; a frozen weight is kept for its input's gradient as a
    trained one is)."""
    import torch

    from megaseq.bench.saved import SavedStorages
    from megaseq.models.common.context import SeqContext

    saved = SavedStorages(module.parameters() if skip_params else ())
    cm = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with saved.recording(), cm, kv_heads_as_on_cuda():
        module(x, SeqContext())
    return saved.total()


@contextlib.contextmanager
def kv_heads_as_on_cuda():
    """SDPA's key/value heads chosen as on CUDA (the planner's device): float32 GQA repeats them
    (``attention.kv_for_sdpa``), which on the CPU it does not."""
    import torch

    from megaseq.models.common import attention

    orig = attention.kv_for_sdpa
    attention.kv_for_sdpa = lambda q, k, v, repeat=None: orig(
        q, k, v, q.dtype == torch.float32 if repeat is None else repeat)
    try:
        yield
    finally:
        attention.kv_for_sdpa = orig


def uncounted(op: str, block: str):
    """Route op ``op`` (``kda`` or ``gdn``) to a stand-in that saves nothing (the output is v), while the
    generator is suspended: the planner models fla's chunk kernel, whose own saved set (``kda chunk state``,
    ``gdn chunk state``) is left out of the comparison. ``block``: the module registering the reference."""
    torch = pytest.importorskip("torch")
    importlib.import_module(block)  # registers the reference first
    from megaseq.ops import dispatch

    class _NoSave(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, g, beta):
            return v.clone()

        @staticmethod
        def backward(ctx, grad):
            return None, None, grad, None, None

    name, state = "plan_test_no_save", {"on": True}

    @dispatch.register(op, name, supports=lambda *a, **k: None if state["on"] else "plan test stub off")
    def _stand_in(q, k, v, g, beta, *args, **kwargs):
        return _NoSave.apply(q, k, v, g, beta)

    yield
    state["on"] = False
    dispatch._state.registry[op].pop(name, None)  # leave the registry as other tests expect it


@pytest.fixture
def kda_uncounted():
    """Op ``kda`` without its chunk kernel's saved set (``uncounted``)."""
    yield from uncounted("kda", "megaseq.models.common.kda")


BLOCK = 1 << 16  # score elements per reference sparse-attention block in these tests: several blocks at S=999


@pytest.mark.parametrize("name,seq,autocast,block", [
    ("glm5-flash-tiny", 999, False, 1 << 26), ("glm5-flash-tiny", 999, False, BLOCK),
    ("glm5-flash-tiny", 333, True, 1 << 26), ("qwen3-moe-tiny", 999, False, 0),
    ("qwen3-moe-tiny", 333, True, 0),
])
def test_saved_set_matches_blocks(name, seq, autocast, block, kda_uncounted, monkeypatch):
    """Each layer's predicted saved bytes within 5% of the storages autograd keeps (fp32 and CPU bf16
    autocast; DSA with one attention block and with several checkpointed blocks)."""
    import torch

    from megaseq.models.build import build_model
    from megaseq.models.presets import get_preset
    from megaseq.ops.sparse_mla import reference as mla_dsa
    from megaseq.plan import components as C
    from megaseq.plan.choice import base_settings
    from megaseq.plan.layer_terms import layer_terms
    from megaseq.plan.run import Run

    if block:
        monkeypatch.setattr(mla_dsa, "ATTENTION_BLOCK_ELEMS", block)
    torch.manual_seed(0)
    spec = get_preset(name)
    model = build_model(spec, dtype=torch.float32, seed=0)
    shape = (1, seq, spec.hc_mult, spec.hidden_size) if spec.hc_mult > 1 else (1, seq, spec.hidden_size)
    h = torch.randn(*shape, requires_grad=True)
    run = Run(spec=spec, seq_len=seq, batch=1, mesh=Mesh(), model_dtype="bf16" if autocast else "fp32",
              memory=base_settings(None, seq).to_dict(), counts=C.count_params(spec),
              # the CPU path: the reference sparse attention, and the torch conv (which keeps its output)
              cal=Calibration(attn_block_elems=block or 1 << 26, kda_conv_copies=2), sparse_impl="torch_masked")
    for i, layer in enumerate(model.layers):
        if spec.layer_types[i] == "dsa" and (autocast or spec.indexer_types[i] == "shared"):
            continue  # DSA under CPU autocast: see the planner report (indexer scoring overflows in bf16)
        terms = layer_terms(run, i)
        dense, experts, _ = run.counts.layers[i]  # autocast also saves bf16 casts of the weights
        copies = C.weight_copy_bytes(dense + experts, run.prec, run.mesh)
        predicted = terms.saved - terms.attn.get("kda chunk state (q,k,v,g,A)", 0) + copies
        # the parameters' own storages left out: the planner counts them as state (autocast's casts as copies)
        measured = saved_bytes(layer, h, autocast, skip_params=True)
        assert abs(predicted / measured - 1) < 0.05, (i, spec.layer_types[i], predicted / seq, measured / seq)


def test_token_tiled_saved_set_matches_blocks(kda_uncounted):
    """A token-tiled GLM-5 layer (``tile_layer``, what ``tiled_mlp`` applies) keeps what the planner says:
    its input, one set of mHC weights, the mixer's own saved set and the mixer output (fp32, CPU)."""
    import torch

    from megaseq.memory.tiling import tile_layer
    from megaseq.models.build import build_model
    from megaseq.models.presets import get_preset
    from megaseq.plan import components as C
    from megaseq.plan.choice import base_settings
    from megaseq.plan.layer_terms import layer_terms
    from megaseq.plan.run import Run

    torch.manual_seed(0)
    spec, seq, tile = get_preset("glm5-flash-tiny"), 999, 128
    model = build_model(spec, dtype=torch.float32, seed=0)
    h = torch.randn(1, seq, spec.hc_mult, spec.hidden_size, requires_grad=True)
    memory = dict(base_settings(None, seq).to_dict(), tiled_mlp=True, mlp_tile_tokens=tile)
    cpu = Calibration(kda_conv_copies=2)  # the torch reference conv keeps its output too (fla's does not)
    run = Run(spec=spec, seq_len=seq, batch=1, mesh=Mesh(), model_dtype="fp32", memory=memory,
              counts=C.count_params(spec), sparse_impl="torch_masked", cal=cpu)
    untiled = Run(spec=spec, seq_len=seq, batch=1, mesh=Mesh(), model_dtype="fp32", memory=base_settings(None, seq),
                  counts=C.count_params(spec), sparse_impl="torch_masked", cal=cpu)
    for i, layer in enumerate(model.layers):
        if spec.layer_types[i] != "kda":
            continue
        tile_layer(layer, tile)
        terms = layer_terms(run, i)
        predicted = terms.saved - terms.attn.get("kda chunk state (q,k,v,g,A)", 0)
        measured = saved_bytes(layer, h, autocast=False)
        assert abs(predicted / measured - 1) < 0.05, (i, predicted / seq, measured / seq)
        assert predicted < 0.6 * layer_terms(untiled, i).saved  # the tiling is what the planner counts on


def test_kda_segmented_by_hand():
    """Segmented KDA keeps its input and one fp32 state per segment; its working set is one segment's."""
    spec = small_spec()  # H 8, KDA 2 heads x 3, conv kernel from the spec
    K = spec.linear_conv_kernel
    saved, fwd, bwd = LY.kda_segmented(spec, 40, 1, 8, 4, AUTOCAST)
    assert saved == {"kda segmented: input": 40 * 4 * 8, "kda segmented: states": 5 * 4 * 2 * 3 * 3}
    m = 8 + K - 1
    seg = sum(LY.kda_saved(spec, m, 4, AUTOCAST).values())
    seg_cal = Calibration(kda_bwd_temp_fd=Calibration().kda_segment_bwd_temp_fd)  # its own fitted coefficient
    assert bwd == seg + LY.kda_temp(spec, m, AUTOCAST, True, seg_cal) + 40 * 4 * 8
    assert fwd == LY.kda_temp(spec, m, AUTOCAST, False) + int(Calibration().nograd_fraction * seg) + 40 * 2 * 8


def test_planner_chooses_kda_segments_only_where_usable():
    """Segmented KDA is a rung of the ladder where it can run (one rank of context, no packed documents);
    with ``memory.auto`` false a given segment size is used as is; it lowers the KDA layers' share."""
    from megaseq.config import MemoryConfig
    from megaseq.models.presets import get_preset
    from megaseq.plan import plan

    spec, S = get_preset("glm5-flash-1gpu"), 160 * 1024
    auto = plan(spec, S)
    assert auto.fits and "kda_segments" in [f[0] for f in auto.fixes] and auto.memory["kda_segment_tokens"] > 0
    docs = plan(spec, S, packed_documents=True)  # text data: the segmented layer would refuse documents
    assert "kda_segments" not in [f[0] for f in docs.fixes] and docs.memory["kda_segment_tokens"] == 0
    assert docs.fits and sum(f[1] for f in auto.fixes) < sum(f[1] for f in docs.fixes)  # a costlier way
    # sequence segments do carry documents (the KDA state restarts per document): the same plan for text
    long_auto, long_docs = plan(spec, 384 * 1024), plan(spec, 384 * 1024, packed_documents=True)
    assert long_auto.fits and "model_segments" in [f[0] for f in long_auto.fixes]
    assert long_docs.fits and long_docs.memory == long_auto.memory
    given = plan(spec, S, memory_cfg=MemoryConfig(auto=False, kda_segment_tokens=8192))  # forced: as given
    assert given.memory["kda_segment_tokens"] == 8192 and "kda_segments" in [f[0] for f in given.fixes]

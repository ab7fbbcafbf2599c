"""``train.layer_graphs``: which layers and runs are graphed (CPU), and on a GPU that the graphed layers give the
eager layers' losses and every parameter gradient, step after step, with the DSA layers between them eager."""

from __future__ import annotations

import copy

import pytest
import torch

from megaseq.config import MemorySettings
from megaseq.memory.vocab_loss import linear_cross_entropy
from megaseq.models.build import build_model
from megaseq.models.common.context import SeqContext
from megaseq.models.common.moe import MoE
from megaseq.models.spec import from_hf_config
from megaseq.train import layer_graphs

pytest.importorskip("transformers")
from test_glm5_parity import make_config, randomize_  # noqa: E402

CUDA = torch.device("cuda")


def _model(seed: int = 0):
    cfg = make_config("mixed")
    model = build_model(from_hf_config(cfg.to_dict()), dtype=torch.float64, seed=seed)
    randomize_(model, seed=seed + 1)
    return model, cfg


def test_the_kda_layers_are_eligible():
    model, _ = _model()
    kinds = [layer.layer_type for layer in model.layers]
    assert [layer_graphs.eligible(layer) for layer in model.layers] == [k == "kda" for k in kinds]
    assert "dsa" in kinds and "kda" in kinds


def test_why_a_run_is_not_graphed():
    model, _ = _model()
    plain = MemorySettings()
    assert layer_graphs.why_not(True, CUDA, 1, plain, None, model) is None
    assert layer_graphs.why_not(False, CUDA, 1, plain, None, model) == "model.cuda_graphs is off"
    assert layer_graphs.why_not(True, torch.device("cpu"), 1, plain, None, model) == "device cpu"
    assert layer_graphs.why_not(True, CUDA, 2, plain, None, model) == "2 processes"
    tiled = MemorySettings(tiled_mlp=True, recompute=True)
    assert layer_graphs.why_not(True, CUDA, 1, tiled, None, model) == "memory schemes tiled_mlp, recompute"
    chunked = MemorySettings(chunked_loss=True, kda_segment_tokens=4096, indexer_query_chunk=8192)
    assert layer_graphs.why_not(True, CUDA, 1, chunked, None, model) == "memory schemes chunked_loss, kda_segments"
    assert layer_graphs.why_not(True, CUDA, 1, MemorySettings(indexer_query_chunk=8192), None, model) is None
    assert layer_graphs.why_not(True, CUDA, 1, plain, torch.bfloat16, model) == "autocast to torch.bfloat16"
    next(m for m in model.modules() if isinstance(m, MoE)).aux_loss_coef = 0.01
    assert layer_graphs.why_not(True, CUDA, 1, plain, None, model) == "an auxiliary balance loss"
    dense, _ = _model()
    for layer in dense.layers:
        layer.layer_type = "dsa"
    dense.layers = torch.nn.ModuleList(layer for layer in dense.layers if not layer_graphs.eligible(layer))
    assert layer_graphs.why_not(True, CUDA, 1, plain, None, dense) == "no KDA layer"


def test_a_cpu_run_has_no_graphs():
    model, _ = _model()
    logged = []
    assert layer_graphs.for_run(True, model, torch.device("cpu"), 1, MemorySettings(), None, logged.append) is None
    assert logged == []


def test_a_packed_or_accumulated_step_neither_captures_nor_replays():
    model, _ = _model()
    graphs = layer_graphs.LayerGraphs(model)
    ids = torch.zeros(1, 8, dtype=torch.long)
    graphs.before_step([{"input_ids": ids}])
    graphs.before_step([{"input_ids": ids, "doc_ids": torch.zeros_like(ids)}])  # the second step: packed
    assert graphs.shape is None and not graphs._on
    graphs.before_step([{"input_ids": ids}, {"input_ids": ids}])
    assert graphs.shape is None and not graphs._on


def test_graphs_not_kept_give_the_modules_their_statistics_back():
    """A capture leaves its own tensors (the graphs' pool) as the MoE's loads; graphs that fail or are dropped put
    back what the modules held before, and the layers' own forward."""
    model, _ = _model()
    i, moe = next((i, m) for i, layer in enumerate(model.layers) for m in layer.modules() if isinstance(m, MoE))
    layer = model.layers[i]
    moe.last_tokens_per_expert = mine = torch.ones(3)
    before = layer_graphs._statistics(layer)
    assert any(v is mine for _, _, v in before)
    layer._megaseq_eager_forward = layer.forward
    moe.last_tokens_per_expert = torch.zeros(3)  # what the capture left
    layer_graphs.LayerGraphs(model)._restore([i], before)
    assert moe.last_tokens_per_expert is mine and not hasattr(layer, "_megaseq_eager_forward")


def _least(model, seq_len: int) -> int:
    """The graphs' gradient and input buffers: the trained parameters of the KDA layers and one layer input each."""
    kda = [layer for layer in model.layers if layer_graphs.eligible(layer)]
    grads = sum(p.numel() * p.element_size() for layer in kda for p in layer.parameters() if p.requires_grad)
    h = model.embed(torch.zeros(1, seq_len, dtype=torch.long, device=model.lm_head.weight.device))
    return grads + len(kda) * h.numel() * h.element_size()


@pytest.mark.parametrize("headroom", [-1, "least - 1"])
def test_graphs_that_cannot_fit_the_plan_s_headroom_are_not_captured(headroom):
    """Before the capture: the graphs' gradient and input buffers alone beyond the plan's headroom (one byte short,
    or a plan over its budget, whose headroom is negative) leave the layers eager, said once, with nothing captured
    or patched (buffers that just fit go on to the capture: the GPU test of the drop)."""
    model, _ = _model()
    least = _least(model, 8)
    logged = []
    graphs = layer_graphs.LayerGraphs(model, logged.append, headroom=-1 if headroom == -1 else least - 1)
    ids = torch.zeros(1, 8, dtype=torch.long)
    graphs.before_step([{"input_ids": ids}])
    graphs.before_step([{"input_ids": ids}])
    assert graphs.shape is None and graphs.graphed == [] and graphs.pool_bytes == 0
    assert len(logged) == 1 and logged[0].startswith("CUDA graphs: not captured (their gradient and input buffers")
    assert "exceed the plan's headroom" in logged[0] and logged[0].endswith("the layers run eagerly")
    assert graphs.failed and "headroom" in graphs.failed
    assert all("forward" not in vars(layer) and not hasattr(layer, "_megaseq_eager_forward") for layer in model.layers)


def test_the_run_holds_the_graphs_to_the_plan_s_headroom():
    model, _ = _model()
    graphs = layer_graphs.for_run(True, model, CUDA, 1, MemorySettings(), None, headroom=123)
    assert graphs is not None and graphs.headroom == 123


def _loss(model, ids, labels):
    hidden = model(ids)
    return linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), model.lm_head.weight, labels.reshape(-1),
                                reduction="sum") / labels.numel()


# the tiny model at widths the fast kernels take (torch's grouped GEMM wants rows of 16-byte multiples)
ALIGNED = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_attention_heads=4,
               num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32, v_head_dim=16, qk_nope_head_dim=16,
               index_head_dim=16, linear_head_dim=16, linear_num_heads=4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graphed_layers_give_the_eager_losses_and_gradients():
    """Five steps of the same bf16 model under the fast kernels (as `megaseq train` runs it), eager and graphed
    (captured before the second step), each with a new batch and an SGD update: every step's loss and every
    parameter's gradient agree, and so do the MoE loads each forward leaves (an evaluation's forward runs eagerly
    between the steps). A replay that read a stale input (the capture's sample, the step before's), left a
    gradient out or left the loads of the evaluation in place would differ from the second step on."""
    from megaseq.ops import dispatch
    from megaseq.ops.kernels import preferred_kernels

    cfg = make_config("mixed", **ALIGNED)
    spec = from_hf_config(cfg.to_dict())
    ref = build_model(spec, dtype=torch.float64, seed=0)
    randomize_(ref, seed=1)
    eager = build_model(spec, dtype=torch.bfloat16, seed=0)  # the tensors HF keeps in float32 stay float32
    eager.load_state_dict(ref.state_dict())
    eager = eager.to(CUDA)
    graphed = copy.deepcopy(eager)
    logged: list[str] = []
    graphs = layer_graphs.LayerGraphs(graphed, logged.append)
    with dispatch.configured(preferred=preferred_kernels("cuda", "fast")):
        _steps(eager, graphed, graphs, cfg)
    assert graphs.failed is None and not logged, logged
    kda = [i for i, layer in enumerate(graphed.layers) if layer.layer_type == "kda"]
    assert graphs.graphed == kda and graphs.shape == (1, 128, cfg.hc_mult, cfg.hidden_size)
    assert graphs.replays == 4 * len(kda)  # steps 2-5 replayed every KDA layer
    # the measured pool holds at least the static gradients and inputs, and the activations the layers save
    assert graphs.pool_bytes > _least(graphed, 128)
    # a layer whose parameters no longer train as at the capture (a frozen stage) runs eagerly
    for p in graphed.layers[kda[0]].parameters():
        p.requires_grad_(False)
    h = graphed.embed(torch.zeros(1, 128, dtype=torch.long, device=CUDA)).requires_grad_()
    with dispatch.configured(preferred=preferred_kernels("cuda", "fast")):
        graphed.layers[kda[0]](h, SeqContext())
    assert graphs.replays == 4 * len(kda)


def _steps(eager, graphed, graphs, cfg, lr=0.01):
    """Five steps of both models on the same batches, each compared. ``lr`` 0 keeps the weights: where both models
    run eagerly the kernels' atomic adds alone tell them apart, and the MoE's and the indexer's discrete choices
    make the model chaotic (a 1e-7 relative change of the weights moves an fp32 gradient by 3e-4 and, after one
    SGD step, by 4%), so a step's differences would compound over the next."""
    opts = {id(m): torch.optim.SGD(m.parameters(), lr=lr) for m in (eager, graphed)}
    gen = torch.Generator().manual_seed(3)
    for step in range(5):
        ids = torch.randint(1, cfg.vocab_size, (1, 128), generator=gen)
        labels = torch.randint(1, cfg.vocab_size, (1, 128), generator=gen)
        out = {}
        for m in (eager, graphed):
            if m is graphed:
                graphs.before_step([{"input_ids": ids, "labels": labels}])
            m.zero_grad(set_to_none=True)
            loss = _loss(m, ids.to(CUDA), labels.to(CUDA))
            loads = [x.last_tokens_per_expert.clone() for x in m.modules() if isinstance(x, MoE)]
            loss.backward()
            out[id(m)] = (loss.item(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
            opts[id(m)].step()
            with torch.no_grad():  # an evaluation's forward between steps: eager, its own expert loads
                m(ids[:, :64].to(CUDA))
            out[id(m)] += (loads,)
        (le, ge, we), (lg, gg, wg) = out[id(eager)], out[id(graphed)]
        # the MoE loads the balancer reads after a forward: the replay's, not the evaluation's before it
        assert all(torch.equal(a, b) for a, b in zip(we, wg, strict=True)), f"step {step}"
        # the same kernels on the same values: equal but for the order of atomic adds (sparse MLA's backward)
        assert lg == pytest.approx(le, rel=1e-3), f"step {step}"
        assert ge.keys() == gg.keys(), f"step {step}"
        for n in ge:
            err = (gg[n].float() - ge[n].float()).abs().max().item() / max(ge[n].float().abs().max().item(), 1e-30)
            assert err < 2e-2, f"step {step}: {n} {err:.3g}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graphs_beyond_the_plan_s_headroom_are_dropped():
    """A headroom that holds the graphs' gradient and input buffers but not their measured pool: the capture runs,
    its graphs are dropped and their memory given back (the private pools as before), the drop is said once, and
    the steps run eagerly with the eager model's losses and gradients."""
    from megaseq.ops import dispatch
    from megaseq.ops.kernels import preferred_kernels

    cfg = make_config("mixed", **ALIGNED)
    spec = from_hf_config(cfg.to_dict())
    eager = build_model(spec, dtype=torch.bfloat16, seed=0).to(CUDA)
    graphed = copy.deepcopy(eager)
    least = _least(graphed, 128)
    logged: list[str] = []
    graphs = layer_graphs.LayerGraphs(graphed, logged.append, headroom=least)
    torch.cuda.synchronize()
    pools = layer_graphs.private_pool_bytes(CUDA)
    with dispatch.configured(preferred=preferred_kernels("cuda", "fast")):
        _steps(eager, graphed, graphs, cfg, lr=0.0)
    assert graphs.shape is None and graphs.replays == 0 and graphs.pool_bytes == 0
    assert len(logged) == 1 and logged[0].startswith("CUDA graphs: dropped (their memory (") and "headroom" in logged[0]
    # no pool of the graphs is left, and none from before holds more (emptying the cache may shrink one)
    after = layer_graphs.private_pool_bytes(CUDA)
    assert set(after) <= set(pools) and all(after[k] <= pools[k] for k in after), (pools, after)
    assert torch.cuda.current_stream(CUDA) == torch.cuda.default_stream(CUDA)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_failed_capture_leaves_the_layers_eager():
    """Under the reference kernels the MoE's grouped GEMM reads the expert counts back to the host, which a capture
    cannot hold: the capture fails, says so, gives the default stream back, and the steps run eagerly with the
    eager model's losses and gradients."""
    model, cfg = _model()
    eager = model.float().to(CUDA)
    graphed = copy.deepcopy(eager)
    logged: list[str] = []
    graphs = layer_graphs.LayerGraphs(graphed, logged.append)
    _steps(eager, graphed, graphs, cfg, lr=0.0)
    assert graphs.failed and graphs.shape is None and graphs.replays == 0
    assert len(logged) == 1 and "the capture failed" in logged[0] and "run eagerly" in logged[0]
    assert torch.cuda.current_stream(CUDA) == torch.cuda.default_stream(CUDA)


def test_a_run_s_records_hold_the_graphs_pool_beside_the_plan(tmp_path, monkeypatch):
    """``megaseq train`` hands the graphs the plan's headroom, and each step's record sets its GPU peak beside the
    plan's figure plus the graphs' pool (held outside the plan's phases), so a run that graphs within its headroom
    is not warned of a peak above the plan."""
    import json
    from types import SimpleNamespace

    from test_train import _cfg

    from megaseq.train.trainer import run_training

    seen = {}

    def fake_for_run(enabled, model, device, world_size, memory, autocast, log=None, headroom=None):
        seen["headroom"] = headroom
        return SimpleNamespace(pool_bytes=3 * 2**30, before_step=lambda batches: None)

    monkeypatch.setattr(layer_graphs, "for_run", fake_for_run)
    run_training(_cfg(tmp_path, "g", train={"steps": 2}))
    plan = json.loads((tmp_path / "g" / "plan.json").read_text())
    records = [json.loads(line) for line in (tmp_path / "g" / "metrics.jsonl").read_text().splitlines()]
    assert seen["headroom"] == plan["headroom"] and plan["headroom"] > 0
    assert [r["plan_gpu_gib"] for r in records] == [pytest.approx(plan["peak_gpu"] / 2**30 + 3)] * 2

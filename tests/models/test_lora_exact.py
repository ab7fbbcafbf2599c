"""LoRA on a frozen base under every memory scheme: the gradient of every adapter parameter (and of the base
parameters ``train.trainable`` keeps training) equals autograd through the merged model, float64 on the CPU
to 1e-10; a frozen parameter's ``.grad`` stays None and the optimizer holds no state for it.

Both families, every projection kind adapted (``lora.targets all``: GQA / KDA / MLA projections with MLA's
``kv_b_proj`` folded into the weight, dense MLPs, shared and routed experts with per-expert factors),
rank 3 (odd), random factors, the input norms trained in full, packed documents. Each scheme is forced
(``memory.auto false``' settings, applied by the family's ``parallelize``). Broken variants (the scaling
alpha instead of alpha / r; a replayed scheme that drops the adapters from its parameters) must fail.
"""

from __future__ import annotations

import pytest
import torch

from lora_helpers import adapted_model, assert_grads, merged_reference, settings, trained
from megaseq.config import MemorySettings
from megaseq.memory import replay
from megaseq.memory.apply import loss_fn
from megaseq.memory.model_segments import segmented_loss_backward
from megaseq.models.common import lora
from megaseq.models.glm5.spec import glm5_flash_tiny
from megaseq.models.gpt_oss.spec import gpt_oss_tiny
from megaseq.models.qwen3_moe.spec import qwen3_moe_tiny
from megaseq.plan.activations import layer_input_bytes
from megaseq.plan.components import round_up
from megaseq.train.optim import build_optimizer

torch.set_num_threads(1)
S = 29
TRAIN = "*.input_layernorm.weight"


def glm5_spec():
    return glm5_flash_tiny().replace(index_topk=32)  # a top-k below the pool count: the selection matters


def batch(vocab: int, docs: bool):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (2, S), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    doc_ids = torch.tensor([[0] * 12 + [1] * (S - 12), [0] * S]) if docs else None
    if docs:
        labels[0, 11] = -100
    return ids, labels, doc_ids


def sco(spec) -> MemorySettings:
    budget = 3 * round_up(layer_input_bytes(2 * S, spec.hidden_size, spec.hc_mult, 8))
    return MemorySettings(recompute=True, checkpoint_offload=True, offload_host_budget=budget)


SCHEMES = {
    "plain": lambda spec: MemorySettings(),
    "chunked loss": lambda spec: MemorySettings(chunked_loss=True, loss_chunk_tokens=13),
    "tiled": lambda spec: MemorySettings(tiled_mlp=True, mlp_tile_tokens=10),
    "recompute": lambda spec: MemorySettings(recompute=True),
    "recompute + SCO": sco,
    "all at once": lambda spec: sco(spec).replace(chunked_loss=True, loss_chunk_tokens=13, tiled_mlp=True,
                                                  mlp_tile_tokens=10, indexer_query_chunk=7),
}
GLM5_ONLY = {
    "segmented KDA": lambda spec: MemorySettings(kda_segment_tokens=11, recompute=True),
    "sequence segments": lambda spec: MemorySettings(model_segment_tokens=11, chunked_loss=True,
                                                     loss_chunk_tokens=7, tiled_mlp=True, mlp_tile_tokens=9),
}
CASES = ([("glm5", k) for k in [*SCHEMES, *GLM5_ONLY]] + [("qwen3_moe", k) for k in SCHEMES]
         + [("gpt_oss", k) for k in SCHEMES])
SPECS = {"glm5": glm5_spec, "qwen3_moe": qwen3_moe_tiny,
         # gpt-oss: experts with biases and the clamped SwiGLU, sinks, a window shorter than the sequence
         "gpt_oss": lambda: gpt_oss_tiny().replace(sliding_window=5)}


def lora_step(model, memory: MemorySettings, ids, labels, doc_ids) -> torch.Tensor:
    """The trainer's backward (``train.step.train_step`` without the optimizer): one micro-batch, the loss
    a mean over the labelled tokens, sequence segments when the settings run them."""
    total = int((labels != -100).sum())
    if memory.model_segment_tokens:
        def seg_loss(hidden, lab):
            return loss_fn(memory)(hidden, model.lm_head.weight, lab, reduction="sum")

        return segmented_loss_backward(model, ids, labels, seg_loss, 1.0 / total, memory.model_segment_tokens,
                                       doc_ids=doc_ids) / total
    loss = loss_fn(memory)(model(ids, doc_ids=doc_ids), model.lm_head.weight, labels)
    loss.backward()
    return loss.detach()


_REFS: dict = {}


def reference(family: str, docs: bool):
    key = (family, docs)
    if key not in _REFS:
        spec = SPECS[family]()
        adapters = settings(trainable=TRAIN)
        model, _ = adapted_model(spec, adapters)
        _REFS[key] = merged_reference(spec, model, adapters, *batch(spec.vocab_size, docs))
    return _REFS[key]


@pytest.mark.parametrize("family, scheme", CASES, ids=[f"{f}-{s}" for f, s in CASES])
def test_adapter_grads_equal_the_merged_model(family: str, scheme: str) -> None:
    spec = SPECS[family]()
    memory = {**SCHEMES, **GLM5_ONLY}[scheme](spec)
    docs = scheme != "segmented KDA"  # segmented KDA runs rows without packed documents
    model, done = adapted_model(spec, settings(trainable=TRAIN), memory)
    assert len(done.adapters) > 0 and any(n.endswith("experts.gate_up_proj") for n in done.adapters)
    ref_loss, ref_grads = reference(family, docs)
    loss = lora_step(model, memory, *batch(spec.vocab_size, docs))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    assert_grads(model, ref_grads)


def test_no_optimizer_state_for_frozen_parameters() -> None:
    from megaseq.config import OptimConfig

    spec = qwen3_moe_tiny()
    model, _ = adapted_model(spec, settings(targets="q_proj,experts", trainable=TRAIN))
    lora_step(model, MemorySettings(), *batch(spec.vocab_size, True))
    for offload in (False, True):
        opt, _ = build_optimizer(model, OptimConfig(lr=1e-3), 10, MemorySettings(optimizer_offload=offload))
        held = {id(p) for g in opt.param_groups for p in g["params"]}
        assert held == {id(p) for p in trained(model).values()}
    opt, _ = build_optimizer(model, OptimConfig(lr=1e-3), 10, MemorySettings())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    assert {id(p) for p in opt.state} == {id(p) for p in trained(model).values()}
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) != p.requires_grad, n  # trained ones moved, frozen ones did not


def test_broken_scaling_fails(monkeypatch) -> None:
    """The adapters scaled by alpha instead of alpha / r."""
    spec = qwen3_moe_tiny()
    monkeypatch.setattr(type(settings().lora), "scaling", property(lambda c: c.alpha))
    model, _ = adapted_model(spec, settings(trainable=TRAIN))
    ref_loss, ref_grads = reference("qwen3_moe", True)
    lora_step(model, MemorySettings(), *batch(spec.vocab_size, True))
    with pytest.raises(AssertionError):
        assert_grads(model, ref_grads)


def test_broken_replay_dropping_adapters_fails(monkeypatch) -> None:
    """A replayed scheme (tiling) that leaves the adapters out of the parameters it differentiates."""
    real = replay.Replay.params
    monkeypatch.setattr(replay.Replay, "params",
                        lambda r: [p for p in real(r) if not (p.dim() == 3 and p.shape[1] == 3)])
    spec = qwen3_moe_tiny()
    memory = MemorySettings(tiled_mlp=True, mlp_tile_tokens=10)
    model, _ = adapted_model(spec, settings(trainable=TRAIN), memory)
    _, ref_grads = reference("qwen3_moe", True)
    lora_step(model, memory, *batch(spec.vocab_size, True))
    with pytest.raises(AssertionError, match="experts.lora_A"):
        assert_grads(model, ref_grads)


def test_targets_and_trainable_refusals() -> None:
    spec = glm5_spec()
    for targets, match in (("wk", "indexer"), ("lm_head", "lm_head"), ("qq_proj", "matches no projection"),
                           ("gate", "not a projection")):
        with pytest.raises(ValueError, match=match):
            adapted_model(spec, settings(targets=targets))
    with pytest.raises(ValueError, match="train.trainable"):
        adapted_model(spec, settings(trainable="layers.*.nothing"))
    with pytest.raises(ValueError, match="lora.dropout"):
        adapted_model(spec, settings(targets="experts", **{"lora.dropout": 0.1}))
    model, _ = adapted_model(spec, settings(rank=0, trainable="layers.0.*"))  # freezing without adapters
    assert all(n.startswith("layers.0.") and ".indexer." not in n for n in trained(model))
    assert not any(lora.is_adapter(n) for n, _ in model.named_parameters())

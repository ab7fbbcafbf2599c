"""LoRA under context parallelism: two gloo ranks, each holding half of every sequence (Ulysses for the
attention, KDA and gather-KV MLA mixers, Ring-DTP for the loss), give every adapter parameter the gradient
of the one-process merged model (float64, 1e-10) once the gradients are summed; frozen parameters get none.
With and without memory schemes on top (tiling, recompute, the chunked loss). glm5: glm5-flash-tiny's first 4
layers, every kind once (``conftest.glm5_tiny4``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.tensor  # noqa: F401  assert_close imports it lazily: once here, not in each fork

from conftest import glm5_tiny4
from lora_helpers import adapted_model, assert_grads, merged_reference, settings
from megaseq.config import MemorySettings, build_config
from megaseq.models.qwen3_moe.spec import qwen3_moe_tiny
from megaseq.parallel.env import DistributedEnv
from megaseq.parallel.launch import spawn_local
from megaseq.parallel.mesh import complete_batch

S = 32
TRAIN = "*.post_attention_layernorm.weight"
SPECS = {"glm5": lambda: glm5_tiny4().replace(index_topk=32), "qwen3_moe": qwen3_moe_tiny}
MEMORY = {"plain": MemorySettings(),
          "schemes": MemorySettings(tiled_mlp=True, mlp_tile_tokens=7, recompute=True, chunked_loss=True,
                                    loss_chunk_tokens=5)}


def global_batch(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(1, vocab, (2, S), generator=g)
    doc = torch.zeros(2, S, dtype=torch.long)
    doc[0, 13:] = 1  # a document boundary inside rank 0's shard, another across the shard boundary
    doc[1, 17:] = 1
    batch = complete_batch({"input_ids": ids, "doc_ids": doc})
    batch["labels"][0, 2:6] = -100  # ranks hold unequal numbers of labelled tokens
    return batch


def _rank(rank: int, family: str, memory: str, ref_grads: dict, reduce: bool = True) -> None:
    spec = SPECS[family]()
    cfg = build_config(overrides={"parallel.cp": 2, "parallel.backend": "gloo", "data.seq_len": S,
                                  "train.device": "cpu"})
    env = DistributedEnv(cfg, spec=spec)
    m = MEMORY[memory]
    model, done = adapted_model(spec, settings(trainable=TRAIN), m, env)
    batch = env.shard_batch(global_batch(spec.vocab_size) if env.reads_data else None)
    total = env.all_reduce_count(int((batch["labels"] != -100).sum()))
    hidden = model(batch["input_ids"], ctx=env.context(batch))
    chunk = m.loss_chunk_tokens if m.chunked_loss else None
    (env.loss_sum(hidden, model.lm_head.weight, batch["labels"], chunk) / total).backward()
    if reduce:
        env.reduce_gradients(model)
    assert_grads(model, ref_grads)
    env.shutdown()


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.mark.parametrize("family, memory", [("glm5", "plain"), ("glm5", "schemes"), ("qwen3_moe", "plain")])
def test_cp2_adapter_grads_equal_one_process(family: str, memory: str) -> None:
    spec = SPECS[family]()
    adapters = settings(trainable=TRAIN)
    model, _ = adapted_model(spec, adapters)
    b = global_batch(spec.vocab_size)
    _, ref_grads = merged_reference(spec, model, adapters, b["input_ids"], b["labels"], b["doc_ids"])
    spawn_local(_rank, 2, args=(family, memory, ref_grads))


def test_broken_unreduced_adapter_grads_fail() -> None:
    """Each rank's adapter gradients left unsummed (its own shard's part only)."""
    spec = SPECS["qwen3_moe"]()
    adapters = settings(trainable=TRAIN)
    model, _ = adapted_model(spec, adapters)
    b = global_batch(spec.vocab_size)
    _, ref_grads = merged_reference(spec, model, adapters, b["input_ids"], b["labels"], b["doc_ids"])
    with pytest.raises(Exception, match="lora"):
        spawn_local(_rank, 2, args=("qwen3_moe", "plain", ref_grads, False))

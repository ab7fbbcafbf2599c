"""The planner's communication formulas against the bytes a real context-parallel step sends.

One training step (forward + backward, Ring-DTP loss) of glm5-flash-tiny (KDA + DSA) and qwen3-moe-tiny
(GQA softmax attention) runs over cp gloo processes in float32; every collective of
``parallel.ulysses`` and every Ring-DTP hop adds the bytes that leave its rank to
``ulysses.COMM_BYTES`` (an all-to-all ``(P - 1) / P`` of its buffer, an all-gather its shard ``P - 1``
times, a reduce-scatter ``P - 1`` blocks, a send the whole tensor: the planner's definition). Each
layer's token mixer runs under ``comm_scope(kind)`` and the loss under ``comm_scope("loss")``, so the
trace splits by layer kind; it must equal ``plan.flops.comm_volume`` (and ``ring_dtp_volume``, and
Ring-DTP's own ``ring_dtp_bytes``) to the byte, with the precision of the run (float32: c = f = 4).

A second test checks the dtypes the bf16 formulas assume: under CPU bf16 autocast, the tensors the
KDA and softmax-attention blocks hand to the Ulysses hooks carry the bytes ``comm_volume`` counts
with its default (trainer) precision. (The DSA indexer's reference scoring cannot run under CPU
autocast, and CPU autocast keeps LayerNorm in bf16 where CUDA's keeps fp32, so DSA is checked in
float32 only.)
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass

import pytest
import torch

from megaseq.config import build_config
from megaseq.models.build import build_model
from megaseq.models.common.context import SeqContext
from megaseq.models.presets import get_preset
from megaseq.parallel import ulysses
from megaseq.parallel.env import DistributedEnv
from megaseq.parallel.launch import spawn_local
from megaseq.parallel.mesh import complete_batch
from megaseq.parallel.ring_dtp import ring_dtp_bytes
from megaseq.plan.flops import comm_volume, ring_dtp_volume
from megaseq.plan.mesh import Mesh as PlanMesh
from megaseq.plan.mesh import precision_for

FP32 = precision_for("fp32")


def global_batch(B: int, S: int) -> dict[str, torch.Tensor]:
    """Random tokens in documents that straddle the shard boundaries (so ``full_doc_ids`` gathers)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 16, (B, S), generator=g)
    doc = torch.zeros(B, S, dtype=torch.long)
    for b in range(B):
        for cut in torch.randint(5, S - 5, (3,), generator=g).tolist():
            doc[b, cut:] += 1
    return complete_batch({"input_ids": ids, "doc_ids": doc})


def scope_layers(model: torch.nn.Module, kinds: tuple[str, ...]) -> None:
    """Run each layer's token mixer (forward, and through autograd its backward) under its kind."""
    for layer, kind in zip(model.layers, kinds, strict=True):
        stack = ExitStack()
        mixer = getattr(layer, getattr(layer, "mixer_name", "self_attn"))  # Qwen3-Next's GDN: linear_attn
        mixer.register_forward_pre_hook(
            lambda m, a, k=kind, s=stack: s.enter_context(ulysses.comm_scope(k)))  # returns None
        mixer.register_forward_hook(lambda m, a, o, s=stack: s.close())


def traced(by_key: dict[tuple[str, str, str], int], scope: str, op: str | None = None,
           direction: str | None = None) -> int:
    return sum(v for (s, o, d), v in by_key.items()
               if s == scope and op in (None, o) and direction in (None, d))


def check_against_planner(by_key: dict, name: str, B: int, S: int, P: int, spec=None) -> None:
    """``spec``: the model's, where it is not the preset ``name``'s."""
    spec = spec or get_preset(name)
    mesh = PlanMesh(cp=P)
    vol = comm_volume(spec, S, mesh, batch=B, prec=FP32)
    n = B * S // P  # tokens per rank
    assert {s for s, _, _ in by_key} == set(spec.layer_types) | {"loss", "doc_ids"}  # nothing else moves
    for kind, v in vol.items():
        if kind == "dsa":  # the block implements gather-KV only (what mla_mode auto runs)
            assert traced(by_key, kind) == v["gather_kv_per_step"], kind
            assert traced(by_key, kind, "all_to_all") == 0
            # backward: only the latent's gradient is reduce-scattered (the indexer has no grad)
            latent = n * (P - 1) * (spec.kv_lora_rank + spec.qk_rope_head_dim) * 4 * v["layers"]
            assert traced(by_key, kind, "reduce_scatter", "bwd") == latent
        else:  # Ulysses: the backward all-to-alls move the gradients of exactly what went forward
            assert traced(by_key, kind) == v["ulysses"] * v["layers"], kind
            assert traced(by_key, kind, "all_to_all", "fwd") == traced(by_key, kind, "all_to_all", "bwd")
            assert traced(by_key, kind) == traced(by_key, kind, "all_to_all")
    loss = traced(by_key, "loss")
    assert loss == ring_dtp_volume(spec, S, mesh, B, FP32)
    assert loss == ring_dtp_bytes(n, spec.hidden_size, spec.vocab_size, P, 4, 4)["weight_rotating"]
    assert traced(by_key, "loss", "ring_weight", "fwd") == traced(by_key, "loss", "ring_weight", "bwd")
    assert traced(by_key, "doc_ids") == n * (P - 1) * 8  # int64 doc ids, gathered once per step


def _rank_step(rank: int, name: str, cp: int, B: int, S: int) -> None:
    torch.set_num_threads(1)
    spec = get_preset(name)
    cfg = build_config(overrides={"parallel.cp": cp, "parallel.backend": "gloo", "data.seq_len": S,
                                  "parallel.loss_parallel": "ring_dtp", "train.device": "cpu"})
    env = DistributedEnv(cfg, spec=spec)
    model = build_model(spec, dtype=torch.float32, seed=0)
    scope_layers(model, spec.layer_types)
    batch = env.shard_batch(global_batch(B, S) if env.reads_data else None)
    ulysses.reset_comm_bytes()
    hidden = model(batch["input_ids"], ctx=env.context(batch))
    with ulysses.comm_scope("loss"):
        loss = env.loss_sum(hidden, model.lm_head.weight, batch["labels"])
    loss.backward()
    by_key = ulysses.comm_bytes()
    env.shutdown()
    check_against_planner(by_key, name, B, S, cp)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.mark.parametrize("name, cp, B, S", [
    ("glm5-flash-tiny", 2, 2, 256),
    ("glm5-flash-tiny", 4, 1, 512),
    ("qwen3-moe-tiny", 2, 1, 512),  # 2 KV heads, cp 2: no repeat
    ("qwen3-moe-tiny", 4, 1, 256),  # cp 4 > 2 KV heads: each is sent twice
    ("deepseek-v3-tiny", 2, 1, 256),  # dense MLA through Ulysses
    ("qwen3-next-tiny", 2, 1, 256),  # gated DeltaNet (Hv = 2 Hk) and gated attention through Ulysses
])
def test_traced_bytes_equal_planner(name, cp, B, S):
    spawn_local(_rank_step, cp, args=(name, cp, B, S))


# ---- the bf16 formulas' dtypes ---------------------------------------------------------------
@dataclass
class RecordingContext(SeqContext):
    """One rank, identity hooks; sums the bytes per token each Ulysses hook is handed."""

    per_token: int = 0

    def _record(self, x: torch.Tensor) -> torch.Tensor:
        self.per_token += x.element_size() * x[0, 0].numel()  # [B, S, heads, *]: one token's bytes
        return x

    seq_to_heads = _record
    heads_to_seq = _record


@pytest.mark.parametrize("name, layer", [("glm5-flash-tiny", 0), ("qwen3-moe-tiny", 0), ("deepseek-v3-tiny", 0),
                                         ("kimi-linear-tiny", 3), ("qwen3-next-tiny", 0), ("qwen3-next-tiny", 3)])
def test_bf16_autocast_dtypes_match_the_default_precision(name, layer):
    """``comm_volume``'s default precision (fp32 parameters + bf16 autocast) counts the dtypes the
    blocks really hand to the collectives: KDA's fp32 g and bf16 q/k/v/beta/o; attention's q and k in
    fp32 after the qk RMSNorm (bf16 after Qwen3-Next's zero-centered one), v and o in bf16; dense MLA's
    fp32 q (after RoPE; bf16 in Kimi's NoPE MLA) and k, bf16 v and o; gated DeltaNet's fp32 decay."""
    torch.manual_seed(0)
    spec = get_preset(name)
    kind = spec.layer_types[layer]
    model = build_model(spec, dtype=torch.float32, seed=0)
    B, S, P = 1, 24, 2  # P only scales the formula: one rank's hooks see the same per-token tensors
    x = torch.randn(B, S, spec.hidden_size)
    ctx = RecordingContext(doc_ids=torch.zeros(B, S, dtype=torch.long))
    block = model.layers[layer]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        getattr(block, getattr(block, "mixer_name", "self_attn"))(x, ctx)
    if kind == "attention":  # cp = 2 splits the 2 KV heads unrepeated; the formula counts max(Hkv, P)
        assert spec.num_key_value_heads >= P
    vol = comm_volume(spec, S, PlanMesh(cp=P), batch=B)[kind]["ulysses"]
    assert vol == 2 * B * S / P * (P - 1) / P * ctx.per_token  # forward + the same backward

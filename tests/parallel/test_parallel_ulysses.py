"""Ulysses context parallelism over gloo: every token-mixing block, sharded over 2 and 4 processes,
matches the one-process float64 forward and backward (outputs, input gradients, parameter
gradients summed over the cp group), with documents that straddle shard boundaries.

Each rank builds the same seeded block, runs the one-process reference on the whole sequence and
the sharded forward on its own shard, and compares; a failure in any rank fails the test.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.distributed.tensor  # noqa: F401  assert_close imports it lazily: once here, not in each fork
from torch import nn

from megaseq.config import ParallelConfig
from megaseq.models.common.context import SeqContext, positions_from_doc_ids
from megaseq.models.presets import get_preset
from megaseq.parallel.grads import reduce_gradients
from megaseq.parallel.launch import spawn_local
from megaseq.parallel.mesh import init_mesh, shard_batch, shutdown
from megaseq.parallel.ulysses import make_context

TOL = dict(atol=1e-10, rtol=1e-9)


class ToyAttention(nn.Module):
    """GQA attention with a per-head gain (``head_slice``) and a per-head causal conv over the full
    sequence on q (the KDA-like step a wrong head split or shard boundary breaks); documents kept apart."""

    def __init__(self, H: int, Hq: int, Hkv: int, D: int, conv: int = 3) -> None:
        super().__init__()
        self.Hq, self.Hkv, self.D = Hq, Hkv, D
        self.wq, self.wk, self.wv = (nn.Linear(H, n * D, bias=False) for n in (Hq, Hkv, Hkv))
        self.wo = nn.Linear(Hq * D, H, bias=False)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, Hq))
        self.conv = nn.Parameter(torch.randn(Hq, conv) / conv)

    def forward(self, x: torch.Tensor, ctx: SeqContext) -> torch.Tensor:
        B, S_loc, _ = x.shape
        q = ctx.seq_to_heads(self.wq(x).view(B, S_loc, self.Hq, self.D))
        k = ctx.seq_to_heads(self.wk(x).view(B, S_loc, self.Hkv, self.D))
        v = ctx.seq_to_heads(self.wv(x).view(B, S_loc, self.Hkv, self.D))
        hs = ctx.head_slice(self.Hq)
        doc = ctx.full_doc_ids()
        S = q.shape[1]
        same = doc[:, :, None] == doc[:, None, :]  # [B, S, S]
        q = sum(self.conv[hs, j][None, None, :, None] * _shift(q, j, same) for j in range(self.conv.shape[1]))
        q = q * self.gain[hs][None, None, :, None]
        g = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        scores = torch.einsum("bshd,bthd->bhst", q, k) / math.sqrt(self.D)
        scores = scores.masked_fill(~(same & causal)[:, None], float("-inf"))
        o = torch.einsum("bhst,bthd->bshd", scores.softmax(-1), v)
        return self.wo(ctx.heads_to_seq(o).reshape(B, S_loc, self.Hq * self.D))


def _shift(q: torch.Tensor, j: int, same: torch.Tensor) -> torch.Tensor:
    """q[t - j] where token t - j is in t's document, else 0."""
    if j == 0:
        return q
    out = torch.zeros_like(q)
    out[:, j:] = q[:, :-j]
    keep = torch.diagonal(same, offset=-j, dim1=1, dim2=2)  # [B, S - j]: doc[t] == doc[t - j]
    out[:, j:] = out[:, j:] * keep[:, :, None, None]
    return out


def doc_layout(B: int, S: int, seed: int) -> torch.Tensor:
    """Packed documents of random lengths; some cross every shard boundary."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(B):
        lengths, total = [], 0
        while total < S:
            n = int(torch.randint(2, max(3, S // 2), (1,), generator=g))
            lengths.append(min(n, S - total))
            total += lengths[-1]
        rows.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)))
    return torch.stack(rows)


def block_parity(rank: int, make_block: Callable[[], nn.Module], dp: int, cp: int, B: int, S: int, H: int,
                 device: str = "cpu") -> None:
    """The sharded block vs the whole-sequence block on this rank (float64; gloo, or NCCL on cuda)."""
    torch.set_default_dtype(torch.float64)
    dev = torch.device(f"cuda:{rank}") if device == "cuda" else torch.device("cpu")
    backend = "nccl" if device == "cuda" else "gloo"
    mesh = init_mesh(ParallelConfig(dp=dp, cp=cp, backend=backend), S, device=dev)
    torch.manual_seed(0)
    block = make_block().double().to(dev)  # float32-declared parameters (KDA's A_log, dt_bias) too
    g = torch.Generator().manual_seed(1)
    x, cot = torch.randn(B, S, H, generator=g).to(dev), torch.randn(B, S, H, generator=g).to(dev)
    doc = doc_layout(B, S, seed=2).to(dev)
    # reference: one process, the whole sequence
    x_ref = x.clone().requires_grad_()
    out_ref = block(x_ref, SeqContext(doc_ids=doc, position_ids=positions_from_doc_ids(doc)))
    (out_ref * cot).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in block.named_parameters() if p.grad is not None}
    block.zero_grad(set_to_none=True)
    # sharded
    shard = shard_batch({"input_ids": torch.zeros(B, S, dtype=torch.long, device=dev), "doc_ids": doc}, mesh)
    ctx = make_context(mesh, shard)
    sl = slice(mesh.cp_rank * (S // cp), (mesh.cp_rank + 1) * (S // cp))
    x_loc = x[:, sl].clone().requires_grad_()
    out = block(x_loc, ctx)
    (out * cot[:, sl]).sum().backward()
    reduce_gradients(block, group=mesh.cp_group)
    torch.testing.assert_close(out, out_ref[:, sl], **TOL)
    torch.testing.assert_close(x_loc.grad, x_ref.grad[:, sl], **TOL)
    grads = {n: p.grad for n, p in block.named_parameters() if p.grad is not None}
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")
    shutdown(mesh)


# ---- the collectives on a toy block ------------------------------------------------------------
def _toy(H: int, Hq: int, Hkv: int, D: int) -> Callable[[], nn.Module]:
    return lambda: ToyAttention(H, Hq, Hkv, D)


@pytest.mark.parametrize("dp, cp, Hq, Hkv, S", [
    (1, 2, 6, 2, 14),  # 3 query heads per rank (odd), 1 KV head per rank
    (2, 2, 6, 6, 10),  # dp x cp on 4 ranks
    (1, 4, 4, 2, 20),  # cp > KV heads: each KV head replicated to 2 ranks
    (1, 4, 8, 1, 12),  # MQA on 4 ranks
])
def test_toy_attention_matches_one_process(dp, cp, Hq, Hkv, S):
    spawn_local(block_parity, dp * cp, args=(_toy(9, Hq, Hkv, 5), dp, cp, 2, S, 9))


# ---- the model's softmax attention block (GQA + RoPE) -----------------------------------------
def _attention(Hq: int, Hkv: int) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        from megaseq.models.common.attention import Attention

        spec = get_preset("qwen3-moe-tiny").replace(num_attention_heads=Hq, num_key_value_heads=Hkv,
                                                    head_dim=6, hidden_size=10)
        return Attention(spec)

    return make


@pytest.mark.parametrize("dp, cp, Hq, Hkv, S", [
    (1, 2, 6, 3, 14),  # cp does not divide the KV heads: the block repeats them
    (1, 4, 4, 2, 20),  # cp > KV heads
    (2, 2, 2, 1, 10),
])
def test_softmax_attention_matches_one_process(dp, cp, Hq, Hkv, S):
    spawn_local(block_parity, dp * cp, args=(_attention(Hq, Hkv), dp, cp, 2, S, 10))


# ---- KDA (conv + delta-rule recurrence per head over the whole sequence) ----------------------
def _kda(Hh: int, D: int) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        from megaseq.models.common.kda import KimiDeltaAttention, init_kda_

        spec = get_preset("glm5-flash-tiny").replace(linear_num_heads=Hh, linear_head_dim=D, hidden_size=10)
        block = KimiDeltaAttention(spec)
        init_kda_(block)
        with torch.no_grad():  # non-trivial per-head decay, so a head mix-up changes the numbers
            block.forget_gate.A_log.copy_(torch.linspace(-1.0, 0.5, Hh))
        return block

    return make


@pytest.mark.parametrize("dp, cp, Hh, S", [
    (1, 2, 6, 14),  # 3 heads per rank
    (1, 4, 4, 20),
    (2, 2, 2, 10),
])
def test_kda_matches_one_process(dp, cp, Hh, S):
    spawn_local(block_parity, dp * cp, args=(_kda(Hh, 6), dp, cp, 2, S, 10))

"""MLA + DSA under context parallelism (gather-KV) over gloo: the block (a full-indexer layer and a
layer sharing its selection) matches one process in float64, and the split indexer, where each rank
scores only its own queries against the whole sequence's pools, selects exactly the same keys."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.tensor  # noqa: F401  assert_close imports it lazily: once here, not in each fork
from test_parallel_ulysses import block_parity, doc_layout
from torch import nn

from megaseq.config import ParallelConfig
from megaseq.models.common.context import SeqContext, positions_from_doc_ids
from megaseq.models.presets import get_preset
from megaseq.parallel.launch import spawn_local
from megaseq.parallel.mesh import init_mesh, shard_batch, shutdown
from megaseq.parallel.ulysses import make_context


def _spec():
    # sparse at S = 24: 2 pools of 2 tokens + the query's own tail pool out of up to 12 pools
    return get_preset("glm5-flash-tiny").replace(
        hidden_size=10, num_attention_heads=3, q_lora_rank=8, kv_lora_rank=6, qk_nope_head_dim=5,
        v_head_dim=4, index_n_heads=3, index_head_dim=4, index_kpool=2, index_topk=4)


class FullThenShared(nn.Module):
    """A DSA layer with its own indexer followed by one reusing its selection (``indexer_types: shared``)."""

    def __init__(self) -> None:
        super().__init__()
        from megaseq.models.common.mla_dsa import MLASparseAttention

        self.full = MLASparseAttention(_spec(), layer_idx=0)
        self.shared = MLASparseAttention(_spec(), layer_idx=1, topk_source=0)
        with torch.no_grad():  # the zero-initialized pooling ape would hide a pool misalignment
            self.full.indexer.index_kpool_compress_ape.normal_()

    def forward(self, x: torch.Tensor, ctx: SeqContext) -> torch.Tensor:
        return self.shared(self.full(x, ctx), ctx)


@pytest.mark.parametrize("dp, cp", [(1, 2), (1, 4), (2, 2)])
def test_mla_dsa_matches_one_process(dp, cp):
    spawn_local(block_parity, dp * cp, args=(FullThenShared, dp, cp, 2, 24, 10))


def _indexer_worker(rank: int, cp: int, S: int) -> None:
    from megaseq.ops import dispatch
    from megaseq.ops.indexer import scoring as indexer_scoring

    torch.set_default_dtype(torch.float64)
    mesh = init_mesh(ParallelConfig(cp=cp, backend="gloo"), S)
    torch.manual_seed(0)
    layer = FullThenShared().full
    B, H = 2, 10
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(1))
    doc = doc_layout(B, S, seed=2)
    scored = []
    real = indexer_scoring.select_pools

    def counting(q_QID, *args, **kw):
        scored.append(q_QID.shape[0])
        return real(q_QID, *args, **kw)

    with torch.no_grad(), dispatch.override("indexer_topk", "torch_fp32", counting):
        q_resid = layer.q_a_layernorm(layer.q_a_proj(x))
        ref = layer.indexer(x, q_resid, SeqContext(doc_ids=doc, position_ids=positions_from_doc_ids(doc)))
        assert scored == [S] * B
        scored.clear()
        shard = shard_batch({"input_ids": torch.zeros(B, S, dtype=torch.long), "doc_ids": doc}, mesh)
        ctx = make_context(mesh, shard)
        sl = slice(mesh.cp_rank * (S // cp), (mesh.cp_rank + 1) * (S // cp))
        idx = layer.indexer(x[:, sl], q_resid[:, sl], ctx)
    assert scored == [S // cp] * B  # each rank scores its own queries only
    assert (ref >= 0).sum(-1).float().mean() < S / 2  # the selection is sparse
    assert torch.equal(idx, ref[:, sl])
    shutdown(mesh)


@pytest.mark.parametrize("cp", [2, 4])
def test_split_indexer_selects_the_same_keys(cp):
    spawn_local(_indexer_worker, cp, args=(cp, 24))

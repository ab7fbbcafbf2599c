"""Mixtral checkpoint keys: on disk ``model.layers.N.block_sparse_moe.{gate, experts.J.w1/w3/w2}``, in memory
``layers.N.mlp.{gate, experts.gate_up_proj/down_proj}`` (transformers' ``mixtral`` conversion mapping:
w1 the gate rows, w3 the up rows, w2 the down projection)."""

from __future__ import annotations

from megaseq.models.common.state_dict_adapter import StateDictAdapter


class MixtralAdapter(StateDictAdapter):
    renames = ((".block_sparse_moe.", ".mlp."),)
    expert_projs = ("w1", "w3", "w2")


ADAPTER = MixtralAdapter()

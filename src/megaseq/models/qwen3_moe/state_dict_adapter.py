"""Qwen3-MoE checkpoint keys: ``Qwen3MoeForCausalLM``'s names minus its ``model.`` prefix; experts per
expert on disk (fused in memory, as every MoE family: ``models.common.state_dict_adapter``)."""

from __future__ import annotations

from megaseq.models.common.state_dict_adapter import StateDictAdapter


class Qwen3MoeAdapter(StateDictAdapter):
    export_prefix = "model."


ADAPTER = Qwen3MoeAdapter()

"""OLMoE checkpoint keys: ``OlmoeForCausalLM``'s names minus ``model.``; experts per expert on disk."""

from __future__ import annotations

from megaseq.models.common.state_dict_adapter import StateDictAdapter

ADAPTER = StateDictAdapter()

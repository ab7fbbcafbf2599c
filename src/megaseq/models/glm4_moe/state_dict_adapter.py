"""GLM-4.5 checkpoint keys: ``Glm4MoeForCausalLM``'s names minus ``model.``; experts per expert on disk; the
MTP layer (``model.layers.{num_hidden_layers}``) skipped."""

from __future__ import annotations

from megaseq.models.common.state_dict_adapter import StateDictAdapter

ADAPTER = StateDictAdapter()

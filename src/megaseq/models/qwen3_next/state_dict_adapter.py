"""Qwen3-Next checkpoint keys: ``Qwen3NextForCausalLM``'s names minus ``model.``; experts per expert on disk;
the multi-token-prediction module (``mtp.*``) skipped (not modelled: see ``spec``)."""

from __future__ import annotations

from megaseq.models.common.state_dict_adapter import StateDictAdapter


class Qwen3NextAdapter(StateDictAdapter):
    def model_name(self, key: str, num_layers: int) -> str | None:
        if key.startswith("mtp."):
            return None
        return super().model_name(key, num_layers)


ADAPTER = Qwen3NextAdapter()

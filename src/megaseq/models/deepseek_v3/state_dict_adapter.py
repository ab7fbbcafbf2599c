"""DeepSeek-V3 checkpoint keys: ``DeepseekV3ForCausalLM``'s names minus ``model.``; experts per expert on
disk; the MTP module (``model.layers.{num_hidden_layers}``) skipped. FP8 checkpoints (``*.weight_scale_inv``
tensors beside float8 weights, as DeepSeek releases them) are refused by name: a float8 weight copied into a
bf16 parameter without its block scales would silently be a different model."""

from __future__ import annotations

from megaseq.models.common.state_dict_adapter import StateDictAdapter

FP8_FIX = ("dequantize it to bf16 first (DeepSeek's inference/fp8_cast_bf16.py, or a published bf16 copy), then "
           "point model.init_from at that directory")


class DeepseekAdapter(StateDictAdapter):
    def model_name(self, key: str, num_layers: int) -> str | None:
        if key.endswith("weight_scale_inv"):
            raise ValueError(f"checkpoint tensor {key}: an FP8 block-quantized checkpoint, which megaseq does not "
                             f"load; {FP8_FIX}")
        return super().model_name(key, num_layers)


ADAPTER = DeepseekAdapter()

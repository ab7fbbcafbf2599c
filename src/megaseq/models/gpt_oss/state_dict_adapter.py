"""gpt-oss checkpoint keys and layouts: transformers' ``GptOssForCausalLM`` on disk, megaseq's MoE in memory.

Shapes: E experts, H hidden, I expert intermediate, G = H / 32 (or I / 32) MXFP4 blocks of 32 values.

=====================================  ======================================  ===============================
on disk (``model.`` + ...)             in memory                               how
=====================================  ======================================  ===============================
``layers.N.mlp.router.{weight,bias}``  ``layers.N.mlp.gate.{weight,bias}``     renamed
``mlp.experts.gate_up_proj [E,H,2I]``  ``gate_up_proj [E, 2I, H]``             gate / up columns interleaved
                                                                               (even gate, odd up) -> gate rows
                                                                               first; transposed
``mlp.experts.gate_up_proj_bias``      ``gate_up_proj_bias [E, 2I]``           de-interleaved
``mlp.experts.down_proj [E, I, H]``    ``down_proj [E, H, I]``                 transposed
``*_proj_blocks`` + ``*_proj_scales``  ``gate_up_proj`` / ``down_proj``        MXFP4 dequantized (below)
=====================================  ======================================  ===============================

MXFP4 (the published checkpoints, ``quantization_config.quant_method: mxfp4``): ``X_blocks [E, R, G, 16]``
uint8 holds two FP4 (e2m1) codes a byte, the low nibble first; ``X_scales [E, R, G]`` uint8 an e8m0 exponent
(biased by 127) per block of 32 values; value = ``FP4[code] * 2 ** (scale - 127)``, rows ``R`` the output
features (``gate_up``'s interleaved, ``down``'s H), columns the input ones: transformers'
``integrations.mxfp4.convert_moe_packed_tensors`` (its transpose then gives HF's in-memory layout). The values
are exact in bf16 and float32. A checkpoint is read through ``reader(file)``, which returns every tensor in
megaseq's layout (``models.hf_io`` never knows the formats); a ``_scales`` key is read with its ``_blocks``
key, from the same file, and is neither loaded alone nor carried into an export. Export writes transformers'
bf16 layout (no ``_blocks``): ``from_pretrained`` of gpt-oss reads it as it is.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from megaseq.models.common.state_dict_adapter import StateDictAdapter

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_FIX = ("convert it with transformers (GptOssForCausalLM.from_pretrained(..., quantization_config="
             "Mxfp4Config(dequantize=True)) then save_pretrained) or keep each _blocks tensor beside its _scales")


def dequantize_mxfp4(blocks_ERG16: torch.Tensor, scales_ERG: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[E, R, G, 16]`` uint8 codes and ``[E, R, G]`` uint8 exponents -> ``[E, R, 32 G]`` in ``dtype``."""
    if blocks_ERG16.shape[:-1] != scales_ERG.shape or blocks_ERG16.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks_ERG16.shape)} and scales {tuple(scales_ERG.shape)} do not "
                         "match ([..., G, 16] codes for [..., G] scales)")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks_ERG16.device)
    codes = blocks_ERG16.to(torch.uint8)
    low, high = lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]
    values = torch.stack([low, high], dim=-1).flatten(-2)  # [E, R, G, 32]: low nibble first
    exponent = scales_ERG.to(torch.int32) - 127
    out = torch.ldexp(values, exponent.unsqueeze(-1).to(torch.float32))
    return out.flatten(-2).to(dtype)


def _gate_first(t: torch.Tensor) -> torch.Tensor:
    """Interleaved gate / up along the last dim (even gate, odd up) -> gate half first."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


def _interleaved(t: torch.Tensor) -> torch.Tensor:
    """The inverse of ``_gate_first``."""
    gate, up = t.chunk(2, dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2)


def to_memory(name: str, t: torch.Tensor) -> torch.Tensor:
    """A checkpoint tensor (HF bf16 layout) in megaseq's layout; rows (dim 0, the experts) stay in place."""
    if name.endswith(".experts.gate_up_proj"):
        return _gate_first(t).transpose(1, 2)
    if name.endswith(".experts.gate_up_proj_bias"):
        return _gate_first(t)
    if name.endswith(".experts.down_proj"):
        return t.transpose(1, 2)
    return t


def _memory_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
        return (shape[0], shape[2], shape[1])
    return shape


class _Slice:
    """``get_slice`` of one tensor in megaseq's layout: its shape, and its rows ``[a:b]``."""

    def __init__(self, reader: _Reader, key: str) -> None:
        self.reader, self.key = reader, key

    def get_shape(self) -> list[int]:
        return list(self.reader.shape(self.key))

    def __getitem__(self, rows: slice) -> torch.Tensor:
        return self.reader.read(self.key, rows)


class _Reader:
    """A safetensors file seen in megaseq's layout (``get_tensor``, ``get_slice``, ``keys``)."""

    def __init__(self, f: Any) -> None:
        self.f = f

    def keys(self) -> Any:
        return self.f.keys()

    def _scales_key(self, key: str) -> str:
        scales = key.removesuffix("_blocks") + "_scales"
        if scales not in set(self.f.keys()):
            raise ValueError(f"checkpoint tensor {key} (MXFP4) has no {scales} in the same file; {MXFP4_FIX}")
        return scales

    def shape(self, key: str) -> tuple[int, ...]:
        shape = tuple(self.f.get_slice(key).get_shape())
        if key.endswith("_blocks"):
            return (*shape[:-2], shape[-2] * shape[-1] * 2)
        return _memory_shape(key, shape)

    def read(self, key: str, rows: slice = slice(None)) -> torch.Tensor:
        if key.endswith("_blocks"):
            blocks = self.f.get_slice(key)[rows]
            scales = self.f.get_slice(self._scales_key(key))[rows]
            t = dequantize_mxfp4(blocks, scales)
            return _gate_first(t.transpose(1, 2)).transpose(1, 2) if "gate_up_proj" in key else t
        return to_memory(key, self.f.get_slice(key)[rows])

    def get_tensor(self, key: str) -> torch.Tensor:
        return self.read(key)

    def get_slice(self, key: str) -> _Slice:
        return _Slice(self, key)


class GptOssAdapter(StateDictAdapter):
    export_prefix = "model."
    renames = ((".mlp.router.", ".mlp.gate."),)
    peft_experts = False  # HF's experts are [E, in, out] with gate / up interleaved: PEFT's factors differ

    def reader(self, f: Any) -> _Reader:
        return _Reader(f)

    def model_name(self, key: str, num_layers: int) -> str | None:
        if key.endswith("_scales"):
            return None  # read with its _blocks key
        return super().model_name(key.removesuffix("_blocks"), num_layers)

    def carried(self, key: str, num_layers: int) -> bool:
        return not key.endswith("_scales") and super().carried(key, num_layers)

    def split(self, name: str, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """megaseq's layout -> transformers' (``to_memory``'s inverse)."""
        if name.endswith(".experts.gate_up_proj"):
            yield name, _interleaved(t.transpose(1, 2))
        elif name.endswith(".experts.gate_up_proj_bias"):
            yield name, _interleaved(t)
        elif name.endswith(".experts.down_proj"):
            yield name, t.transpose(1, 2)
        else:
            yield name, t


ADAPTER = GptOssAdapter()

"""The pre-norm decoder layer most families share: ``h + mixer(norm(h))``, then ``h + mlp(norm(h))``.

Shapes: B batch, S tokens (this rank's shard), H hidden; ``h [B, S, H]`` is the layer boundary (and the
checkpoint boundary: a plain residual stream, ``hc_mult = 1``).

The token mixer is given (softmax attention, MLA, KDA, gated DeltaNet) under the name its family's HF
layer uses (``self_attn``; Qwen3-Next's linear layers ``linear_attn``); ``mlp`` is a MoE or a dense
SwiGLU as ``spec.mlp_types`` says, the norms ``input_layernorm`` / ``post_attention_layernorm`` (zero-centered
for Qwen3-Next). Everything but the mixer is token-separable, so ``memory.tiling`` may tile ``mlp`` from
outside (a family's ``parallelize``).
"""

from __future__ import annotations

import torch
from torch import nn

from megaseq.models.common.context import SeqContext
from megaseq.models.common.mlp import MLP
from megaseq.models.common.moe import MoE
from megaseq.models.common.norm import make_norm
from megaseq.models.spec import ModelSpec


class PreNormDecoderLayer(nn.Module):
    """One layer; ``mixer`` is registered as ``mixer_name`` and called ``mixer(x [B, S, H], ctx)``."""

    def __init__(self, spec: ModelSpec, index: int, mixer: nn.Module, mixer_name: str = "self_attn") -> None:
        super().__init__()
        name = f"layers.{index}"
        self.layer_type = spec.layer_types[index]
        self.mixer_name = mixer_name
        setattr(self, mixer_name, mixer)
        if spec.mlp_types[index] == "moe":
            self.mlp: nn.Module = MoE(spec, layer=f"{name}.mlp")
        else:
            self.mlp = MLP(spec.hidden_size, spec.intermediate_size, spec.swiglu_limit, layer=f"{name}.mlp")
        eps, zc = spec.rms_norm_eps, spec.norm_zero_centered
        self.input_layernorm = make_norm(spec.hidden_size, eps, zc)
        self.post_attention_layernorm = make_norm(spec.hidden_size, eps, zc)

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self.mixer_name)

    def forward(self, h_BSH: torch.Tensor, ctx: SeqContext) -> torch.Tensor:
        h_BSH = h_BSH + self.mixer(self.input_layernorm(h_BSH), ctx)
        return h_BSH + self.mlp(self.post_attention_layernorm(h_BSH))

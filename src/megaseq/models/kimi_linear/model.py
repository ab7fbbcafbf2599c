"""Kimi-Linear as a megaseq CausalLM: pre-norm layers of KDA or NoPE MLA + dense or MoE MLP.

Module names mirror ``KimiLinearForCausalLM`` in memory minus ``model.`` (``layers.N.self_attn.conv1d``,
``layers.N.self_attn.forget_gate.A_log`` of HF's shape ``[1, 1, Hh, 1]``, ``layers.N.mlp.experts``); on disk the
conv is three tensors and the MoE ``block_sparse_moe`` with ``w1/w3/w2`` experts (``state_dict_adapter``).
KDA and MLA go context-parallel through Ulysses; the rest is token-separable.
"""

from __future__ import annotations

import torch
from torch import nn

from megaseq.models.common.decoder import CausalLM
from megaseq.models.common.kda import KimiDeltaAttention
from megaseq.models.common.mla import MultiLatentAttention
from megaseq.models.common.moe import FP32_PARAM_SUFFIXES as MOE_FP32_SUFFIXES
from megaseq.models.common.prenorm import PreNormDecoderLayer
from megaseq.models.spec import ModelSpec

# HF's _keep_in_fp32_modules_strict: the router and its bias, the KDA forget gate's dt_bias
FP32_PARAM_SUFFIXES = MOE_FP32_SUFFIXES + ("forget_gate.dt_bias",)


def _mixer(spec: ModelSpec, i: int) -> nn.Module:
    name = f"layers.{i}.self_attn"
    if spec.layer_types[i] == "mla":
        return MultiLatentAttention(spec, name, latent_norm_eps=1e-6)
    kda = KimiDeltaAttention(spec, layer=name)
    fg = kda.forget_gate  # Kimi-Linear keeps A_log as [1, 1, Hh, 1] (GLM-5: [Hh]); the forward reshapes either
    fg.A_log = nn.Parameter(torch.zeros(1, 1, spec.linear_num_heads, 1, dtype=torch.float32))
    return kda


class KimiLinearModel(CausalLM):
    """The CausalLM interface of docs/architecture.md for the ``kimi_linear`` family."""

    def __init__(self, spec: ModelSpec) -> None:
        if spec.family != "kimi_linear" or not set(spec.layer_types) <= {"kda", "mla"} or spec.hc_mult != 1:
            raise ValueError(f"KimiLinearModel needs a kimi_linear spec of kda / mla layers, got {spec.family!r} "
                             f"{sorted(set(spec.layer_types))}")
        super().__init__(spec, lambda i: PreNormDecoderLayer(spec, i, _mixer(spec, i)))


Model = KimiLinearModel

"""Kimi-Linear checkpoint keys: transformers' ``kimi_linear`` conversion mapping.

On disk the KDA forget gate's tensors sit directly under ``self_attn`` (``f_a_proj``, ``f_b_proj``,
``dt_bias``, ``A_log``), the conv is ``q/k/v_conv1d.weight`` (one ``conv1d.weight`` in memory, channels
``[q | k | v]``), the MoE is ``block_sparse_moe`` with per-expert ``w1`` / ``w3`` / ``w2``.
"""

from __future__ import annotations

import re

from megaseq.models.common.state_dict_adapter import StateDictAdapter


class KimiLinearAdapter(StateDictAdapter):
    renames = (
        ("self_attn.f_a_proj.", "self_attn.forget_gate.f_a_proj."),
        ("self_attn.f_b_proj.", "self_attn.forget_gate.f_b_proj."),
        ("self_attn.dt_bias", "self_attn.forget_gate.dt_bias"),
        ("self_attn.A_log", "self_attn.forget_gate.A_log"),
        (".block_sparse_moe.", ".mlp."),
    )
    expert_projs = ("w1", "w3", "w2")
    part_fusions = ((re.compile(r"^(?P<base>.+\.self_attn)\.(?P<part>[qkv])_conv1d\.weight$"), "conv1d.weight", "qkv"),)


ADAPTER = KimiLinearAdapter()

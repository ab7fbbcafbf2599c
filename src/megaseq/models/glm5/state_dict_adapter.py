"""GLM-5.3-Flash checkpoint keys: transformers' ``glm5_next`` conversion mapping.

On disk the KDA forget gate's tensors sit directly under ``self_attn`` and the hyper-connections are
``hc_attn_fn`` / ``hc_ffn_*``; in memory they are ``self_attn.forget_gate.*`` and ``attn_hc.*`` /
``ffn_hc.*``. The KDA conv is three tensors on disk (``q/k/v_conv1d.weight``) and one in memory
(``conv1d.weight``, channels ``[q | k | v]``).

Export layout: transformers has no text-only causal LM for ``glm5_next`` (``glm5_next_text`` maps to
``Glm5NextTextModel``, which has no ``lm_head``), so the export is the multimodal ``glm5_next`` layout
(``model.language_model.*`` keys and ``lm_head.weight``, with the tiny ``vision_config`` of ``spec.to_hf``).
transformers loads it with the vision tower freshly initialised (a missing-keys warning for
``model.visual.*``); on text input that tower never runs, so hidden states and logits equal megaseq's.
That is also the layout of the released GLM-5.3-Flash checkpoints.
"""

from __future__ import annotations

import re

from megaseq.models.common.state_dict_adapter import StateDictAdapter


class Glm5Adapter(StateDictAdapter):
    export_prefix = "model.language_model."
    renames = (
        ("self_attn.f_a_proj.", "self_attn.forget_gate.f_a_proj."),
        ("self_attn.f_b_proj.", "self_attn.forget_gate.f_b_proj."),
        ("self_attn.dt_bias", "self_attn.forget_gate.dt_bias"),
        ("self_attn.A_log", "self_attn.forget_gate.A_log"),
        ("hc_attn_fn", "attn_hc.fn"), ("hc_attn_base", "attn_hc.base"), ("hc_attn_scale", "attn_hc.scale"),
        ("hc_ffn_fn", "ffn_hc.fn"), ("hc_ffn_base", "ffn_hc.base"), ("hc_ffn_scale", "ffn_hc.scale"),
    )
    part_fusions = ((re.compile(r"^(?P<base>.+\.self_attn)\.(?P<part>[qkv])_conv1d\.weight$"), "conv1d.weight", "qkv"),)


ADAPTER = Glm5Adapter()

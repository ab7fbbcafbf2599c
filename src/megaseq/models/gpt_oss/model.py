"""gpt-oss as a megaseq CausalLM: pre-norm layers of GQA attention with sinks (sliding-window or full, as
``spec.sliding_layers`` says) and a MoE with a biased top-k-softmax router and biased clamped-SwiGLU experts.

Shapes: B batch, S tokens (this rank's shard), H hidden; ``h [B, S, H]`` is every layer boundary.

Module names mirror ``GptOssForCausalLM`` minus ``model.`` (``layers.N.self_attn.{q,k,v,o}_proj``,
``layers.N.self_attn.sinks``, ``norm``, ``lm_head``) except the router, which megaseq's MoE calls ``gate``
(``layers.N.mlp.gate.{weight, bias}``; HF ``mlp.router``) and the experts, kept in megaseq's layout
(``gate_up_proj [E, 2I, H]`` gate rows first, ``down_proj [E, H, I]``; HF ``[E, H, 2I]`` with gate and up
interleaved, ``[E, I, H]``): ``state_dict_adapter`` maps both ways.

Parallel axes: the attention is the only token mixer and goes context-parallel through the ``SeqContext``
hooks (each rank's heads take their sinks, ``ctx.head_slice``); norms and the MoE are token-separable.
bf16: transformers keeps the norms' weights in float32 and multiplies before rounding; megaseq's RMSNorm
rounds the normalised value first (one bf16 rounding apart); float64 is the same computation.
"""

from __future__ import annotations

from megaseq.models.common.decoder import CausalLM
from megaseq.models.common.prenorm import PreNormDecoderLayer
from megaseq.models.common.sink_attention import SinkAttention
from megaseq.models.spec import ModelSpec

FP32_PARAM_SUFFIXES: tuple[str, ...] = ()  # HF's gpt-oss router runs in the model's dtype


class GptOssModel(CausalLM):
    """The CausalLM interface of docs/architecture.md for the ``gpt_oss`` family."""

    def __init__(self, spec: ModelSpec) -> None:
        if spec.family != "gpt_oss" or set(spec.layer_types) != {"attention"} or spec.hc_mult != 1:
            raise ValueError(f"GptOssModel needs a gpt_oss spec of attention layers, got {spec.family!r} "
                             f"{sorted(set(spec.layer_types))}")
        if "dense" in spec.mlp_types or spec.router != "topk_softmax":
            raise ValueError("gpt_oss layers are all MoE with the 'topk_softmax' router")
        super().__init__(spec, lambda i: PreNormDecoderLayer(spec, i, SinkAttention(spec, i, f"layers.{i}.self_attn")))


Model = GptOssModel

"""GLM-5.3-Flash (HF ``glm5_next``, text part ``Glm5NextTextModel``) assembled from megaseq blocks.

Shapes: B batch, S tokens (this rank's shard under context parallelism), N = hc_mult streams,
H hidden, V vocab.

    ids --embed_tokens--> [B, S, H] --N copies--> h [B, S, N, H]
    per layer:  attn_hc -> input_layernorm -> KDA or MLA/DSA -> merge
                ffn_hc  -> post_attention_layernorm -> dense SwiGLU or MoE -> merge
    mean over streams -> norm -> hidden [B, S, H]; lm_head -> logits [B, S, V]

Module names mirror the HF text model (``embed_tokens``, ``layers.N.self_attn...``, ``norm``) plus
``lm_head``, so a ``Glm5NextTextModel`` state dict loads 1:1 (``lm_head`` comes from the CausalLM
wrapper). The layer input ``h`` (N x hidden) is the checkpoint boundary. ``ctx.carry`` passes a full
DSA layer's selection to the ``shared`` layers after it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from megaseq.memory.tiling import collect_summed, restore_side_state, set_summed, snapshot_side_state
from megaseq.models.blocks.kda import GatedRMSNorm, KimiDeltaAttention, init_kda_
from megaseq.models.blocks.mhc import HyperConnection, collapse_streams, expand_streams
from megaseq.models.blocks.mla_dsa import Indexer, MLASparseAttention
from megaseq.models.blocks.mlp import MLP
from megaseq.models.blocks.moe import FP32_PARAM_SUFFIXES as MOE_FP32_SUFFIXES
from megaseq.models.blocks.moe import Experts, MoE, TopKRouter
from megaseq.models.blocks.norm import RMSNorm
from megaseq.models.context import SeqContext, positions_from_doc_ids
from megaseq.models.spec import ModelSpec
from megaseq.ops.amp import autocast_as, autocast_state

# tensors HF keeps in float32 in a bf16 model (``_keep_in_fp32_modules_strict``), by name suffix
FP32_PARAM_SUFFIXES = MOE_FP32_SUFFIXES + (
    "conv1d.weight", "forget_gate.dt_bias", "forget_gate.A_log",
    "attn_hc.base", "attn_hc.scale", "ffn_hc.base", "ffn_hc.scale",
)
INIT_STD = 0.02  # HF's initializer_range default


def _topk_sources(spec: ModelSpec) -> list[int | None]:
    """Per layer: None for a full-indexer DSA layer (or a non-DSA layer), else the layer it reuses."""
    sources: list[int | None] = []
    last_full = None
    for i, kind in enumerate(spec.layer_types):
        shared = kind == "dsa" and spec.indexer_types[i] == "shared"
        sources.append(last_full if shared else None)
        if kind == "dsa" and not shared:
            last_full = i
    return sources


# ---- token tiling with recompute: several inputs and outputs, all [T, ...] token-major ---------------
TileFn = Callable[..., tuple[torch.Tensor, ...]]


def _run_tiles(fn: TileFn, modules, tile: int, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """All tiles without a graph into preallocated outputs; per-forward counts summed over the tiles."""
    N, outs, totals = inputs[0].shape[0], None, {}
    for a in range(0, N, tile):
        ys = fn(*(x[a:a + tile] for x in inputs))
        if outs is None:
            outs = tuple(y.new_empty((N,) + tuple(y.shape[1:])) for y in ys)
        for o, y in zip(outs, ys):
            o[a:a + tile] = y
        del ys
        for mod in modules:  # this tile's per-forward counts (MoE.last_tokens_per_expert)
            collect_summed(mod, totals)
    set_summed(totals)
    assert outs is not None, "token tiling needs at least one token"
    return outs


class _TokenTiledFn(torch.autograd.Function):
    """Forward: the tiles without a graph, saving the inputs. Backward: each tile again (same autocast
    as the forward) and its gradients; parameter gradients summed over the tiles."""

    @staticmethod
    def forward(actx, fn, modules, tile, num_inputs, *args):
        inputs = args[:num_inputs]
        actx.fn, actx.modules, actx.tile, actx.num_inputs = fn, modules, tile, num_inputs
        actx.autocast = autocast_state()
        actx.save_for_backward(*inputs)
        return _run_tiles(fn, modules, tile, inputs)

    @staticmethod
    def backward(actx, *grad_outs):
        inputs = actx.saved_tensors
        need_x = actx.needs_input_grad[4:4 + actx.num_inputs]
        params = [p for m in actx.modules for p in m.parameters()]
        need_p = actx.needs_input_grad[4 + actx.num_inputs:]
        assert len(params) == len(need_p), "the tiled modules' parameters changed since the forward"
        grad_x = [torch.zeros_like(x) if need else None for x, need in zip(inputs, need_x)]
        grad_p: list[torch.Tensor | None] = [None] * len(params)
        snaps = [snapshot_side_state(m) for m in actx.modules]
        for a in range(0, inputs[0].shape[0], actx.tile):
            xs = [x[a:a + actx.tile].detach().requires_grad_(need) for x, need in zip(inputs, need_x)]
            with torch.enable_grad(), autocast_as(actx.autocast):
                ys = actx.fn(*xs)
            wrt = [x for x, need in zip(xs, need_x) if need] + [p for p, need in zip(params, need_p) if need]
            pairs = [(y, g[a:a + actx.tile]) for y, g in zip(ys, grad_outs) if y.requires_grad]
            grads = iter(torch.autograd.grad([y for y, _ in pairs], wrt, [g for _, g in pairs],
                                             allow_unused=True))
            del ys, pairs
            for i, need in enumerate(need_x):
                g = next(grads) if need else None
                if g is not None:
                    grad_x[i][a:a + actx.tile] = g
            for i, need in enumerate(need_p):
                g = next(grads) if need else None
                if g is not None:
                    grad_p[i] = g.clone() if grad_p[i] is None else grad_p[i].add_(g)
        for snap in snaps:
            restore_side_state(snap)
        return (None, None, None, None, *grad_x, *grad_p)


def token_tiled(fn: TileFn, modules: Sequence[nn.Module], tile: int,
                *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``fn(*inputs)`` for a token-separable ``fn`` (row i of every output depends on row i of the
    inputs only), over tiles of ``tile`` rows; ``modules`` hold every parameter ``fn`` uses. With a graph
    to build, only the inputs are saved and each tile is recomputed in backward."""
    params = [p for m in modules for p in m.parameters()]
    if torch.is_grad_enabled() and any(t.requires_grad for t in (*inputs, *params)):
        return _TokenTiledFn.apply(fn, tuple(modules), tile, len(inputs), *inputs, *params)
    return _run_tiles(fn, modules, tile, inputs)


class Glm5DecoderLayer(nn.Module):
    """One GLM-5.3-Flash layer over the N-stream residual ``h [B, S, N, H] -> [B, S, N, H]``.

    ``token_tile`` (None: off) runs the token-separable parts over tiles of that many tokens, with
    recompute in backward (``token_tiled``): ``attn_hc`` + ``input_layernorm`` before the token mixer,
    and the residual merge + ``ffn_hc`` + ``post_attention_layernorm`` + MLP/MoE + merge after it. Only
    the token mixer (KDA or DSA) then sees the whole sequence; the layer saves its input ``h``, the mixer's
    input and output and the small mHC weights instead of every ``[S, N * H]`` fp32 temporary of the
    mHC maps and the MLP's activations. The memory plan sets it from outside (exact: same result).
    """

    def __init__(self, spec: ModelSpec, layer_idx: int, topk_source: int | None = None) -> None:
        super().__init__()
        name = f"layers.{layer_idx}"
        self.layer_type = spec.layer_types[layer_idx]
        self.token_tile: int | None = None
        self.attn_hc = HyperConnection(spec)
        self.input_layernorm = RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        if self.layer_type == "kda":
            self.self_attn = KimiDeltaAttention(spec, layer=f"{name}.self_attn")
        elif self.layer_type == "dsa":
            self.self_attn = MLASparseAttention(spec, layer_idx, topk_source, layer=f"{name}.self_attn")
        else:
            raise ValueError(f"glm5_next layer {layer_idx}: layer type {self.layer_type!r} is not kda or dsa")
        self.ffn_hc = HyperConnection(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        if spec.mlp_types[layer_idx] == "moe":
            self.mlp = MoE(spec, layer=f"{name}.mlp")
        else:
            self.mlp = MLP(spec.hidden_size, spec.intermediate_size, spec.swiglu_limit)

    def forward(self, h_BSNH: torch.Tensor, ctx: SeqContext) -> torch.Tensor:
        if self.token_tile is not None:
            return self._forward_tiled(h_BSNH, ctx, int(self.token_tile))
        post, comb, x = self.attn_hc(h_BSNH)
        y = self.self_attn(self.input_layernorm(x), ctx)
        h_BSNH = self.attn_hc.merge(post, comb, y, h_BSNH)
        post, comb, x = self.ffn_hc(h_BSNH)
        y = self.mlp(self.post_attention_layernorm(x))
        return self.ffn_hc.merge(post, comb, y, h_BSNH)

    # ---- token tiling: the same computation, token-separable parts tile by tile --------------------
    def _mixer_input(self, h_TNH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        post, comb, x = self.attn_hc(h_TNH.unsqueeze(0))
        return post[0], comb[0], self.input_layernorm(x[0])

    def _ffn_block(self, post_TN, comb_TNN, y_TH, h_TNH) -> torch.Tensor:
        h_TNH = self.attn_hc.merge(post_TN, comb_TNN, y_TH, h_TNH)
        post, comb, x = self.ffn_hc(h_TNH.unsqueeze(0))
        y = self.mlp(self.post_attention_layernorm(x[0]))
        return self.ffn_hc.merge(post[0], comb[0], y, h_TNH)

    def _forward_tiled(self, h_BSNH: torch.Tensor, ctx: SeqContext, tile: int) -> torch.Tensor:
        if tile < 1:
            raise ValueError(f"token_tile must be >= 1 tokens, got {tile}")
        B, S, N, H = h_BSNH.shape
        h_TNH = h_BSNH.reshape(B * S, N, H)
        post, comb, x = token_tiled(self._mixer_input, (self.attn_hc, self.input_layernorm), tile, h_TNH)
        y = self.self_attn(x.view(B, S, H), ctx)
        mods = (self.ffn_hc, self.post_attention_layernorm, self.mlp)
        (out,) = token_tiled(lambda *a: (self._ffn_block(*a),), mods, tile, post, comb, y.reshape(B * S, H),
                             h_TNH)
        return out.view(B, S, N, H)


class Glm5Model(nn.Module):
    """GLM-5.3-Flash CausalLM (see docs/architecture.md for the interface)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        if spec.family != "glm5_next":
            raise ValueError(f"Glm5Model needs a glm5_next spec, got family {spec.family!r}")
        self.spec = spec
        pad = spec.pad_token_id
        pad = pad if pad is not None and 0 <= pad < spec.vocab_size else None  # presets may name no real row
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, padding_idx=pad)
        sources = _topk_sources(spec)
        self.layers = nn.ModuleList(Glm5DecoderLayer(spec, i, sources[i]) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.reset_parameters()

    # ---- the CausalLM interface ------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[B, S]`` ids -> the initial streams ``[B, S, N, H]``."""
        return expand_streams(self.embed_tokens(input_ids), self.spec.hc_mult)

    def final_hidden(self, h_BSNH: torch.Tensor) -> torch.Tensor:
        """Stream mean + final RMSNorm -> ``[B, S, H]``."""
        return self.norm(collapse_streams(h_BSNH))

    def forward(self, input_ids: torch.Tensor, doc_ids: torch.Tensor | None = None,
                ctx: SeqContext | None = None) -> torch.Tensor:
        """Final hidden states ``[B, S, H]``; ``doc_ids [B, S]`` keeps packed documents apart."""
        if ctx is None:
            pos = None if doc_ids is None else positions_from_doc_ids(doc_ids)
            ctx = SeqContext(doc_ids=doc_ids, position_ids=pos)
        elif doc_ids is not None and ctx.doc_ids is None:
            raise ValueError("with a ctx, pass doc_ids inside it (ctx.doc_ids), not to the model")
        ctx.carry.pop("topk", None)
        ctx.carry.pop("topk_layer", None)
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h, ctx)
        return self.final_hidden(h)

    def logits(self, hidden_BSH: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_BSH)

    # ---- initialisation (HF ``Glm5NextPreTrainedModel._init_weights``) ----------------------------
    @torch.no_grad()
    def reset_parameters(self, std: float = INIT_STD) -> None:
        """Normal(0, std) for linears, conv, embeddings, router and experts; ones for norms; GLM's
        special tensors (hc fn/base/scale, indexer pooling, A_log, dt_bias). Uses the global RNG."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Conv1d)):
                module.weight.normal_(0.0, std)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, std)
                if module.padding_idx is not None:
                    module.weight[module.padding_idx].zero_()
            elif isinstance(module, (RMSNorm, GatedRMSNorm, nn.LayerNorm)):
                module.weight.fill_(1.0)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, HyperConnection):
                module.fn.normal_(0.0, 0.02)  # HF uses 0.02 here whatever initializer_range is
                module.base.zero_()
                module.scale.fill_(1.0)
            elif isinstance(module, Experts):
                module.gate_up_proj.normal_(0.0, std)
                module.down_proj.normal_(0.0, std)
            elif isinstance(module, TopKRouter):
                module.weight.normal_(0.0, std)
                if hasattr(module, "e_score_correction_bias"):
                    module.e_score_correction_bias.zero_()
            elif isinstance(module, Indexer):
                module.index_kpool_compress_ape.zero_()
                module.index_kpool_compress_gate.fill_(1.0)
            elif isinstance(module, KimiDeltaAttention):
                init_kda_(module)

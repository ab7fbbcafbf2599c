"""``CausalLM``: the decoder every family shares (embedding, the layer loop, final norm, head, tying, init).

Shapes: B batch, S tokens (this rank's shard under context parallelism), H hidden, V vocabulary; ``h`` is a
layer boundary (``[B, S, H]``, or ``[B, S, N, H]`` for a family with N hyper-connection streams).

    ids --embed--> h --layers[0..L)--> h --final_hidden--> hidden [B, S, H] --logits--> [B, S, V]

The interface every scheme is written against (docs/architecture.md): ``embed(ids)``, ``layers`` (a
ModuleList of ``layer(h, ctx)``), ``final_hidden(h)``, ``forward(ids, doc_ids, ctx)`` (all of them) and
``lm_head.weight`` (the chunked and ring losses use it directly). A family supplies only its layer
(``make_layer``) and, when its residual stream is not one hidden state wide, ``embed`` / ``final_hidden``.
Module names mirror the Hugging Face text model (``embed_tokens``, ``layers.N...``, ``norm``, ``lm_head``),
so the state-dict adapter is a prefix map plus fusions.

Initialisation is Hugging Face's ``_init_weights``: one walk over ``self.modules()`` in order, the generic
rules below for linears, convolutions, embeddings and norms, and a block's own ``init_weights(std)`` for
the tensors only it knows (router, experts, hyper-connections, indexer pooling, KDA decay). The walk order
fixes the random draws, so a seed gives the same weights as before the blocks moved here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from megaseq.models.common.context import SeqContext, positions_from_doc_ids
from megaseq.models.common.kda import GatedRMSNorm
from megaseq.models.common.norm import RMSNorm, ZeroCenteredRMSNorm, make_norm
from megaseq.models.spec import ModelSpec

INIT_STD = 0.02  # HF's initializer_range default


# the module types ``init_module`` initialises by type; it writes their ``weight`` and ``bias`` whole
INIT_LINEAR = (nn.Linear, nn.Conv1d)
INIT_NORM = (RMSNorm, GatedRMSNorm, nn.LayerNorm)
INIT_WHOLE = (*INIT_LINEAR, nn.Embedding, *INIT_NORM)


def init_written(module: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The tensors ``init_module(module)`` may write: ``(written whole, written in part or maybe not at all)``.
    A block's ``init_weights`` may write any tensor under it, in part; the plain modules' init writes their
    ``weight`` and ``bias`` whole."""
    if getattr(type(module), "init_weights", None) is not None:
        return [], list(module.parameters())
    if not isinstance(module, INIT_WHOLE):
        return [], []
    whole = [p for k, p in module._parameters.items() if p is not None and k in ("weight", "bias")]
    return whole, [p for k, p in module._parameters.items() if p is not None and k not in ("weight", "bias")]


@torch.no_grad()
def init_module(module: nn.Module, std: float) -> None:
    """HF's init of one module's own tensors: normal(0, std) for linear/conv weights and embeddings (the
    padding row zero), zero biases, ones for norm weights; a block with ``init_weights`` does its own."""
    own = getattr(type(module), "init_weights", None)
    assert own is not None or not isinstance(module, ZeroCenteredRMSNorm)
    if own is not None:
        own(module, std)
    elif isinstance(module, INIT_LINEAR):
        module.weight.normal_(0.0, std)
        if module.bias is not None:
            module.bias.zero_()
    elif isinstance(module, nn.Embedding):
        module.weight.normal_(0.0, std)
        if module.padding_idx is not None:
            module.weight[module.padding_idx].zero_()
    elif isinstance(module, INIT_NORM):
        module.weight.fill_(1.0)
        if getattr(module, "bias", None) is not None:
            module.bias.zero_()


class CausalLM(nn.Module):
    """Embedding -> ``layers`` -> final RMSNorm -> ``lm_head``; ``make_layer(i)`` builds layer i."""

    def __init__(self, spec: ModelSpec, make_layer: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.spec = spec
        pad = spec.pad_token_id
        pad = pad if pad is not None and 0 <= pad < spec.vocab_size else None  # presets may name no real row
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, padding_idx=pad)
        self.layers = nn.ModuleList(make_layer(i) for i in range(spec.num_layers))
        self.norm = make_norm(spec.hidden_size, spec.rms_norm_eps, spec.norm_zero_centered)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.reset_parameters()
        if spec.tie_word_embeddings:  # after the init, as HF ties: the head is the embedding
            self.lm_head.weight = self.embed_tokens.weight

    # ---- the CausalLM interface ------------------------------------------------------------------
    def embed(self, input_ids_BS: torch.Tensor) -> torch.Tensor:
        """``[B, S]`` ids -> the first layer boundary ``h``."""
        return self.embed_tokens(input_ids_BS)

    def final_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """The last layer boundary -> ``[B, S, H]`` (final RMSNorm)."""
        return self.norm(h)

    def forward(self, input_ids: torch.Tensor, doc_ids: torch.Tensor | None = None,
                ctx: SeqContext | None = None) -> torch.Tensor:
        """Final hidden states ``[B, S, H]`` (before ``lm_head``); ``doc_ids [B, S]`` keeps packed documents
        apart. ``ctx`` carries this rank's shard metadata and the sequence-level hooks (None: one rank)."""
        if ctx is None:
            pos = None if doc_ids is None else positions_from_doc_ids(doc_ids)
            ctx = SeqContext(doc_ids=doc_ids, position_ids=pos)
        elif doc_ids is not None and ctx.doc_ids is None:
            raise ValueError("with a ctx, pass doc_ids inside it (ctx.doc_ids), not to the model")
        ctx.carry.clear()  # what one layer hands the next (a DSA selection) never outlives a forward
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h, ctx)
        return self.final_hidden(h)

    def logits(self, hidden_BSH: torch.Tensor) -> torch.Tensor:
        """``[B, S, V]``; only for small inputs (training uses the chunked losses on ``lm_head``)."""
        return self.lm_head(hidden_BSH)

    @torch.no_grad()
    def reset_parameters(self, std: float = INIT_STD, draw_on: torch.device | None = None) -> None:
        """HF's init of every module, in module order (the global RNG). ``draw_on``: the tensors each module's
        init writes (``init_written``) are drawn on that device and copied back into their storage: the same
        calls on the same shapes, in the same order, as an init on that device, so the same values. A tensor
        the init may write in part goes there with its values; one it writes whole, as allocated."""
        for module in self.modules():
            if draw_on is None:
                init_module(module, std)
                continue
            whole, part = init_written(module)
            if not whole and not part:
                continue
            homes = [p.data for p in whole + part]
            for p in whole:
                p.data = torch.empty_like(p.data, device=draw_on)
            for p in part:
                p.data = p.data.to(draw_on, copy=True)
            init_module(module, std)
            for p, home in zip(whole + part, homes):
                home.copy_(p.data)
                p.data = home


@dataclass(frozen=True)
class LayerParts:
    """A decoder layer split at its token mixer, for schemes that run the rest in tiles from outside
    (``memory.tiling.tile_layer``). Every tensor is token-major ``[T, ...]`` (batch and sequence flattened):

        *kept, x_TH = before(h_T)                 token-separable; parameters in ``before_modules``
        y = mixer(x [B, S, H], ctx)               the token mixer, over the whole (shard of the) sequence
        h_out_T = after(*kept, y_TH, h_T)         token-separable; parameters in ``after_modules``

    equals ``layer(h, ctx)``. Row i of every output of ``before`` and ``after`` depends on row i of their
    inputs only."""

    before: Callable[..., tuple[torch.Tensor, ...]]
    before_modules: tuple[nn.Module, ...]
    mixer: nn.Module
    after: Callable[..., torch.Tensor]
    after_modules: tuple[nn.Module, ...]

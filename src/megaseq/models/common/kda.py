"""Kimi Delta Attention (KDA): GLM-5.3-Flash's linear-attention layer.

Shapes: B batch, S_loc tokens on this rank, S full sequence, Hh heads (Hl of them on this rank after
``seq_to_heads``), D head dim, C = 3 * Hh * D conv channels ordered ``[q heads | k heads | v heads]``,
K conv kernel size.

    x_BSH --q/k/v_proj--> [B, S_loc, Hh, D] --seq_to_heads--> [B, S, Hl, D]
          --causal depthwise conv + SiLU (this rank's channels; q, k and v each alone)--> q, k, v
          --forget gate g (log decay per channel), beta = sigmoid(b_proj x)-->
          --chunked delta rule (q, k l2-normed inside the op)--> o [B, S, Hl, D]
          --heads_to_seq--> [B, S_loc, Hh, D] --gated RMSNorm (g_a/g_b) + o_proj--> [B, S_loc, H]

Context parallelism (Ulysses): the conv and the recurrence are per channel / per head, so after
``seq_to_heads`` each rank runs them over the whole sequence for its heads; with the identity context
this is the plain computation. Document boundaries (``ctx.full_doc_ids()``) restart the conv and the
recurrence: both ops take fla-style ``cu_seqlens`` over the batch flattened to one row.

q, k and v stay three contiguous tensors from their projections through the conv to the recurrence: the
conv runs once per part with its third of the conv weight (it is per channel, so this is the one conv over
the channels ``[q | k | v]``, channel for channel). No concatenation before the conv, no split after it
(whose non-contiguous views fla's ``chunk_kda`` would copy, and whose backward would concatenate the
gradients).

The recurrence in pieces: the ``kda`` op takes an ``initial_state`` and returns the final one
(``return_state=True``), so ``segment_step`` runs tokens ``[s, e)`` from the state at s, with the conv over
the ``segment_halo = K - 1`` tokens before s recomputed. Schemes that run the layer in segments from
outside (``megaseq.memory.kda_segments``) chain these steps; under sequence segments the layer takes the
state and the halo of its projected q/k/v (this rank's heads, so it composes with Ulysses CP) from
``ctx.carried_in`` instead. The layer itself knows no memory scheme.

Ops (``megaseq.ops.dispatch``): ``causal_conv`` and ``kda``, each with a pure-torch reference here;
the ``kda`` reference is HF's ``chunk_kimi_delta_attention`` (its row-by-row substitution loop done
as one triangular solve). Its working set is O(S * chunk * Dk) per head: a reference for tests and
short CPU runs, not for long sequences. On CUDA the dispatcher picks fla's Triton kernels
(``megaseq.ops.kda.fla``: ``chunk_kda``, O(S * H * D), and its causal conv) when fla-core is installed.
Precision: where HF casts to float32 we compute in ``promote_types(dtype, float32)`` (float64 stays
float64). The reference's chunk is 16: its cost has a chunk^2 * Dk term per chunk, and 16 is fastest
on a CPU.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from megaseq.models.common.context import SeqContext, doc_spans
from megaseq.models.spec import ModelSpec
from megaseq.ops import dispatch

QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # KDA's q, k, v (conv inputs or outputs), kept apart


# ---- op causal_conv: depthwise causal conv + activation, restarting at each segment ----------------


# ---- op kda: the chunked delta rule -----------------------------------------------------------------


# ---- modules ------------------------------------------------------------------------------------------


class ForgetGate(nn.Module):
    """Per-channel log decay ``g [B, S, Hh, D]`` (compute dtype); HF name ``forget_gate``. The activation after
    the two projections is op ``kda_gate`` (fla's fused kernel in the fast set)."""

    def __init__(self, spec: ModelSpec, layer: str = "forget_gate") -> None:
        super().__init__()
        Hh, D = spec.linear_num_heads, spec.linear_head_dim
        self.num_heads, self.head_dim = Hh, D
        self.layer = layer  # name in the dispatcher's per-layer record
        self.f_a_proj = nn.Linear(spec.hidden_size, D, bias=False)
        self.f_b_proj = nn.Linear(D, Hh * D, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(Hh * D, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.zeros(Hh, dtype=torch.float32))
        self.lower_bound = spec.linear_lower_bound

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        B, S = x_BSH.shape[:2]
        f = self.f_b_proj(self.f_a_proj(x_BSH)).view(B, S, self.num_heads, self.head_dim)
        return dispatch.call("kda_gate", f, self.A_log, self.dt_bias, self.lower_bound, layer=self.layer)


class GatedRMSNorm(nn.Module):
    """``weight * rmsnorm(x) * sigmoid(gate)`` over the head dim (op ``gated_rms_norm``); HF name ``o_norm``."""

    def __init__(self, dim: int, eps: float, layer: str = "o_norm") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.layer = layer  # name in the dispatcher's per-layer record

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return dispatch.call("gated_rms_norm", x, gate, self.weight, self.eps, layer=self.layer)


def doc_rows(doc_ids_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``cu_seqlens_from_doc_ids(doc_ids_BS)``'s segments: the index of each row's first and last."""
    counts = torch.tensor([len(spans) for spans in doc_spans(doc_ids_BS, doc_ids_BS.shape[1])],
                          device=doc_ids_BS.device)
    last = torch.cumsum(counts, 0) - 1
    return last - counts + 1, last


def cu_seqlens_from_doc_ids(doc_ids_BS: torch.Tensor) -> torch.Tensor:
    """Segment offsets ``[N + 1]`` of the documents of all rows, the batch flattened to one row."""
    B, S = doc_ids_BS.shape
    bounds = [0]
    for b, spans in enumerate(doc_spans(doc_ids_BS, S)):
        bounds.extend(b * S + end for _, end in spans)
    return torch.tensor(bounds, dtype=torch.int64, device=doc_ids_BS.device)


class KimiDeltaAttention(nn.Module):
    """The KDA token mixer; parameter names mirror ``Glm5NextTextLinearAttention``.

    ``segment_step`` / ``segment_halo`` are the one-segment computation (the recurrence from a given state,
    the conv over the halo before it) that segmented schemes chain from outside.
    """

    def __init__(self, spec: ModelSpec, layer: str = "kda") -> None:
        super().__init__()
        H, Hh, D = spec.hidden_size, spec.linear_num_heads, spec.linear_head_dim
        self.num_heads, self.head_dim, self.layer = Hh, D, layer
        self.q_proj = nn.Linear(H, Hh * D, bias=False)
        self.k_proj = nn.Linear(H, Hh * D, bias=False)
        self.v_proj = nn.Linear(H, Hh * D, bias=False)
        C, K = 3 * Hh * D, spec.linear_conv_kernel
        # nn.Conv1d only to keep HF's parameter name and layout ``conv1d.weight [C, 1, K]``
        self.conv1d = nn.Conv1d(C, C, kernel_size=K, groups=C, padding=K - 1, bias=False)
        self.forget_gate = ForgetGate(spec, f"{layer}.forget_gate")
        self.b_proj = nn.Linear(H, Hh, bias=False)
        self.g_a_proj = nn.Linear(H, D, bias=False)
        self.g_b_proj = nn.Linear(D, Hh * D, bias=False)
        self.o_norm = GatedRMSNorm(D, spec.rms_norm_eps, f"{layer}.o_norm")
        self.o_proj = nn.Linear(Hh * D, H, bias=False)

    def init_weights(self, std: float) -> None:
        """HF's init of the forget gate (its linears, conv and norm are initialised as modules)."""
        init_kda_(self)

    def _conv_weight(self, heads: slice) -> torch.Tensor:
        """This rank's conv channels ``[3 * Hl * D, K]`` (q, k and v blocks each sliced by head)."""
        w = self.conv1d.weight.squeeze(1)
        w = w.view(3, self.num_heads, self.head_dim, -1)[:, heads]
        return w.reshape(-1, w.shape[-1])

    def forward(self, x_BSH: torch.Tensor, ctx: SeqContext) -> torch.Tensor:
        if ctx.segmented:  # the whole model runs the sequence in segments (megaseq.memory.model_segments)
            return self._mix_carried(x_BSH, ctx)
        return self._mix(x_BSH, ctx)[0]

    # ---- one segment of the sequence (chained from outside, e.g. megaseq.memory.kda_segments) --------
    @property
    def segment_halo(self) -> int:
        """Tokens before a segment its outputs depend on through the causal conv (K - 1)."""
        return self.conv1d.kernel_size[0] - 1

    def segment_step(self, x_BLH: torch.Tensor, halo: int,
                     state_BHKV: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The outputs ``[B, L - halo, H]`` of the tokens after the first ``halo`` of ``x_BLH`` and the
        recurrent state after them ``[B, Hh, D, D]`` (compute dtype).

        ``x_BLH`` is the segment with the ``halo = min(K - 1, start)`` tokens before it: the conv runs over
        all L tokens (zero padding before the first) and its first ``halo`` outputs are dropped, which is
        exact (the padding then lies before the true sequence start only). ``state_BHKV`` is the
        recurrent state before the segment (None: zero, at the sequence start). One rank, no documents.
        """
        return self._mix(x_BLH, SeqContext(), halo, state_BHKV, return_state=True)

    def _mix_carried(self, x_BTH: torch.Tensor, ctx: SeqContext) -> torch.Tensor:
        """Sequence segments: this segment's tokens (this rank's piece of them under cp), the conv halo and
        the recurrent state of the tokens before it from ``ctx.carried_in``. The halo is carried after the
        projections and ``seq_to_heads`` (``[B, K - 1, 3 * Hl * D]``, this rank's heads), so every rank of a
        cp group carries its own heads' halo and state: the segment is split over the ranks like a sequence.
        """
        qkv_BTC, g, beta = self._project(x_BTH, 0, ctx)
        T = qkv_BTC[0].shape[1]
        # the halo travels as one [B, halo, 3 * Hl * D] tensor (channels [q | k | v], as the conv's); asked
        # for with no tokens of this segment, so that only the halo's K - 1 tokens are concatenated
        halo_BhC, halo, state = ctx.carried_in(self.layer, torch.cat([t[:, :0] for t in qkv_BTC], dim=-1),
                                               self.segment_halo)
        qkv_BLC = qkv_BTC
        if halo:
            C = qkv_BTC[0].shape[-1]
            qkv_BLC = tuple(torch.cat([h, t], dim=1) for h, t in zip(halo_BhC.split(C, dim=-1), qkv_BTC, strict=True))
        L = qkv_BLC[0].shape[1]
        full = ctx.full_doc_ids()  # [B, end of this segment] with documents, else None
        docs = continues = None
        if full is not None:  # the halo's and the segment's documents; does each row's first one go on?
            docs = full[:, full.shape[1] - L:]
            s = full.shape[1] - T  # the segment's first token
            continues = full[:, s] == full[:, s - 1] if s > 0 else None
        o, state = self._recur(qkv_BLC, g, beta, docs, halo, state, True, continues, ctx)
        tail = torch.cat([t[:, max(0, L - self.segment_halo):] for t in qkv_BLC], dim=-1)
        ctx.carried_out(self.layer, tail, state)
        return self._output(o, x_BTH, ctx)

    def _mix(self, x_BLH: torch.Tensor, ctx: SeqContext, halo: int = 0, state_BHKV: torch.Tensor | None = None,
             return_state: bool = False,
             continues_B: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer over ``x_BLH`` (this rank's tokens), whose first ``halo`` tokens only feed the causal
        conv; the recurrence starts at ``state_BHKV`` (None: zero). Returns the output ``[B, L - halo, H]``
        and, with ``return_state``, the final recurrent state (else None).

        With documents (``ctx.full_doc_ids()`` over the L tokens, one rank): the conv and the recurrence
        restart at each document start; ``state_BHKV`` is row b's state before its first token, used only
        where ``continues_B[b]`` (that token's document began earlier), and the returned state is each
        row's after its last token (its last document's)."""
        qkv_BLC, g, beta = self._project(x_BLH, halo, ctx)
        o, state = self._recur(qkv_BLC, g, beta, ctx.full_doc_ids(), halo, state_BHKV, return_state,
                               continues_B, ctx)
        return self._output(o, x_BLH[:, halo:], ctx), state

    def _project(self, x_BLH: torch.Tensor, halo: int, ctx: SeqContext) -> tuple[QKV, torch.Tensor, torch.Tensor]:
        """(the conv inputs ``(q, k, v)``, each ``[B, L', Hl * D]`` and contiguous, forget gate ``[B, T', Hl, D]``,
        beta ``[B, T', Hl, 1]``) of this rank's heads over the whole (cp-gathered) sequence; q/k/v of all L
        tokens, g and beta of the last ``T = L - halo``. q, k and v are not concatenated: ``_recur`` convolves
        each with its third of the conv weight."""
        B, L, _ = x_BLH.shape
        Hh, D = self.num_heads, self.head_dim
        if Hh % ctx.cp_size:
            raise ValueError(f"KDA has {Hh} heads, which context parallelism cp={ctx.cp_size} does not "
                             "divide: choose a cp that divides linear_num_heads")
        x_BTH = x_BLH[:, halo:]
        q, k, v = (p(x_BLH).view(B, L, Hh, D) for p in (self.q_proj, self.k_proj, self.v_proj))
        g = self.forget_gate(x_BTH)
        beta = torch.sigmoid(self.b_proj(x_BTH)).unsqueeze(-1)
        # Ulysses: all of the sequence, this rank's heads (identity with one rank)
        q, k, v, g, beta = (ctx.seq_to_heads(t) for t in (q, k, v, g, beta))
        Hl = q.shape[2]
        return tuple(t.reshape(B, -1, Hl * D) for t in (q, k, v)), g, beta

    def _recur(self, qkv_BLC: QKV, g: torch.Tensor, beta: torch.Tensor, doc_ids: torch.Tensor | None,
               halo: int, state_BHKV: torch.Tensor | None, return_state: bool, continues_B: torch.Tensor | None,
               ctx: SeqContext) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The causal conv over all L tokens (the first ``halo`` only feed it) and the delta-rule recurrence
        over the rest, for this rank's heads: (``o [B, T, Hl, D]``, the final state or None). ``qkv_BLC``: the
        conv inputs ``(q, k, v)``, each ``[B, L, Hl * D]``, convolved one at a time with their third of the
        conv weight (the conv is per channel: the same as one conv over ``[q | k | v]``), so that the kda op
        gets three contiguous tensors. ``doc_ids``: the documents of the L tokens (None: one per row)."""
        B, L, C = qkv_BLC[0].shape  # C = Hl * D channels per part
        D = self.head_dim
        Hl = C // D
        cu = None if doc_ids is None else cu_seqlens_from_doc_ids(doc_ids)
        rows = 1 if cu is not None else B
        weights = self._conv_weight(ctx.head_slice(self.num_heads)).split(C)  # q, k, v thirds [C, K]

        def conv(x_BLC: torch.Tensor, w_CK: torch.Tensor) -> torch.Tensor:
            y = dispatch.call("causal_conv", x_BLC.reshape(rows, -1, C), w_CK, "silu", cu, layer=self.layer)
            if rows == B:  # contiguous when B == 1 or halo == 0, else the kda op copies it
                y = y[:, halo:]
            elif halo:  # documents: the batch is one flattened row; drop each row's halo
                y = y.reshape(B, -1, C)[:, halo:].reshape(rows, -1, C)
            return y.reshape(rows, -1, Hl, D)

        q, k, v = (conv(x, w) for x, w in zip(qkv_BLC, weights, strict=True))
        first = last = None
        if cu is not None and halo:  # the recurrence runs over the tokens after the halo
            cu = cu_seqlens_from_doc_ids(doc_ids[:, halo:])
        if cu is not None and (return_state or state_BHKV is not None):
            first, last = doc_rows(doc_ids[:, halo:])
            if state_BHKV is not None:  # each row's carried state goes to its first document if it goes on
                go_on = continues_B if continues_B is not None else torch.zeros(B, dtype=torch.bool)
                rows_on = torch.nonzero(go_on.to(first.device)).squeeze(-1)
                init = state_BHKV.new_zeros((len(cu) - 1,) + tuple(state_BHKV.shape[1:]))
                state_BHKV = init.index_copy(0, first[rows_on], state_BHKV[rows_on].to(init.dtype))
        state_kw = {"initial_state": state_BHKV, "return_state": True} if return_state else {}
        o = dispatch.call("kda", q, k, v, g.reshape(rows, -1, Hl, D), beta.reshape(rows, -1, Hl), cu,
                          **state_kw, layer=self.layer)
        o, state = o if return_state else (o, None)
        if state is not None and last is not None:
            state = state.index_select(0, last)  # each row's last document's
        return o.reshape(B, -1, Hl, D), state

    def _output(self, o_BTHD: torch.Tensor, x_BTH: torch.Tensor, ctx: SeqContext) -> torch.Tensor:
        """Back to this rank's tokens (``heads_to_seq``), the gated RMSNorm and ``o_proj``: ``[B, T, H]``."""
        B, T, _ = x_BTH.shape
        Hh, D = self.num_heads, self.head_dim
        o = ctx.heads_to_seq(o_BTHD)
        gate = self.g_b_proj(self.g_a_proj(x_BTH)).view(B, T, Hh, D)
        return self.o_proj(self.o_norm(o, gate).reshape(B, T, Hh * D))


def init_kda_(module: KimiDeltaAttention) -> None:
    """HF ``_init_weights`` for the forget gate (FLA's init; global RNG): A_log 0 with a lower bound
    (else log U(1, 16)), dt_bias = inverse softplus of dt ~ exp(U(log 1e-3, log 1e-1))."""
    fg = module.forget_gate
    with torch.no_grad():
        if fg.lower_bound is not None:
            fg.A_log.zero_()
        else:
            fg.A_log.copy_(torch.empty_like(fg.A_log).uniform_(1.0, 16.0).log())
        dt = torch.empty_like(fg.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
        fg.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

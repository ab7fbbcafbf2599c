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
(``megaseq.ops.fla_kda``: ``chunk_kda``, O(S * H * D), and its causal conv) when fla-core is installed.
Precision: where HF casts to float32 we compute in ``promote_types(dtype, float32)`` (float64 stays
float64). The reference's chunk is 16: its cost has a chunk^2 * Dk term per chunk, and 16 is fastest
on a CPU.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megaseq.models.common.context import SeqContext, doc_spans
from megaseq.models.spec import ModelSpec
from megaseq.ops import dispatch
from megaseq.ops import fla_kda as _fla_kda  # noqa: F401  (registers the fla kda and conv ops)
from megaseq.ops import fla_norm as _fla_norm  # noqa: F401  (registers fla's gated norm, opt-in)
from megaseq.ops.amp import compute_dtype

QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # KDA's q, k, v (conv inputs or outputs), kept apart


def _segments(S: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int]]:
    if cu_seqlens is None:
        return [(0, S)]
    bounds = cu_seqlens.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


# ---- op causal_conv: depthwise causal conv + activation, restarting at each segment ----------------
@dispatch.register("causal_conv", "torch_conv1d", reference=True)
def causal_conv_reference(x_BSC: torch.Tensor, weight_CK: torch.Tensor, activation: str | None = "silu",
                          cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t, c] = act(sum_j w[c, j] * x[t - K + 1 + j, c])`` with zeros before each segment start.

    With ``cu_seqlens`` (``[N + 1]`` offsets) the batch must be 1 and each segment is convolved alone.
    """
    assert cu_seqlens is None or x_BSC.shape[0] == 1, "cu_seqlens needs the batch flattened to one row"
    C, K = weight_CK.shape
    outs = []
    for start, end in _segments(x_BSC.shape[1], cu_seqlens):
        seg = x_BSC[:, start:end].transpose(1, 2).to(weight_CK.dtype)
        y = F.conv1d(seg, weight_CK.unsqueeze(1), padding=K - 1, groups=C)[..., : end - start]
        if activation == "silu":
            y = F.silu(y)
        else:
            assert activation is None, f"unsupported conv activation {activation!r}"
        outs.append(y.transpose(1, 2).to(x_BSC.dtype))
    return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]


# ---- op kda: the chunked delta rule -----------------------------------------------------------------
def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's l2norm: ``x / sqrt(sum x^2 + eps)`` (eps added, not clamped)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _kda_chunked(q, k, v, g, beta, chunk_size: int, initial_state: torch.Tensor | None = None,
                 return_state: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One segment; inputs ``[B, H, L, D]`` (beta ``[B, H, L]``) in compute dtype.

    A port of HF ``chunk_kimi_delta_attention``: within a chunk the delta rule's unit lower-triangular
    system is solved at once, across chunks the state ``[B, H, Dk, Dv]`` is carried. It starts at
    ``initial_state`` (None: zero); with ``return_state`` the state after the last token comes back too,
    ``(out, state)``. The zero padding of the last chunk leaves the state unchanged (k, v and beta pad
    to zero, g to zero log decay), so the returned state is the one after token L - 1.
    """
    B, Hn, L, Dk = k.shape
    Dv = v.shape[-1]
    C = chunk_size
    pad = (C - L % C) % C
    q = F.pad(q, (0, 0, 0, pad)) * (1 / math.sqrt(Dk))
    k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (k, v, g))
    beta = F.pad(beta, (0, pad))
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, v, g, k_beta, v_beta = (t.reshape(B, Hn, -1, C, t.shape[-1]) for t in (q, k, v, g, k_beta, v_beta))
    g = g.cumsum(dim=-2)
    dev = q.device
    incl = torch.triu(torch.ones(C, C, dtype=torch.bool, device=dev), diagonal=0)
    strict = torch.triu(torch.ones(C, C, dtype=torch.bool, device=dev), diagonal=1)
    decay = (g.unsqueeze(-2) - g.unsqueeze(-3)).masked_fill(strict[..., None], float("-inf"))
    decay = decay.exp().to(q.dtype)
    # N: the strictly lower intra-chunk interactions; HF's row-by-row substitution loop computes
    # (I - N)^{-1}, here one batched unit-triangular solve (same result, one op instead of C - 1)
    N = (k_beta.unsqueeze(-2) * k.unsqueeze(-3) * decay).sum(dim=-1).masked_fill(incl, 0)
    eye = torch.eye(C, dtype=N.dtype, device=dev)
    attn = torch.linalg.solve_triangular(eye + N, eye.expand_as(N), upper=False, unitriangular=True)
    u = attn @ v_beta
    w = attn @ (k_beta * g.exp())
    # everything that does not depend on the carried state is computed for all chunks at once; the
    # loop over chunks then unbinds (one backward op) instead of indexing (one full-size zero-fill
    # per chunk in backward, which made the loop quadratic in the number of chunks)
    intra = (q.unsqueeze(-2) * k.unsqueeze(-3) * decay).sum(dim=-1).masked_fill(strict, 0)
    q_decayed = q * g.exp()
    k_decayed = (k * (g[..., -1:, :] - g).exp()).transpose(-1, -2)
    chunk_decay = g[..., -1, :].exp().unsqueeze(-1)
    if initial_state is None:
        state = torch.zeros(B, Hn, Dk, Dv, dtype=u.dtype, device=dev)
    else:
        assert initial_state.shape == (B, Hn, Dk, Dv), f"initial_state {tuple(initial_state.shape)}"
        state = initial_state.to(u.dtype)
    outs = []
    for qd_i, intra_i, u_i, w_i, kd_i, cd_i in zip(*(t.unbind(2) for t in (q_decayed, intra, u, w, k_decayed,
                                                                         chunk_decay))):
        v_new = u_i - w_i @ state
        outs.append(qd_i @ state + intra_i @ v_new)
        state = state * cd_i + kd_i @ v_new
    out = torch.stack(outs, dim=2).reshape(B, Hn, -1, Dv)[:, :, :L]
    return (out, state) if return_state else out


@dispatch.register("kda", "torch_chunked", reference=True)
def kda_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  cu_seqlens: torch.Tensor | None = None, chunk_size: int = 16,
                  initial_state: torch.Tensor | None = None,
                  return_state: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """KDA over ``[B, S, H, D]`` inputs (``g`` log-decay ``[B, S, H, Dk]``, ``beta [B, S, H]``).

    q and k are l2-normalised here (HF's ``use_qk_l2norm_in_kernel=True``). The state starts at
    ``initial_state`` ``[N, H, Dk, Dv]`` (None: zero) at every segment of ``cu_seqlens`` (batch 1,
    N segments) or at every row (N = B). Returns ``[B, S, H, Dv]`` in q's dtype; with ``return_state``
    ``(out, final_state [N, H, Dk, Dv])``, the state in compute dtype (fla's kernel returns float32).
    """
    assert cu_seqlens is None or q.shape[0] == 1, "cu_seqlens needs the batch flattened to one row"
    cd = compute_dtype(q.dtype)
    segments = _segments(q.shape[1], cu_seqlens)
    if initial_state is not None:
        n = len(segments) if cu_seqlens is not None else q.shape[0]
        assert initial_state.shape == (n, q.shape[2], k.shape[-1], v.shape[-1]), (
            f"initial_state {tuple(initial_state.shape)}, expected [{n}, H, Dk, Dv]")
    outs, states = [], []
    for i, (start, end) in enumerate(segments):
        qs, ks, vs, bs, gs = (t[:, start:end].transpose(1, 2).contiguous().to(cd) for t in (q, k, v, beta, g))
        h0 = initial_state if initial_state is None or cu_seqlens is None else initial_state[i:i + 1]
        res = _kda_chunked(l2norm(qs), l2norm(ks), vs, gs, bs, chunk_size, h0, return_state)
        if return_state:
            res, state = res
            states.append(state)
        outs.append(res.transpose(1, 2))
    out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    out = out.contiguous().to(q.dtype)
    if return_state:
        return out, torch.cat(states) if len(states) > 1 else states[0]
    return out


# ---- modules ------------------------------------------------------------------------------------------
@dispatch.register("kda_gate", "torch", reference=True)
def kda_gate_reference(f_BSHD: torch.Tensor, A_log_H: torch.Tensor, dt_bias_C: torch.Tensor,
                       lower_bound: float | None) -> torch.Tensor:
    """The log decay from the gate projection's output ``f [B, S, Hh, D]``, in the compute dtype (HF's order):
    ``g = f + dt_bias``, then ``lower_bound * sigmoid(exp(A_log) * g)`` (the "safe gate", in (lower_bound, 0))
    or, without a lower bound, ``-exp(A_log) * softplus(g)`` (softplus linear above 20)."""
    cd = compute_dtype(f_BSHD.dtype)
    Hh, D = f_BSHD.shape[-2:]
    g = f_BSHD.to(cd) + dt_bias_C.to(cd).view(Hh, D)
    decay_rate = torch.exp(A_log_H.to(cd).view(Hh, 1))
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(decay_rate * g)
    return -decay_rate * torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))


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


@dispatch.register("gated_rms_norm", "torch", reference=True)
def gated_rms_norm_reference(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * rmsnorm(x) * sigmoid(gate)`` over the last dim in the compute dtype, in x's dtype (HF's order)."""
    cd = compute_dtype(x.dtype)
    h = x.to(cd)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight.to(cd) * h * torch.sigmoid(gate.to(cd))
    return h.to(x.dtype)


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

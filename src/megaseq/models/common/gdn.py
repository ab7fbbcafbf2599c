"""Gated DeltaNet (GDN): Qwen3-Next's linear-attention layer, with a pure-torch reference of its op.

Shapes: B batch, S_loc tokens on this rank, S full sequence, Hk key heads, Hv value heads (r = Hv / Hk value
heads per key head), Dk / Dv head dims, C = 2 Hk Dk + Hv Dv conv channels ``[q heads | k heads | v heads]``,
K conv kernel, L one segment's tokens.

    x --in_proj_qkvz--> per key head [q Dk | k Dk | v r Dv | z r Dv];  x --in_proj_ba--> [b r | a r]
      q, k [B, S_loc, Hk, Dk], v, z [B, S_loc, Hv, Dv], beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias)
      --seq_to_heads--> this rank's heads over the whole sequence
      --causal depthwise conv + SiLU over [q | k | v]--> --op "gdn": the gated delta rule-->
      o [B, S, Hv, Dv] --heads_to_seq--> gated RMSNorm (silu(z)) --out_proj--> [B, S_loc, H]

The op ``gdn`` (``gdn_reference``) is HF's ``torch_chunk_gated_delta_rule`` op for op: q and k l2-normalised
(``x * rsqrt(sum x^2 + 1e-6)``), repeated over each key head's value heads, q scaled by ``Dk^-0.5``, the
chunk's unit-triangular system solved at once, the ``[Hv, Dk, Dv]`` state carried across chunks of 64,
the state decayed by ``exp(g)`` per token and head (one scalar per head: GDN's gate, where KDA's is per
channel). Documents (``cu_seqlens``) restart the conv and the state. On CUDA the dispatcher picks fla's
``chunk_gated_delta_rule`` (``megaseq.ops.gdn.fla``) when fla-core is installed; its memory is O(S H D),
the reference's O(S * 64 * D) per head (tests and short runs).

Precision: where HF casts to float32 (the gate, the recurrence, the gated norm) we compute in
``promote_types(dtype, float32)`` (docs/architecture.md). Context parallelism: Ulysses, as KDA (cp must
divide Hk and Hv). Sequence segments: as KDA, the recurrent state ``[Hv/cp, Dk, Dv]`` and the conv's
``K - 1`` earlier inputs (``[q | k | v]`` after ``seq_to_heads``: this rank's heads) are carried through
``ctx.carried_in`` / ``ctx.carried_out`` (the op's ``initial_state`` / final state, fla's and the reference's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megaseq.models.common.context import SeqContext
from megaseq.models.common.kda import cu_seqlens_from_doc_ids, doc_rows
from megaseq.models.spec import ModelSpec
from megaseq.ops import dispatch
from megaseq.ops.amp import compute_dtype


class GatedRMSNormSilu(nn.Module):
    """Qwen3-Next's ``Qwen3NextRMSNormGated``: ``weight * rmsnorm(x) * silu(gate)`` over the head dim; HF name
    ``norm``. The statistics and the gate in compute dtype (HF: float32), the normalised value cast back
    before the weight, as HF."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def init_weights(self, std: float) -> None:
        """HF's init: ones (a model made on the meta device gets them here)."""
        self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        cd = compute_dtype(x.dtype)
        h = x.to(cd)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(gate.to(cd))).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """The GDN token mixer; parameter names mirror ``Qwen3NextGatedDeltaNet``."""

    def __init__(self, spec: ModelSpec, layer: str = "gdn") -> None:
        super().__init__()
        H, K = spec.hidden_size, spec.linear_conv_kernel
        Hk, Dk = spec.linear_num_heads, spec.linear_head_dim
        Hv, Dv = spec.linear_num_value_heads or Hk, spec.linear_value_head_dim or Dk
        if Hv % Hk:
            raise ValueError(f"linear_num_value_heads ({Hv}) must be a multiple of linear_num_key_heads ({Hk})")
        self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim, self.layer = Hk, Hv, Dk, Dv, layer
        C = 2 * Hk * Dk + Hv * Dv
        self.conv1d = nn.Conv1d(C, C, kernel_size=K, groups=C, padding=K - 1, bias=False)
        self.in_proj_qkvz = nn.Linear(H, 2 * Hk * Dk + 2 * Hv * Dv, bias=False)
        self.in_proj_ba = nn.Linear(H, 2 * Hv, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(Hv))
        self.A_log = nn.Parameter(torch.zeros(Hv))
        self.norm = GatedRMSNormSilu(Dv, spec.rms_norm_eps)
        self.out_proj = nn.Linear(Hv * Dv, H, bias=False)

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        """HF's init: dt_bias ones, A_log = log U(0.01, 16) (its linears, conv and norm are initialised as
        modules)."""
        self.dt_bias.fill_(1.0)
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16).log())

    def _split(self, x_BSH: torch.Tensor):
        """q, k ``[B, S, Hk, Dk]``, v, z ``[B, S, Hv, Dv]``, b, a ``[B, S, Hv]`` (HF's per-key-head grouping)."""
        B, S, _ = x_BSH.shape
        Hk, Hv, Dk, Dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        r = Hv // Hk
        qkvz = self.in_proj_qkvz(x_BSH).view(B, S, Hk, 2 * Dk + 2 * r * Dv)
        q, k, v, z = qkvz.split([Dk, Dk, r * Dv, r * Dv], dim=-1)
        b, a = self.in_proj_ba(x_BSH).view(B, S, Hk, 2 * r).split([r, r], dim=-1)
        return (q, k, v.reshape(B, S, Hv, Dv), z.reshape(B, S, Hv, Dv), b.reshape(B, S, Hv), a.reshape(B, S, Hv))

    def _conv_weight(self, k_heads: slice, v_heads: slice) -> torch.Tensor:
        """This rank's conv channels ``[q heads | k heads | v heads]`` of ``conv1d.weight``, ``[C_rank, K]``."""
        w = self.conv1d.weight.squeeze(1)
        nk, nv = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        wq, wk, wv = w.split([nk, nk, nv])
        per_k = [t.view(self.num_k_heads, self.head_k_dim, -1)[k_heads].flatten(0, 1) for t in (wq, wk)]
        return torch.cat(per_k + [wv.view(self.num_v_heads, self.head_v_dim, -1)[v_heads].flatten(0, 1)])

    def forward(self, x_BSH: torch.Tensor, ctx: SeqContext) -> torch.Tensor:
        B, S_loc, _ = x_BSH.shape
        Hk, Hv, Dk, Dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        if Hk % ctx.cp_size or Hv % ctx.cp_size:
            raise ValueError(f"gated DeltaNet has {Hk} key / {Hv} value heads, which context parallelism "
                             f"cp={ctx.cp_size} must divide: choose a cp that divides linear_num_key_heads")
        q, k, v, z, b, a = self._split(x_BSH)
        cd = compute_dtype(x_BSH.dtype)
        beta = torch.sigmoid(b)
        g = -self.A_log.to(cd).exp() * F.softplus(a.to(cd) + self.dt_bias.to(cd))
        q, k, v, g, beta = (ctx.seq_to_heads(t if t.dim() == 4 else t.unsqueeze(-1)) for t in (q, k, v, g, beta))
        g, beta = g.squeeze(-1), beta.squeeze(-1)
        hk, hv = q.shape[2], v.shape[2]
        mixed_BTC = torch.cat([q.reshape(B, -1, hk * Dk), k.reshape(B, -1, hk * Dk), v.reshape(B, -1, hv * Dv)],
                              dim=-1)
        o = self._mix(mixed_BTC, g, beta, ctx, hk, hv)
        o = ctx.heads_to_seq(o.reshape(B, -1, hv, Dv))
        return self.out_proj(self.norm(o, z).reshape(B, S_loc, Hv * Dv))

    @property
    def conv_halo(self) -> int:
        """Tokens before a segment whose conv inputs its outputs depend on (K - 1)."""
        return self.conv1d.kernel_size[0] - 1

    def _mix(self, mixed_BTC: torch.Tensor, g_BTH: torch.Tensor, beta_BTH: torch.Tensor, ctx: SeqContext,
             hk: int, hv: int) -> torch.Tensor:
        """The causal conv and the gated delta rule over this rank's heads: ``o [B, T, hv, Dv]``. Under
        sequence segments (``ctx.segmented``) the conv's ``K - 1`` earlier inputs (the halo, ``[q | k | v]``
        after ``seq_to_heads``) and the recurrent state come from ``ctx.carried_in`` and this segment's go to
        ``ctx.carried_out``; with documents the conv and the state restart at each document start and a
        row's carried state feeds its first document only if that document goes on from the segment before."""
        B, T, _ = mixed_BTC.shape
        Dk, Dv = self.head_k_dim, self.head_v_dim
        halo_BhC, halo, state = ctx.carried_in(self.layer, mixed_BTC[:, :0], self.conv_halo) if ctx.segmented \
            else (None, 0, None)
        mixed_BLC = torch.cat([halo_BhC.to(mixed_BTC.dtype), mixed_BTC], dim=1) if halo else mixed_BTC
        L = mixed_BLC.shape[1]
        full = ctx.full_doc_ids()  # [B, tokens so far] (the whole sequence without segments)
        docs = None if full is None else full[:, full.shape[1] - L:]
        continues = None
        if full is not None and ctx.segmented and full.shape[1] > T:  # does each row's first document go on?
            s = full.shape[1] - T
            continues = full[:, s] == full[:, s - 1]
        cu = None if docs is None else cu_seqlens_from_doc_ids(docs)
        rows = 1 if cu is not None else B
        w = self._conv_weight(ctx.head_slice(self.num_k_heads), ctx.head_slice(self.num_v_heads))
        conv = dispatch.call("causal_conv", mixed_BLC.reshape(rows, -1, mixed_BLC.shape[-1]), w, "silu", cu,
                             layer=self.layer)
        conv = conv.reshape(B, L, -1)[:, halo:].reshape(rows, B * T // rows, -1)
        q, k, v = conv.split([hk * Dk, hk * Dk, hv * Dv], dim=-1)
        cu = None if docs is None else cu_seqlens_from_doc_ids(docs[:, halo:])
        first = last = None
        if cu is not None and ctx.segmented:
            first, last = doc_rows(docs[:, halo:])
            if state is not None:  # row b's carried state starts its first document when that goes on
                rows_on = torch.nonzero(continues.to(first.device)).squeeze(-1)
                init = state.new_zeros((len(cu) - 1,) + tuple(state.shape[1:]))
                state = init.index_copy(0, first[rows_on], state[rows_on])
        state_kw = {"initial_state": state, "return_state": True} if ctx.segmented else {}
        o = dispatch.call("gdn", q.reshape(rows, -1, hk, Dk), k.reshape(rows, -1, hk, Dk), v.reshape(rows, -1, hv, Dv),
                          g_BTH.reshape(rows, -1, hv), beta_BTH.reshape(rows, -1, hv), cu, **state_kw, layer=self.layer)
        if ctx.segmented:
            o, state = o
            if last is not None:
                state = state.index_select(0, last)  # each row's last document's
            ctx.carried_out(self.layer, mixed_BLC[:, max(0, L - self.conv_halo):], state)
        return o

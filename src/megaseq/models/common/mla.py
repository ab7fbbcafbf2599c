"""Multi-head latent attention (MLA), dense: DeepSeek-V3 (RoPE on a shared key part) and Kimi-Linear (NoPE).

Shapes: B batch, S_loc tokens on this rank, S full sequence, Hh heads, R kv_lora_rank, Dn qk_nope_head_dim,
Dr qk_rope_head_dim, Dv v_head_dim, Dq = Dn + Dr.

    x --q_a_proj, q_a_layernorm, q_b_proj (or q_proj)--> q [B, S_loc, Hh, Dn | Dr]
    x --kv_a_proj_with_mqa--> [c_raw R | k_rot Dr];  c = kv_a_layernorm(c_raw)
    RoPE on q's Dr dims and on k_rot (one key part shared by all heads), at the tokens' positions
    latent = [c | k_rot]  [B, S_loc, R + Dr]   (what the sparse layers gather; ``project``)
    dense:  k = [kv_b(c)_nope | k_rot], v = kv_b(c)_v per head --Ulysses, op "attention"--> o_proj

RoPE (``models.common.rope``): DeepSeek lays the rotated dims out in interleaved pairs (``rope_interleave``)
and scales the softmax by YaRN's ``mscale^2`` (``rope.yarn_softmax_scale``); Kimi-Linear keeps its Dr dims
unrotated (``mla_rotate = False``: "NoPE MLA with the rope part of the keys still shared"). GLM-5.3-Flash's
MLA has Dr = 0.

The latent norms use their own eps (DeepSeek-V3 / Kimi: HF's default 1e-6, not ``rms_norm_eps``; GLM-5:
``rms_norm_eps``). The dense path expands keys and values locally and goes context-parallel through
Ulysses like softmax attention (``Attention``). Under sequence segments the latent is carried
(``ctx.attend_seq``: the earlier segments' latents joined before this segment's, gathered over the cp
group) and expanded to keys and values inside the attention, a group of heads at a time
(``ops.workspace.mla_segment_heads``). ``MLASparseAttention`` (``mla_dsa.py``) gathers ``project``'s latent instead.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megaseq.models.common import rope
from megaseq.models.common.attention import kv_repeats, positions_for
from megaseq.models.common.context import SeqContext
from megaseq.models.common.lora import linear_weight
from megaseq.models.common.norm import RMSNorm
from megaseq.models.spec import ModelSpec
from megaseq.ops import dispatch
from megaseq.ops.amp import autocast_as, autocast_state, lowered
from megaseq.ops.workspace import mla_segment_heads


class _HeadGroups(torch.autograd.Function):
    """``MultiLatentAttention._attend_groups`` keeping only its inputs: the backward runs each head group's
    forward again and backpropagates it before the next (``_attend_groups_vjp``), so the expanded keys and
    values of one group at a time are alive."""

    @staticmethod
    def forward(ctx: Any, mla: MultiLatentAttention, doc_ids: torch.Tensor | None, q: torch.Tensor,
                latent: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
        ctx.mla, ctx.doc_ids, ctx.autocast = mla, doc_ids, autocast_state()
        ctx.save_for_backward(q, latent, w_uk, w_uv)
        return mla._attend_groups(q, latent, w_uk, w_uv, doc_ids)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        with autocast_as(ctx.autocast):
            grads = ctx.mla._attend_groups_vjp(*ctx.saved_tensors, ctx.doc_ids, g, tuple(ctx.needs_input_grad[2:]))
        return (None, None, *grads)


class MultiLatentAttention(nn.Module):
    """Dense MLA; parameter names mirror ``DeepseekV3Attention`` / ``KimiLinearAttention``."""

    def __init__(self, spec: ModelSpec, layer: str = "mla", latent_norm_eps: float = 1e-6) -> None:
        super().__init__()
        H, Hh = spec.hidden_size, spec.num_attention_heads
        R, Dr, Dn, Dv = spec.kv_lora_rank, spec.qk_rope_head_dim, spec.qk_nope_head_dim, spec.v_head_dim
        if Dr % 2:
            raise ValueError(f"qk_rope_head_dim ({Dr}) must be even (RoPE rotates pairs)")
        self.num_heads, self.kv_lora_rank, self.rope_dim, self.nope_dim, self.v_dim = Hh, R, Dr, Dn, Dv
        self.layer = layer
        self.rotate, self.interleave = spec.mla_rotate and Dr > 0, spec.rope_interleave
        self.rope_theta, self.rope_scaling = spec.rope_theta, dict(spec.rope_scaling)
        self.max_positions = spec.max_position_embeddings
        bias = spec.attention_bias
        self.q_lora_rank = spec.q_lora_rank
        if spec.q_lora_rank:
            self.q_a_proj = nn.Linear(H, spec.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(spec.q_lora_rank, eps=latent_norm_eps)
            self.q_b_proj = nn.Linear(spec.q_lora_rank, Hh * (Dn + Dr), bias=False)
        else:
            self.q_proj = nn.Linear(H, Hh * (Dn + Dr), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, R + Dr, bias=bias)
        self.kv_a_layernorm = RMSNorm(R, eps=latent_norm_eps)
        self.kv_b_proj = nn.Linear(R, Hh * (Dn + Dv), bias=False)
        self.o_proj = nn.Linear(Hh * Dv, H, bias=bias)
        self.scaling = rope.yarn_softmax_scale(spec.rope_scaling, (Dn + Dr) ** -0.5)

    # ---- projections (shared with the sparse layer) -----------------------------------------------
    def project(self, x_BQH: torch.Tensor, ctx: SeqContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(q [B, Q, Hh, Dn + Dr], latent [B, Q, R + Dr], q_resid [B, Q, q_lora] or None)``: queries and
        the latent ``[c | k_rot]`` of this rank's tokens, RoPE applied at their positions."""
        B, Q, _ = x_BQH.shape
        Hh, Dn, Dr, R = self.num_heads, self.nope_dim, self.rope_dim, self.kv_lora_rank
        q_resid = None
        if self.q_lora_rank:
            q_resid = self.q_a_layernorm(self.q_a_proj(x_BQH))
            q_BQHD = self.q_b_proj(q_resid).view(B, Q, Hh, Dn + Dr)
        else:
            q_BQHD = self.q_proj(x_BQH).view(B, Q, Hh, Dn + Dr)
        c_raw, k_rot = self.kv_a_proj_with_mqa(x_BQH).split([R, Dr], dim=-1)
        c_BQR = self.kv_a_layernorm(c_raw)
        if self.rotate:
            cos, sin = self.cos_sin(ctx, B, Q, x_BQH)
            q_rot = rope.apply(q_BQHD[..., Dn:], cos.unsqueeze(2), sin.unsqueeze(2), self.interleave)
            q_BQHD = torch.cat([q_BQHD[..., :Dn], q_rot], dim=-1)
            k_rot = rope.apply(k_rot, cos, sin, self.interleave)
        return q_BQHD, torch.cat([c_BQR, k_rot], dim=-1) if Dr else c_BQR, q_resid

    def cos_sin(self, ctx: SeqContext, B: int, Q: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [B, Q, Dr]`` at this rank's positions (RoPE over the qk_rope_head_dim dims)."""
        freq, factor = rope.inv_freq(self.rope_dim, self.rope_theta, self.rope_scaling, self.max_positions, x.device)
        return rope.cos_sin(positions_for(ctx, B, Q, x.device), freq, factor, x.dtype)

    def expand(self, latent_BSC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent -> keys ``[B, S, Hh, Dn + Dr]`` (the rope part broadcast to every head), values ``[B, S, Hh, Dv]``."""
        B, S, _ = latent_BSC.shape
        Hh, Dn, R = self.num_heads, self.nope_dim, self.kv_lora_rank
        kv = self.kv_b_proj(latent_BSC[..., :R]).view(B, S, Hh, Dn + self.v_dim)
        k_nope, v = kv.split([Dn, self.v_dim], dim=-1)
        if not self.rope_dim:
            return k_nope, v
        k_rot = latent_BSC[..., R:].unsqueeze(2).expand(B, S, Hh, self.rope_dim)
        return torch.cat([k_nope, k_rot], dim=-1), v

    # ---- dense attention -------------------------------------------------------------------------------
    def forward(self, x_BSH: torch.Tensor, ctx: SeqContext) -> torch.Tensor:
        B, S_loc, _ = x_BSH.shape
        q, latent, _ = self.project(x_BSH, ctx)
        if ctx.segmented:
            return self._attend_carried(q, latent, ctx)
        k, v = self.expand(latent)
        rep = kv_repeats(self.num_heads, self.num_heads, ctx.cp_size) if ctx.cp_size > 1 else 1
        assert rep == 1  # every head has its own keys: cp must divide the heads (kv_repeats checks)
        q, k, v = ctx.seq_to_heads(q), ctx.seq_to_heads(k), ctx.seq_to_heads(v)
        o = dispatch.call("attention", q, k, v, ctx.full_doc_ids(), self.scaling, layer=self.layer)
        return self.o_proj(ctx.heads_to_seq(o).reshape(B, S_loc, self.num_heads * self.v_dim))

    def _attend_carried(self, q_BTHD: torch.Tensor, latent_BTC: torch.Tensor, ctx: SeqContext) -> torch.Tensor:
        """Sequence segments: the latent ``[c | k_rot]`` (post-norm, post-RoPE) is what is carried
        (``ctx.attend_seq``: the latents of every token so far, gathered over the cp group: gather-KV), and each
        call of ``attend`` expands it to keys and values as the dense path does, a group of heads at a time
        (``_attend_heads``), so that a million keys never take all ``Hh`` heads' keys at once. ``kv_b_proj``'s
        weights go to ``attend`` as arguments (``params``): the host store's backward reruns it and gives them
        their gradients. The queries are all of the segment for this rank's heads (``seq_to_heads``)."""
        B, T_loc = latent_BTC.shape[:2]
        Hh, Dn, R = self.num_heads, self.nope_dim, self.kv_lora_rank
        heads = ctx.head_slice(Hh)
        doc_ids = ctx.full_doc_ids()
        q_BTHD = ctx.seq_to_heads(q_BTHD)
        w_HXR = linear_weight(self.kv_b_proj).view(Hh, Dn + self.v_dim, R)[heads]
        w_uk_HNR, w_uv_HVR = w_HXR.split([Dn, self.v_dim], dim=1)

        def attend(q_: torch.Tensor, latent_BSC: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
            grouped = self._heads_per_call(q_, latent_BSC) < q_.shape[2]
            if grouped and torch.is_grad_enabled() and any(t.requires_grad for t in (q_, latent_BSC, w_uk, w_uv)):
                return _HeadGroups.apply(self, doc_ids, q_, latent_BSC, w_uk, w_uv)
            return self._attend_groups(q_, latent_BSC, w_uk, w_uv, doc_ids)

        attend.vjp = lambda q_, latent_BSC, w_uk, w_uv, g, needs: self._attend_groups_vjp(  # type: ignore[attr-defined]
            q_, latent_BSC, w_uk, w_uv, doc_ids, g, needs)

        o_BTHV = ctx.attend_seq(q_BTHD, (latent_BTC,), self.layer, attend, gathered=False,
                                params=(w_uk_HNR, w_uv_HVR))
        return self.o_proj(ctx.heads_to_seq(o_BTHV).reshape(B, T_loc, self.num_heads * self.v_dim))

    @property
    def _head_width(self) -> int:
        """The width one segment-attention call runs its keys and values at: ``max(Dq, Dv)`` (v padded to it)."""
        return max(self.nope_dim + self.rope_dim, self.v_dim)

    def _heads_per_call(self, q_BTHD: torch.Tensor, latent_BSC: torch.Tensor) -> int:
        B, S = latent_BSC.shape[:2]
        return mla_segment_heads(q_BTHD.shape[2], B * S, self._head_width, lowered(latent_BSC).itemsize)

    def _attend_groups(self, q_BTHD: torch.Tensor, latent_BSC: torch.Tensor, w_uk_HNR: torch.Tensor,
                       w_uv_HVR: torch.Tensor, doc_ids: torch.Tensor | None) -> torch.Tensor:
        """``_attend_heads`` a group of heads at a time (``_heads_per_call``), the outputs joined."""
        H, n = q_BTHD.shape[2], self._heads_per_call(q_BTHD, latent_BSC)
        outs = [self._attend_heads(q_BTHD[:, :, h:h + n], latent_BSC, w_uk_HNR[h:h + n], w_uv_HVR[h:h + n], doc_ids)
                for h in range(0, H, n)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def _attend_groups_vjp(self, q_BTHD: torch.Tensor, latent_BSC: torch.Tensor, w_uk_HNR: torch.Tensor,
                           w_uv_HVR: torch.Tensor, doc_ids: torch.Tensor | None, g_BTHV: torch.Tensor,
                           needs: tuple[bool, ...]) -> tuple[torch.Tensor | None, ...]:
        """The gradients of ``_attend_groups``' inputs ``(q, latent, w_uk, w_uv)`` (None where ``needs`` says
        not) for the output gradient ``g``. Each head group in turn: its keys and values expanded again (no
        graph), the attention run and backpropagated with them as leaves, then freed; their gradients taken back
        through the expansion by hand, each product added into the latent's gradient (float32 at least, made
        once) and dropped, so that one ``[B, S, R]`` product beside the group's ``dk``, ``dv`` is the most the
        latent's gradient costs (autograd's way through the strided views would hold several ``[B, S, C]``)."""
        need_q, need_lat, need_wk, need_wv = needs
        H, n = q_BTHD.shape[2], self._heads_per_call(q_BTHD, latent_BSC)
        B, S, _ = latent_BSC.shape
        R, Dn, Dv = self.kv_lora_rank, self.nope_dim, self.v_dim
        c_XR = latent_BSC[..., :R].reshape(B * S, R)  # a strided view (rows C apart): read in place
        d_lat = torch.zeros(latent_BSC.shape, dtype=torch.promote_types(latent_BSC.dtype, torch.float32),
                            device=latent_BSC.device) if need_lat else None
        d_q, d_wk, d_wv = [], [], []
        for h in range(0, H, n):
            wk, wv = w_uk_HNR[h:h + n], w_uv_HVR[h:h + n]
            with torch.no_grad():
                k_BSHD, v_BSHV = self._keys_values(latent_BSC, wk, wv, pad=True)
            with torch.enable_grad():
                q_ = q_BTHD[:, :, h:h + n].detach().requires_grad_(need_q)
                k_ = k_BSHD.requires_grad_(need_lat or need_wk)
                v_ = v_BSHV.requires_grad_(need_lat or need_wv)
                out = dispatch.call("attention", q_, k_, v_, doc_ids, self.scaling, layer=self.layer)[..., :Dv]
                wanted = [t for t in (q_, k_, v_) if t.requires_grad]
                got = iter(torch.autograd.grad(out, wanted, g_BTHV[:, :, h:h + n]) if wanted else ())
            dq, dk, dv = (next(got) if t.requires_grad else None for t in (q_, k_, v_))
            del out, q_, k_, v_, k_BSHD, v_BSHV, wanted, got  # the group's keys and values go here
            d_q.append(dq)
            with torch.no_grad():  # a backward's arithmetic (never a graph, whatever mode the caller is in)
                for d, w, need_w, width, into in ((dk, wk, need_wk, Dn, d_wk), (dv, wv, need_wv, Dv, d_wv)):
                    if d is None:
                        into.append(None)
                        continue
                    d_XF = d[..., :width].reshape(B * S, n * width)  # the expansion's output gradient [B S, n F]
                    into.append((d_XF.T @ c_XR.to(d_XF.dtype)).view(n, width, R).to(w.dtype) if need_w else None)
                    if d_lat is not None:
                        d_lat[..., :R].add_((d_XF @ w.reshape(n * width, R).to(d_XF.dtype)).view(B, S, R))
                    del d_XF
                if d_lat is not None and self.rope_dim and dk is not None:  # k_rot: one rope key, every head
                    d_lat[..., R:].add_(dk[..., Dn:].sum(dim=2))
            del dk, dv, d

        def joined(parts: list[torch.Tensor | None], dim: int) -> torch.Tensor | None:
            return None if parts[0] is None else parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)

        d_lat = d_lat if d_lat is None else d_lat.to(latent_BSC.dtype)
        return joined(d_q, 2), d_lat, joined(d_wk, 0), joined(d_wv, 0)

    def _keys_values(self, latent_BSC: torch.Tensor, w_uk_HNR: torch.Tensor, w_uv_HVR: torch.Tensor,
                     pad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """These heads' keys ``[c W_uk^T | k_rot]`` and values ``c W_uv^T`` from the latent ``[c | k_rot]``;
        ``pad``: the values zero-padded to the keys' width as the attention op would pad them, made so by zero
        rows of ``W_uv`` (no unpadded copy of the values is ever made)."""
        R, n = self.kv_lora_rank, w_uk_HNR.shape[0]
        c_BSR = latent_BSC[..., :R]  # a strided view: the matmuls read it in place
        k_BSHN = F.linear(c_BSR, w_uk_HNR.reshape(-1, R).to(c_BSR.dtype)).unflatten(-1, (n, self.nope_dim))
        if self.rope_dim:  # the keys whole before the values are made: never three of them at once
            k_rot = latent_BSC[..., R:].unsqueeze(2).expand(-1, -1, n, -1)
            k_BSHN = torch.cat([k_BSHN, k_rot.to(k_BSHN.dtype)], dim=-1)
        width = self._head_width if pad else self.v_dim
        if width > self.v_dim:
            w_uv_HVR = F.pad(w_uv_HVR, (0, 0, 0, width - self.v_dim))
        v_BSHV = F.linear(c_BSR, w_uv_HVR.reshape(-1, R).to(c_BSR.dtype)).unflatten(-1, (n, width))
        return k_BSHN, v_BSHV

    def _attend_heads(self, q_BTHD: torch.Tensor, latent_BSC: torch.Tensor, w_uk_HNR: torch.Tensor,
                      w_uv_HVR: torch.Tensor, doc_ids: torch.Tensor | None) -> torch.Tensor:
        """These heads' attention over the latent's keys (``_keys_values``, the values zero-padded to the keys'
        width as the op would pad them: the unpadded copy is gone before the attention runs), the op "attention"
        (queries the last of the keys)."""
        k_BSHN, v_BSHD = self._keys_values(latent_BSC, w_uk_HNR, w_uv_HVR, pad=True)
        out = dispatch.call("attention", q_BTHD, k_BSHN, v_BSHD, doc_ids, self.scaling, layer=self.layer)
        return out[..., :self.v_dim]

"""Dense MLA's attention under sequence segments on the GPU, Kimi-Linear-48B-A3B's shapes (32 heads, latent 512 + 64,
qk 192, v 128): one segment's queries over the latents of every token so far, as ``MultiLatentAttention`` runs it
(the latent expanded to keys and values a head group at a time, ``ops.workspace.mla_segment_heads``), beside the
absorbed formulation (each head's query ``[q_nope W_uk | q_rot]`` as an MQA over the 576-wide latent, values
``[c | 0]``, then ``o W_uv``: the same sums in another order), in the same job.

    python benchmarks/kernels/mla_segment_gpu.py --out $OUT/mla_segment.json            # about a minute on an H100
    python benchmarks/kernels/mla_segment_gpu.py --smoke --out /tmp/mla_segment.json    # CPU, tiny shapes

Per prefix length: the time of one warm call (after a warm-up call) of the forward without a graph (what each
segment's forward pass runs) and of forward + backward (its backward's rerun), bf16 autocast, the peak memory
above the inputs, and the two formulations' outputs' difference (relative to the output's largest entry).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.nn.attention.bias import causal_lower_right

from megaseq.models.common.context import SeqContext
from megaseq.models.common.mla import MultiLatentAttention
from megaseq.models.spec import from_hf_config
from megaseq.ops import dispatch

GIB = 2**30


class _Prefix(SeqContext):
    """A segment's context: the earlier tokens' latents joined before this segment's (what the segment store
    hands the attention)."""

    segmented = True

    def __init__(self, prefix: torch.Tensor) -> None:
        super().__init__()
        self.prefix = prefix

    def attend_seq(self, q, kv, key, attend, gathered=True, params=()):
        return attend(q, torch.cat([self.prefix, kv[0].to(self.prefix.dtype)], dim=1), *params)


def absorbed(mla: MultiLatentAttention, q_BTHD: torch.Tensor, latent_BSC: torch.Tensor) -> torch.Tensor:
    """The absorbed formulation: per head an SDPA over the latent (keys ``[c | k_rot]``, values ``[c | 0]``)."""
    Hh, Dn, R, Dr = mla.num_heads, mla.nope_dim, mla.kv_lora_rank, mla.rope_dim
    w = mla.kv_b_proj.weight.view(Hh, Dn + mla.v_dim, R)
    w_uk, w_uv = w.split([Dn, mla.v_dim], dim=1)
    q_abs = torch.cat([torch.einsum("bthn,hnr->bthr", q_BTHD[..., :Dn], w_uk.to(q_BTHD.dtype)), q_BTHD[..., Dn:]], -1)
    k = latent_BSC.unsqueeze(1)  # [B, 1, S, C]
    v = torch.cat([latent_BSC[..., :R], latent_BSC.new_zeros(latent_BSC.shape[:2] + (Dr,))], -1).unsqueeze(1)
    T, S = q_abs.shape[1], latent_BSC.shape[1]
    mask = causal_lower_right(T, S)
    o = [torch.nn.functional.scaled_dot_product_attention(q_abs[:, :, h:h + 1].transpose(1, 2).to(k.dtype), k, v,
                                                          attn_mask=mask, scale=mla.scaling)
         for h in range(Hh)]
    o_c = torch.cat(o, dim=1).transpose(1, 2)[..., :R]
    return torch.einsum("bthr,hvr->bthv", o_c, w_uv.to(o_c.dtype)).flatten(2)


def expanded(mla: MultiLatentAttention, q_BTHD: torch.Tensor, latent_BTC: torch.Tensor,
             prefix: torch.Tensor) -> torch.Tensor:
    """The module's path, up to ``o_proj``'s input."""
    ctx = _Prefix(prefix)
    seen = {}
    orig = mla.o_proj.forward
    mla.o_proj.forward = lambda x: seen.setdefault("o", x)
    try:
        mla._attend_carried(q_BTHD, latent_BTC, ctx)
    finally:
        mla.o_proj.forward = orig
    return seen["o"]


def measured(fn) -> tuple[float, float]:
    """``(seconds, peak GiB above what was allocated before)`` of one warm call (after one warm-up call)."""
    fn()
    if DEV == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    fn()
    if DEV == "cuda":
        torch.cuda.synchronize()
    s = time.perf_counter() - t
    return s, ((torch.cuda.max_memory_allocated() - base) / GIB if DEV == "cuda" else 0.0)


DEV = "cuda" if torch.cuda.is_available() else "cpu"


def measure(mla: MultiLatentAttention, T: int, S0: int, dt: torch.dtype) -> dict:
    """One segment of ``T`` queries after ``S0`` earlier tokens: both formulations' times, peaks, difference."""
    Hh, Dq, C = mla.num_heads, mla.nope_dim + mla.rope_dim, mla.kv_lora_rank + mla.rope_dim
    q = (torch.randn(1, T, Hh, Dq, device=DEV) * 0.5).to(dt)
    lat = torch.randn(1, T, C, device=DEV).to(dt)
    prefix = torch.randn(1, S0, C, device=DEV).to(dt)
    joined = torch.cat([prefix, lat], dim=1)
    row: dict = {"prefix": S0, "keys": S0 + T}

    def fb(kind: str) -> None:
        qg, lg = q.detach().requires_grad_(True), lat.detach().requires_grad_(True)
        pg = prefix.detach().requires_grad_(True)
        out = expanded(mla, qg, lg, pg) if kind == "expanded" else absorbed(mla, qg, torch.cat([pg, lg], dim=1))
        out.float().square().mean().backward()
        mla.zero_grad(set_to_none=True)

    with dispatch.configured(), torch.autocast(DEV, dtype=dt, enabled=DEV == "cuda"):
        with torch.no_grad():
            o_new, o_abs = expanded(mla, q, lat, prefix), absorbed(mla, q, joined)
            scale = o_abs.float().abs().max().clamp_min(1e-30)
            row["rel_diff"] = ((o_new.float() - o_abs.float()).abs().max() / scale).item()
            del o_new, o_abs
            for k, call in (("expanded", lambda: expanded(mla, q, lat, prefix)),
                            ("absorbed", lambda: absorbed(mla, q, joined))):
                sec, gib = measured(call)
                row.setdefault("forward_s", {})[k] = sec
                row.setdefault("forward_peak_gib", {})[k] = gib
        for k in ("expanded", "absorbed"):
            sec, gib = measured(lambda k=k: fb(k))
            row.setdefault("forward_backward_s", {})[k] = sec
            row.setdefault("forward_backward_peak_gib", {})[k] = gib
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--segment", type=int, default=8192)
    ap.add_argument("--prefixes", default="262144,1040384", help="earlier tokens, comma-separated")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (float32)")
    a = ap.parse_args()
    cfg = json.loads(Path("recipes/kimi-linear-48b-a3b-instruct/config.json").read_text())
    spec = from_hf_config(cfg)
    T, prefixes = a.segment, [int(p) for p in a.prefixes.split(",")]
    if a.smoke:
        spec = spec.__class__(**{**spec.__dict__, "num_attention_heads": 4})
        T, prefixes = 16, [32, 64]
    torch.manual_seed(0)
    mla = MultiLatentAttention(spec).to(DEV)
    dt = torch.bfloat16 if DEV == "cuda" else torch.float32
    Hh, Dq, C = spec.num_attention_heads, spec.qk_head_dim, spec.kv_lora_rank + spec.qk_rope_head_dim
    meta = {"gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"), "segment": T, "heads": Hh, "qk_dim": Dq, "latent": C,
            "command": "python benchmarks/kernels/mla_segment_gpu.py --segment {} --prefixes {}{}".format(
                a.segment, a.prefixes, " --smoke" if a.smoke else "")}
    rows = []
    for S0 in prefixes:
        row = measure(mla, T, S0, dt)
        rows.append(row)
        print(json.dumps(row), flush=True)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

"""Expert-parallel dispatch (``parallel.expert.EPDispatch``) against the one-process experts, float64, gloo.

Each of P ranks holds E / P experts and its own tokens; the reference is the full ``Experts`` module on
every rank's tokens together. Output, and the gradients of the tokens, the routing weights and every
expert weight, must equal the reference to 1e-10, for the three dispatch modes and four routings:
balanced, 95% of tokens to expert 0, every token to the experts of rank 0 (adversarial), and the routing
of a tiny model's router on a window of the lambda phage genome (shipped with megaseq). The skewed
routings make LLEP spill experts to other ranks, so their weights travel and their gradients come back.

Broken variants that must fail: a spilled expert's weight gradient not sent back to its native rank, and
a chunking in which one token sits in two chunks (and another in none).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megaseq.config import ExpertDispatchSettings
from megaseq.models.common.moe import Experts
from megaseq.models.presets import get_preset
from megaseq.parallel.expert import EPDispatch, shard_experts
from megaseq.parallel.expert_route import strided_order
from megaseq.parallel.launch import spawn_local

SPEC = get_preset("glm5-flash-tiny")  # E 8, K 2, H 64, I 32
E, K, H, I = SPEC.num_experts, SPEC.num_experts_per_tok, SPEC.hidden_size, SPEC.moe_intermediate_size
N = 37  # tokens per rank (odd: uneven chunks)
TOL = dict(atol=1e-10, rtol=1e-10)
SETTINGS = {  # tiny chunks and spill minimum so that the tiny case chunks and spills
    mode: ExpertDispatchSettings(mode=mode, chunk_tokens=8, max_chunks=4, alpha=1.1, threshold=1.3, min_tokens=2)
    for mode in ("plain", "llep", "pipelined_llep")
}


def make_experts() -> Experts:
    torch.manual_seed(0)
    return Experts(E, H, I, SPEC.swiglu_limit).double()


def distinct_topk(scores: torch.Tensor) -> torch.Tensor:
    return torch.topk(scores, K, dim=-1).indices


def routing(kind: str, P: int) -> torch.Tensor:
    """``[P * N, K]`` expert ids for every rank's tokens."""
    g = torch.Generator().manual_seed(11)
    scores = torch.rand(P * N, E, generator=g, dtype=torch.float64)
    if kind == "skew95":  # expert 0 among the chosen of 95% of the tokens
        chosen = torch.rand(P * N, generator=g) < 0.95
        scores[chosen, 0] = 2.0
        scores[~chosen, 0] = -1.0
    elif kind == "one_gpu":  # only rank 0's experts: every row goes to one GPU under plain EP
        scores[:, E // P:] -= 2.0
    elif kind == "genome":
        return genome_routing(P)
    return distinct_topk(scores)


def genome_routing(P: int) -> torch.Tensor:
    """The first MoE layer's router of the tiny model on ``P * N`` bases of lambda phage."""
    from megaseq.data.fasta import default_genome_path, read_fasta
    from megaseq.models.build import build_model

    ids = torch.from_numpy(read_fasta(default_genome_path())[0].tokens[1000:1000 + P * N].astype("int64"))
    model = build_model(SPEC, dtype=torch.float64, seed=0)
    moe = model.layers[1].mlp
    captured = {}
    route = moe.gate.route  # (weights_NK, experts_NK, probs_NE): what MoE.forward calls

    def capture(x_NH: torch.Tensor):
        out = route(x_NH)
        captured.update(experts=out[1])
        return out

    moe.gate.route = capture
    with torch.no_grad():
        model(ids.unsqueeze(0))
    return captured["experts"]


def reference(kind: str, P: int) -> dict[str, torch.Tensor]:
    experts = make_experts()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(P * N, H, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.rand(P * N, K, generator=g, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(P * N, H, generator=g, dtype=torch.float64)
    idx = routing(kind, P)
    out, _ = experts(x, idx, w)
    (out * grad_out).sum().backward()
    return {"x": x.detach(), "w": w.detach(), "idx": idx, "grad_out": grad_out, "out": out.detach(),
            "gx": x.grad, "gw": w.grad, "g_gate_up": experts.gate_up_proj.grad, "g_down": experts.down_proj.grad}


def load_of_busiest_gpu(idx: torch.Tensor, P: int) -> float:
    per_gpu = torch.bincount(idx.reshape(-1) // (E // P), minlength=P).double()
    return float(per_gpu.max() / per_gpu.mean())


class LostWeightGrads(EPDispatch):
    """Broken: the helpers keep the spilled experts' gradients."""

    def return_weight_grads(self, route, g_foreign, g_gate_up, g_down) -> None:
        return None


class OverlappingChunks(EPDispatch):
    """Broken: token 1's slot holds token 0 again, so token 0 is in two chunks and token 1 in none."""

    def token_order(self, n, num, device):
        order, chunks = strided_order(n, num, device)
        order = order.clone()
        order[order == 1] = 0
        return order, chunks


DISPATCH = {"ok": EPDispatch, "lost_grads": LostWeightGrads, "overlap": OverlappingChunks}


def _check(rank: int, P: int, mode: str, ref: dict, variant: str) -> tuple[bool, int, list[str]]:
    """One case on this rank: (all equal, spilled experts received here, what differs)."""
    experts = make_experts()
    shard_experts(experts, P, rank)
    d = DISPATCH[variant](group=dist.group.WORLD, ep=P, rank=rank, settings=SETTINGS[mode])
    mine = slice(rank * N, (rank + 1) * N)
    x = ref["x"][mine].clone().requires_grad_(True)
    w = ref["w"][mine].clone().requires_grad_(True)
    out, counts = d(experts, x, ref["idx"][mine], w)
    (out * ref["grad_out"][mine]).sum().backward()
    assert counts.tolist() == torch.bincount(ref["idx"][mine].reshape(-1), minlength=E).tolist()
    held = slice(experts.held.start, experts.held.stop)
    pairs = [("out", out.detach(), ref["out"][mine]), ("grad x", x.grad, ref["gx"][mine]),
             ("grad weights", w.grad, ref["gw"][mine]),
             ("grad gate_up", experts.gate_up_proj.grad, ref["g_gate_up"][held]),
             ("grad down", experts.down_proj.grad, ref["g_down"][held])]
    bad = [n for n, a, b in pairs if not torch.allclose(a, b, **TOL)]
    return not bad, d.last["foreign_experts"], bad


def _rank(rank: int, P: int, cases: list[tuple[str, str, str, bool]], refs: dict) -> None:
    """Every case ``(mode, routing, variant, spills)`` in one process group."""
    dist.init_process_group("gloo")
    try:
        for mode, kind, variant, spills in cases:
            ok, foreign, bad = _check(rank, P, mode, refs[kind], variant)
            oks, foreigns = _gathered(int(ok)), _gathered(foreign)
            case = f"ep {P}, {mode}, {kind} routing, {variant}"
            if variant == "ok":
                assert all(oks), f"{case}: rank {rank} differs in {bad}"
                assert (sum(foreigns) > 0) == spills, f"{case}: spilled experts {foreigns}, expected spills={spills}"
            else:
                assert not all(oks), f"{case}: the broken variant passed"
    finally:
        dist.destroy_process_group()


def _gathered(v: int) -> list[int]:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, v)
    return out


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py
KINDS = ("balanced", "skew95", "one_gpu", "genome")
MODES = ("plain", "llep", "pipelined_llep")


@pytest.mark.parametrize("P", [2, 4])
def test_dispatch_equals_one_process(P):
    """Every mode x routing at ep = P; LLEP must spill exactly where the busiest GPU exceeds the threshold."""
    refs = {kind: reference(kind, P) for kind in KINDS}
    cases = []
    for mode in MODES:
        for kind in KINDS:
            spills = mode != "plain" and load_of_busiest_gpu(refs[kind]["idx"], P) > SETTINGS[mode].threshold
            cases.append((mode, kind, "ok", spills))
    assert any(c[3] for c in cases) and not all(c[3] for c in cases)  # both regimes are exercised
    spawn_local(_rank, P, args=(P, cases, refs))


def test_broken_variants_fail():
    """A spilled expert's weight gradient kept by its helper, and a token in two chunks, are caught."""
    P = 2
    refs = {"skew95": reference("skew95", P)}
    cases = [("llep", "skew95", "lost_grads", True), ("pipelined_llep", "skew95", "lost_grads", True),
             ("pipelined_llep", "skew95", "overlap", True)]
    spawn_local(_rank, P, args=(P, cases, refs))

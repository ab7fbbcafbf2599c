"""Properties of the LLEP plan and PipelinedLLEP's chunking (``parallel/llep.py``), on seeded random and adversarial
expert loads: every row served exactly once, the cap respected by every GPU that takes a spill (by every GPU
when pieces of one row may spill), no spilled piece under the minimum, the busiest GPU never busier than
without LLEP, and LLEP only above its threshold. A hand-made plan breaking each property must be caught by
the same checks."""

from __future__ import annotations

import random

import pytest

from megaseq.parallel.llep import (
    ExpertPlan,
    chunk_capacity,
    chunk_sizes,
    dispatch_buffer_bound,
    imbalance,
    llep_plan,
    native_loads,
    num_chunks,
    plan_experts,
    source_pieces,
)


def random_loads(rng: random.Random, E: int, kind: str) -> list[int]:
    if kind == "uniform":
        return [rng.randint(0, 200) for _ in range(E)]
    if kind == "zipf":  # a few hot experts, as on real long-context data
        return [int(2000 / (1 + rng.random() * E) ** 1.2) for _ in range(E)]
    if kind == "one_expert":
        return [5000 if e == rng.randrange(E) else rng.randint(0, 3) for e in range(E)]
    if kind == "one_gpu":  # everything on the first GPU's experts
        return [rng.randint(100, 900) if e < 4 else 0 for e in range(E)]
    return [0] * E


def served_once(plan: ExpertPlan, loads: list[int]) -> str | None:
    for e, pieces in enumerate(plan.pieces):
        if sum(n for _, n in pieces) != loads[e] or any(n <= 0 for _, n in pieces):
            return f"expert {e}: pieces {pieces} do not serve its {loads[e]} rows once"
        if len({g for g, _ in pieces}) != len(pieces):
            return f"expert {e}: one GPU holds two pieces"
    return None


def cap_respected(plan: ExpertPlan, min_tokens: int) -> str | None:
    loads = plan.gpu_loads()
    takers = {g for _, _, g in plan.transfers()}
    for g in takers:
        if loads[g] > plan.cap:
            return f"GPU {g} took a spill and ends at {loads[g]} > cap {plan.cap}"
    if min_tokens == 1 and max(loads) > plan.cap:
        return f"with min_tokens 1 every GPU must fit the cap: {loads} > {plan.cap}"
    return None


def pieces_big_enough(plan: ExpertPlan, min_tokens: int) -> str | None:
    for e, pieces in enumerate(plan.pieces):
        for g, n in pieces:
            if g != plan.home(e) and n < min_tokens:
                return f"expert {e}: a piece of {n} < {min_tokens} rows spilled to GPU {g}"
    return None


def check(plan: ExpertPlan, loads: list[int], ep: int, min_tokens: int) -> list[str]:
    errors = [served_once(plan, loads), cap_respected(plan, min_tokens), pieces_big_enough(plan, min_tokens)]
    if max(plan.gpu_loads()) > max(native_loads(loads, ep)):
        errors.append(f"busiest GPU {max(plan.gpu_loads())} > without LLEP {max(native_loads(loads, ep))}")
    return [e for e in errors if e]


@pytest.mark.parametrize("ep", [2, 4, 8])
@pytest.mark.parametrize("kind", ["uniform", "zipf", "one_expert", "one_gpu", "zero"])
@pytest.mark.parametrize("min_tokens", [1, 64])
def test_llep_plan_properties(ep, kind, min_tokens):
    rng = random.Random(f"{ep}-{kind}-{min_tokens}")
    for trial in range(40):
        E = ep * rng.choice([1, 2, 3, 4])
        loads = random_loads(rng, E, kind)
        alpha = rng.choice([1.0, 1.1, 1.3])
        plan = llep_plan(loads, ep, alpha, min_tokens)
        assert not check(plan, loads, ep, min_tokens), (trial, loads, alpha, check(plan, loads, ep, min_tokens))
        assert plan.cap >= sum(loads) / ep * alpha - 1e-9


@pytest.mark.parametrize("threshold", [1.1, 1.3, 2.0])
def test_llep_only_above_threshold(threshold):
    rng = random.Random(threshold)
    seen = {False: 0, True: 0}
    for _ in range(200):
        ep = rng.choice([2, 4])
        loads = random_loads(rng, 4 * ep, rng.choice(["uniform", "zipf", "one_gpu"]))
        plan = plan_experts(loads, ep, 1.05, threshold, 1)
        above = imbalance(loads, ep) > threshold
        assert plan.balanced == above
        if not above:
            assert plan.transfers() == [] and plan.gpu_loads() == native_loads(loads, ep)
        seen[above] += 1
    assert seen[False] and seen[True]  # both sides of the threshold were drawn


def test_the_checks_catch_broken_plans():
    loads, ep = [900, 10, 10, 10, 50, 50, 50, 50], 2
    good = llep_plan(loads, ep, 1.1, 8)
    assert not check(good, loads, ep, 8) and good.transfers()
    lost = ExpertPlan(pieces=((good.pieces[0][0],),) + good.pieces[1:], ep=ep, cap=good.cap, balanced=True)
    assert served_once(lost, loads)  # the spilled rows dropped
    over = ExpertPlan(pieces=(((0, 100), (1, 800)),) + good.pieces[1:], ep=ep, cap=good.cap, balanced=True)
    assert cap_respected(over, 8)  # the helper pushed over the cap
    tiny = ExpertPlan(pieces=(((0, 897), (1, 3)),) + good.pieces[1:], ep=ep, cap=good.cap, balanced=True)
    assert pieces_big_enough(tiny, 8)


def test_source_pieces_cut_each_experts_order():
    rng = random.Random(3)
    P, E = 4, 8
    counts = [[rng.randint(0, 40) for _ in range(E)] for _ in range(P)]
    counts[2][0] = 400  # one hot expert on one source
    loads = [sum(c[e] for c in counts) for e in range(E)]
    plan = llep_plan(loads, P, 1.1, 4)
    per_source = source_pieces(counts, plan)
    for e in range(E):
        for s in range(P):
            assert sum(n for _, n in per_source[s][e]) == counts[s][e]
        for g in range(P):
            want = sum(n for h, n in plan.pieces[e] if h == g)
            assert sum(n for s in range(P) for h, n in per_source[s][e] if h == g) == want


@pytest.mark.parametrize("N, c, K_max", [(1, 8, 4), (37, 8, 4), (65536, 8192, 32), (1 << 20, 8192, 32),
                                         (100, 1000, 4), (0, 8, 4)])
def test_chunking(N, c, K_max):
    K, c_eff = num_chunks(N, c, K_max), chunk_capacity(N, c, K_max)
    assert K == max(1, min(-(-N // c), K_max))
    sizes = chunk_sizes(N, K)
    assert sum(sizes) == N and max(sizes) <= c_eff and max(sizes) - min(sizes) <= 1
    if -(-N // c) <= K_max:
        assert c_eff <= c  # the cap on chunks did not bind
    assert dispatch_buffer_bound(4, 8, c_eff, 4096, 2) == 2 * 4 * 8 * c_eff * 4096 * 2

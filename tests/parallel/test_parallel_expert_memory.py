"""The dispatch's bytes measured from the tensors it allocates (``MemTracker``, CPU, 4 gloo ranks) under routings
from even to adversarial: PipelinedLLEP's stay under the planner's bound-based figure whatever the routing
(with LLEP off too: the chunks alone bound it, the busiest rank receiving exactly the bound's rows when
every token picks its experts), while plain EP's grow with the rows its busiest GPU receives. The
measuring code is ``benchmarks/parallel/ep_dispatch_memory.py``'s (which writes the full table)."""

from __future__ import annotations

import pytest

import bench_scripts


def _bench():
    return bench_scripts.load("parallel/ep_dispatch_memory", "ep_dispatch_memory")


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def test_pipelined_dispatch_bounded_plain_grows():
    bench = _bench()
    cases = [(kind, "plain") for kind in ("balanced", "skew95", "one_gpu")]
    cases += [("one_gpu", "pipelined"), ("balanced", "pipelined_llep"), ("one_gpu", "pipelined_llep")]
    rows = {(r["routing"], r["mode"]): r for r in bench.measure(bench.SMOKE, cases)}
    for (kind, mode), r in rows.items():
        if mode == "plain":
            continue
        assert r["max_rows_in"] <= r["rows_in_bound"], (kind, mode, r)
        assert r["peak_bytes"] <= r["planned_bytes"], (kind, mode, r)  # within the bound whatever the routing
    adversarial = rows[("one_gpu", "pipelined")]
    assert adversarial["max_rows_in"] == adversarial["rows_in_bound"]  # the bound is reached, and holds
    assert rows[("one_gpu", "pipelined_llep")]["spilled_experts"] > 0
    plain = [rows[(k, "plain")]["peak_bytes"] for k in ("balanced", "skew95", "one_gpu")]
    assert plain[0] < plain[1] < plain[2]  # plain EP grows with the imbalance ...
    assert plain[2] > rows[("one_gpu", "pipelined_llep")]["planned_bytes"]  # ... past the pipelined bound
    assert plain[2] > 2 * rows[("one_gpu", "pipelined_llep")]["peak_bytes"]

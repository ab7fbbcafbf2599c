"""``benchmarks/long_context/indexer_objective_cost.py`` measures each row in a process of its own: in one process
the second row's peak counted what the first left allocated on the GPU (3.3 GiB at 32K on an H100; at 1M the second
row ran out of memory where the same run alone peaked at 53 GiB). Here the processes are stood in for: each row is
its own ``--row`` call, and a process that writes no row is an error row with its exit status."""

from __future__ import annotations

import json
import sys

import bench_scripts


def test_each_row_runs_in_a_process_of_its_own(tmp_path, monkeypatch):
    cost = bench_scripts.load("long_context/indexer_objective_cost")
    calls = []

    def call(argv):
        calls.append(argv)
        name = argv[argv.index("--row") + 1]
        if name == "without":  # the other row's process dies without writing its row
            out = argv[argv.index("--row-out") + 1]
            with open(out, "w") as f:
                json.dump({"name": name, "status": "ok", "step_s": 1.0}, f)
            return 0
        return -9

    monkeypatch.setattr(cost.subprocess, "call", call)
    monkeypatch.setattr(sys, "argv", ["indexer_objective_cost.py", "--seq-len", "2K"])
    rows = {name: cost.row_in_own_process(name) for name in ("without", "with_objective")}
    assert [c[0] for c in calls] == [sys.executable] * 2 and all(c[1] == cost.__file__ for c in calls)
    assert [c[c.index("--row") + 1] for c in calls] == ["without", "with_objective"]
    assert all(c[2:4] == ["--seq-len", "2K"] for c in calls)  # the script's own arguments passed on
    assert rows["without"] == {"name": "without", "status": "ok", "step_s": 1.0}
    assert rows["with_objective"]["status"] == "error" and "exit status -9" in rows["with_objective"]["error"]

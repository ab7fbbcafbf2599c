"""benchmarks/memory/saved_by_layer.py runs end to end on the CPU (a smoke run: every memory read is 0) and reports
each layer's saved storages by op, every phase mark, and the planner's figures beside them."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import bench_scripts

ROOT = Path(__file__).resolve().parents[2]


def test_saved_by_layer_smoke(tmp_path, monkeypatch):
    for name in ("synchronize", "reset_peak_memory_stats", "memory_allocated", "max_memory_allocated",
                 "get_device_name"):  # the script stubs these without CUDA: restored after the test
        monkeypatch.setattr(torch.cuda, name, getattr(torch.cuda, name))
    bench = bench_scripts.load("memory/saved_by_layer")
    out = tmp_path / "saved.json"
    assert bench.main([str(ROOT / "recipes" / "glm5-flash-tiny-dna.yaml"), "--seq-len", "256", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["layer"] for r in res["layers"]] == list(range(8))
    for r in res["layers"]:
        assert r["saved_gib"] > 0 and r["planned_saved_gib"] > 0 and r["planned_backward_peak_gib"] > 0
        assert sum(r["saved_by_op_gib"].values()) == r["saved_gib"]
        assert ("sparse_attention" in r["saved_by_op_gib"]) == r["kind"].startswith("dsa")
        assert r["backward_peak_gib"] is not None  # both marks of each layer's backward were hit
    assert set(res["phases"]) == {"forward", "loss", "backward", "optimizer step"}
    marks = [m["mark"] for m in res["marks"]]
    assert marks[:3] == ["start", "forward done", "loss done"] and marks[-1] == "step done"
    assert res["planned_peak_gib"] == max(v["planned_gib"] for v in res["phases"].values())

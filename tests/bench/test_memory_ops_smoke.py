"""benchmarks/memory/memory_ops.py (each op's allocation in one training step) runs on a tiny CPU model and records
the whole step: forward, the replayed layers and the backward, with the planner's terms beside it."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_memory_ops_smoke(tmp_path):
    out = tmp_path / "ops.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/memory/memory_ops.py"), "recipes/qwen3-30b-a3b-lora.yaml", "512",
           "--model.name", "qwen3-moe-tiny", "--model.dtype", "fp32", "--memory.auto", "false",
           "--memory.recompute", "true", "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=300)
    res = json.loads(out.read_text())
    rows = [json.loads(line) for line in gzip.open(out.with_suffix(".trace.jsonl.gz"), "rt")]
    assert res["ops"] == len(rows) > 100
    modules = {r["module"] for r in rows}
    assert "layers.0.self_attn.q_norm" in modules and "norm" in modules  # the layers and the final norm ran
    ops = {r["op"] for r in rows}
    assert any("mm" in o for o in ops) and any("embedding" in o for o in ops)
    assert res["planned_layer_terms_gib"][0]["attn"] and res["planned_phases_gib"]["backward"] > 0

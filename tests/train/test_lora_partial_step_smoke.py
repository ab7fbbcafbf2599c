"""benchmarks/lora/lora_partial_step.py (the peak of a long LoRA step within one device call: the whole forward,
the loss and the last layers' backward) runs on a tiny CPU model: it stops where it says, the last layers'
adapters have gradients, and the unreached ones are counted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_lora_partial_step_smoke(tmp_path):
    out = tmp_path / "partial.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/lora/lora_partial_step.py"), "1K", "--smoke", "--warm-tokens", "128",
           "--backward-layers", "1", "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=300)
    row = json.loads(out.read_text())
    n = row["layers"]
    assert row["stopped"] == f"stopped at the recompute of layer {n - 2}", row["stopped"]
    assert row["backward_layers_run"] == 1 and len(row["grads_in_last_layers"]) == 1
    assert row["grads_in_last_layers"][0] > 0  # the last layer's adapters got their gradients
    assert row["unreached_grad_gib"] > 0  # the other layers' adapters did not, and are counted
    assert row["fixes"] == ["recompute"] and row["seq_len"] == 1024

"""A published config.json cut to its first N decoder layers (the same shapes): how the H200 benchmarks
measure a real model at lengths where a step of all its layers outlasts a device call.

    python benchmarks/lora/truncated_config.py recipes/qwen3-30b-a3b/config.json 4 /tmp/q4  # writes /tmp/q4/config.json
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path


def truncated_config(src: str | Path, layers: int, out_dir: str | Path | None = None) -> tuple[Path, int]:
    """``(path of the written config.json, the source's layer count)``; ``out_dir`` None: a new temp dir."""
    hf = json.loads(Path(src).read_text())
    full = hf["num_hidden_layers"]
    if not 0 < layers <= full:
        raise SystemExit(f"{layers} layers: {src} has {full} decoder layers")
    hf["num_hidden_layers"] = layers
    if "max_window_layers" in hf:
        hf["max_window_layers"] = min(hf["max_window_layers"], layers)
    for key, kept in (hf.get("linear_attn_config") or {}).items():  # Kimi-Linear: layers numbered from 1
        if key.endswith("_layers") and isinstance(kept, list):
            hf["linear_attn_config"][key] = [i for i in kept if i <= layers]
    if isinstance(hf.get("layer_types"), list):
        hf["layer_types"] = hf["layer_types"][:layers]
    dst = Path(out_dir or tempfile.mkdtemp(prefix="truncated_")) / "config.json"
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(json.dumps(hf))
    return dst, full


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    print(truncated_config(sys.argv[1], int(sys.argv[2]), sys.argv[3])[0])

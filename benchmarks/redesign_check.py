"""Behaviour before and after a redesign: fixed-seed loss curves and the plan of every recipe.

    python benchmarks/redesign_check.py record benchmarks/results/redesign/before.json
    python benchmarks/redesign_check.py record /tmp/after.json
    python benchmarks/redesign_check.py compare benchmarks/results/redesign/before.json /tmp/after.json

``record`` runs, through the ``megaseq`` command (so the script outlives any internal API), the default
job's model and data (glm5-flash-tiny on phage lambda, fp32, CPU) for a few steps with fixed seeds:

- ``none``: every memory scheme off (``memory.auto false``);
- ``layer_schemes``: chunked loss, tiled MLP (the token-tiled GLM-5 layer), indexer query chunks, full
  recompute + SCO, segmented KDA and OffloadStreamAdamW all forced;
- ``segments``: chunked loss, tiled MLP, indexer chunks, sequence segments with kept selections and
  OffloadStreamAdamW forced;

and ``megaseq plan --json`` for every recipe at 8K, 128K and 1M. ``compare`` reports the largest
relative loss difference per run (bitwise where the order of operations is unchanged) and every plan
field that differs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = 8
FORCED = {
    "none": [],
    "layer_schemes": ["chunked_loss=true", "loss_chunk_tokens=256", "tiled_mlp=true", "mlp_tile_tokens=384",
                      "indexer_query_chunk=96", "recompute=true", "checkpoint_offload=true",
                      "offload_host_budget=8M", "kda_segment_tokens=640", "optimizer_offload=true",
                      "optimizer_bucket_params=20K"],
    "segments": ["chunked_loss=true", "loss_chunk_tokens=256", "tiled_mlp=true", "mlp_tile_tokens=384",
                 "indexer_query_chunk=96", "model_segment_tokens=512", "segment_keep_selection=true",
                 "optimizer_offload=true", "optimizer_bucket_params=20K"],
}
PLAN_LENGTHS = ("8K", "128K", "1M")


def _megaseq(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megaseq", *args], capture_output=True, text=True, cwd=ROOT)


def losses(name: str, settings: list[str]) -> list[float]:
    """The loss of every step, then the gradient norm of every step."""
    with tempfile.TemporaryDirectory() as tmp:
        args = ["train", "--train.steps", str(STEPS), "--train.run_dir", f"{tmp}/run", "--train.eval_after",
                "false", "--train.export_hf", "false", "--log.progress", "false", "--log.tensorboard", "false",
                "--memory.auto", "false", *[f"--memory.{s}" for s in settings]]
        done = _megaseq(*args)
        if done.returncode:
            raise SystemExit(f"{name}: megaseq train failed:\n{done.stderr[-3000:]}")
        rows = [json.loads(line) for line in Path(f"{tmp}/run/metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows] + [r["grad_norm"] for r in rows]


def plans() -> dict[str, dict]:
    out = {}
    for recipe in sorted((ROOT / "recipes").glob("*.yaml")):
        for length in PLAN_LENGTHS:
            done = _megaseq("plan", str(recipe), "--seq-len", length, "--json")
            key = f"{recipe.stem}@{length}"
            out[key] = json.loads(done.stdout) if done.stdout.strip().startswith("{") else {"error": done.stderr}
    return out


def record(path: Path) -> None:
    result = {"losses": {name: losses(name, s) for name, s in FORCED.items()}, "plans": plans()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"wrote {path}")


def _diff(a, b, where: str, out: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            _diff(a.get(k), b.get(k), f"{where}.{k}", out)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _diff(x, y, f"{where}[{i}]", out)
    elif a != b:
        out.append(f"{where}: {a!r} -> {b!r}")


def compare(before: Path, after: Path) -> int:
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    bad = 0
    for name, old in a["losses"].items():
        new = b["losses"].get(name, [])
        rel = max((abs(x - y) / abs(x) for x, y in zip(old, new)), default=float("inf"))
        same = old == new
        ok = len(old) == len(new) and rel <= 1e-6
        bad += not ok
        print(f"loss curve {name:<14} {'bitwise' if same else f'max rel diff {rel:.2e}'} {'ok' if ok else 'DIFFERS'}")
    diffs: list[str] = []
    _diff(a["plans"], b["plans"], "plans", diffs)
    print(f"plans: {len(a['plans'])} recipe x length, {len(diffs)} differing fields")
    for d in diffs[:40]:
        print("  " + d)
    return 1 if bad or diffs else 0


if __name__ == "__main__":
    verb = sys.argv[1] if len(sys.argv) > 1 else ""
    if verb == "record" and len(sys.argv) == 3:
        record(Path(sys.argv[2]))
    elif verb == "compare" and len(sys.argv) == 4:
        sys.exit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
    else:
        raise SystemExit(__doc__)

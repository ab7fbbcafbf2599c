"""Fixed-seed fingerprints of behaviour: short loss curves and ``megaseq plan --json`` for every recipe.

    PYTHONPATH=src python benchmarks/memory/fingerprints.py benchmarks/results/fingerprints/NAME.json
    python benchmarks/memory/fingerprints.py --compare A.json B.json

The curves: the default job (3 steps), glm5-flash-tiny with no memory scheme, with every per-layer scheme
forced (chunked loss, tiled MLP, indexer query chunk, segmented KDA, recompute + SCO, the offloaded optimizer)
and with sequence segments (plus the chunked loss and the offloaded optimizer), and a LoRA run of
qwen3-moe-tiny; all on the CPU in fp32. The plans: every recipe (YAML and config.json) at 8K, 128K and 1M.
A refactor that must not change behaviour compares two such files with ``--compare`` (losses bitwise,
plans equal)."""

from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
QUIET = {"train.eval_after": False, "train.export_hf": False, "train.eval_every": 0, "log.progress": False,
         "log.tensorboard": False}
TINY = {"model.name": "glm5-flash-tiny", "model.dtype": "fp32", "data.seq_len": 256, "train.steps": 3,
        "moe.seq_aux_loss_coef": 0.0}
NONE = {"memory.auto": False}
PER_LAYER = {**NONE, "memory.chunked_loss": True, "memory.loss_chunk_tokens": 96, "memory.tiled_mlp": True,
             "memory.mlp_tile_tokens": 64, "memory.indexer_query_chunk": 48, "memory.kda_segment_tokens": 80,
             "memory.recompute": True, "memory.checkpoint_offload": True, "memory.optimizer_offload": True}
SEGMENTS = {**NONE, "memory.model_segment_tokens": 128, "memory.chunked_loss": True,
            "memory.loss_chunk_tokens": 96, "memory.optimizer_offload": True}
LORA = {"model.name": "qwen3-moe-tiny", "model.dtype": "fp32", "data.seq_len": 128, "train.steps": 3,
        "lora.rank": 4, "lora.alpha": 8.0, "lora.targets": ["q_proj", "v_proj", "experts"],
        "train.trainable": ["norm.weight"], "moe.seq_aux_loss_coef": 0.0}
RUNS = {"default": {"train.steps": 3}, "glm5_none": {**TINY, **NONE}, "glm5_per_layer": {**TINY, **PER_LAYER},
        "glm5_segments": {**TINY, **SEGMENTS}, "lora": LORA}
LENGTHS = ("8K", "128K", "1M")


def curves() -> dict[str, list[float]]:
    import torch

    from megaseq.config import default_recipe, load_config
    from megaseq.train.trainer import run_training

    torch.set_num_threads(1)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in RUNS.items():
            cfg = load_config(default_recipe(), {**QUIET, **overrides, "train.run_dir": f"{tmp}/{name}"})
            out[name] = [float(x) for x in run_training(cfg).losses]
            print(name, out[name], file=sys.stderr)
    return out


def recipes() -> list[str]:
    found = sorted(ROOT.glob("recipes/*.yaml")) + sorted(ROOT.glob("recipes/*/config.json"))
    return [str(p.relative_to(ROOT)) for p in found]


def plans() -> dict[str, object]:
    from megaseq.cli.main import main

    out = {}
    for recipe in recipes():
        for length in LENGTHS:
            stdout, stderr = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                rc = main(["plan", str(ROOT / recipe), "--seq-len", length, "--json"])
            key = f"{recipe}@{length}"
            out[key] = {"rc": rc, "plan": json.loads(stdout.getvalue()) if stdout.getvalue() else None,
                        "error": stderr.getvalue().replace(str(ROOT), ".")}
    return out


def compare(a_path: str, b_path: str) -> int:
    """Losses bitwise (else the largest relative difference), plans key by key; prints what differs."""
    a, b = (json.loads(Path(p).read_text()) for p in (a_path, b_path))
    bad = 0
    for name in sorted(set(a["curves"]) | set(b["curves"])):
        x, y = a["curves"].get(name), b["curves"].get(name)
        if x == y:
            print(f"curve {name}: bitwise equal")
            continue
        rel = max(abs(p - q) / max(abs(p), 1e-30) for p, q in zip(x or [], y or [])) if x and y else None
        print(f"curve {name}: DIFFERS (max relative {rel})")
        bad += 1
    for key in sorted(set(a["plans"]) | set(b["plans"])):
        if a["plans"].get(key) != b["plans"].get(key):
            print(f"plan {key}: DIFFERS")
            for path, (p, q) in _diff(a["plans"].get(key), b["plans"].get(key)):
                print(f"    {path}: {p!r} -> {q!r}")
            bad += 1
    print(f"{bad} differences")
    return 1 if bad else 0


def _diff(p: object, q: object, path: str = "") -> list[tuple[str, tuple[object, object]]]:
    if isinstance(p, dict) and isinstance(q, dict):
        return [d for k in sorted(set(p) | set(q), key=str) for d in _diff(p.get(k), q.get(k), f"{path}.{k}")]
    return [] if p == q else [(path, (p, q))]


def main(argv: list[str]) -> int:
    if argv[:1] == ["--compare"]:
        return compare(argv[1], argv[2])
    out = Path(argv[0])
    result = {"plans": plans(), "curves": curves()}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, sort_keys=True))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

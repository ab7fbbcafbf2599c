"""Does a trained model copy from the relatives in a window? Bits per base by region, training vs held-out windows.

    python benchmarks/long_context/related_copy_probe.py RUN_DIR [--windows 8] [--out OUT/copy_probe]

For a run trained on related windows (``data.related``): the run's weights (``RUN/hf``) score ``--windows``
fresh training windows (the run's sampler, a seed it did not train with) and the held-out windows after
relatives, and report the bits per base of each region (region 1 has nothing to copy from; regions 2.. have
the homologous regions of other strains before them), beside a copy oracle (the base after the latest earlier
occurrence of the preceding 12-mer in the window: its accuracy and how many positions it covers). A model that
copies has regions 2.. far below region 1 on both kinds of window. ``--layouts 3,4``: the held-out windows also
laid out as that many equal regions (the relatives, then the held-out region), so that a copy that works in one
layout only (a fixed offset learned from equal region lengths) shows. Results: OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from megaseq.config import build_config  # noqa: E402


def oracle(w: np.ndarray, lo: int, hi: int, k: int = 12) -> tuple[float, float]:
    """(accuracy where it predicts, coverage) of the in-window k-mer copy oracle on targets lo..hi-1."""
    last: dict[bytes, int] = {}
    hit = cov = 0
    for t in range(k, hi):
        key = w[t - k:t].tobytes()
        if t >= lo and key in last:
            cov += 1
            hit += int(w[last[key]] == w[t])
        last[key] = t
    n = max(hi - max(lo, k), 1)
    return hit / max(cov, 1), cov / n


def regions(w: np.ndarray, sep: int) -> list[tuple[int, int]]:
    """Target index ranges [lo, hi) of each separator-delimited region of window ``w``."""
    cuts = [0] + [i + 1 for i in np.flatnonzero(w == sep).tolist()] + [len(w)]
    return [(a, b) for a, b in zip(cuts[:-1], cuts[1:]) if b - a > 16]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--layouts", default="", help="comma-separated region counts for the held-out windows, e.g. 3,4")
    p.add_argument("--out", type=Path, default=Path("copy_probe"))
    a = p.parse_args()
    from megaseq.data import build_data
    from megaseq.data.related import RelatedWindowSampler
    from megaseq.data.tokenizer import SEP_ID
    from megaseq.data.windows import make_batch
    from megaseq.eval.loss import per_token_loss_fn
    from megaseq.models.build import build_model
    from megaseq.models.hf_io import load_hf_checkpoint
    from megaseq.models.spec import from_hf_config
    from megaseq.parallel.env import ParallelEnv

    cfg = build_config(yaml.safe_load((a.run_dir / "config.yaml").read_text()))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hf = a.run_dir / "hf"
    spec = from_hf_config(hf)
    model = build_model(spec, dtype=torch.float32, device="cpu")
    load_hf_checkpoint(hf, model=model, spec=spec)
    model = model.to(device).eval()
    autocast = torch.bfloat16 if device.type == "cuda" else None
    fn = per_token_loss_fn(model, ParallelEnv(device), autocast, 8192)
    data = build_data(cfg.data, cfg.eval, batch_size=1, vocab_size=spec.vocab_size)
    sampler = data.train
    assert isinstance(sampler, RelatedWindowSampler), "the run did not train on related windows"
    sampler.seed += 12345  # windows it never trained on
    kinds = {"training windows (fresh)": [sampler.tokens(n) for n in range(a.windows)]}
    for name, ws in data.heldout.items():
        if "relatives" in name:
            kinds[name] = [np.asarray(w.tokens) for w in ws[:a.windows]]
    if a.layouts:
        from megaseq.data.fasta import load_dna_split
        from megaseq.data.related import Strains, heldout_related_windows

        split = load_dna_split(cfg.data)
        strains = Strains(split.train)
        for n in map(int, a.layouts.split(",")):
            for name, recs in split.heldout.items():
                ws, _ = heldout_related_windows(recs, strains, cfg.eval.seq_len, n, max_windows=a.windows)
                if ws:
                    kinds[f"{name}, {n} equal regions"] = [np.asarray(w.tokens) for w in ws]
    out = {"run": str(a.run_dir), "device": str(device), "rows": []}
    lines = [f"Copy probe of {a.run_dir} ({device}): bits per base by region of the window, and the 12-mer copy "
             "oracle (accuracy where it predicts / coverage)", "",
             "| windows | region | bits per base | oracle accuracy | oracle coverage |", "|---|---|---|---|---|"]
    for name, ws in kinds.items():
        per: dict[int, list[tuple[float, float, float, int]]] = {}
        for w in ws:
            loss = fn(make_batch([w]))[0].cpu().numpy()  # target t+1 predicted at input t
            for r, (lo, hi) in enumerate(regions(w, SEP_ID)):
                bits = float(loss[max(lo - 1, 0) + 1:hi - 1].mean()) / math.log(2)
                acc, cov = oracle(w, lo + 1, hi)
                per.setdefault(r, []).append((bits, acc, cov, hi - lo))
        for r, vals in sorted(per.items()):
            b, acc, cov = (float(np.mean([v[i] for v in vals])) for i in range(3))
            out["rows"].append({"windows": name, "region": r + 1, "bits": b, "oracle_acc": acc, "oracle_cov": cov,
                                "n": len(vals)})
            lines.append(f"| {name} | {r + 1} | {b:.4f} | {acc:.3f} | {cov:.3f} |")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(out, indent=2) + "\n")
    a.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

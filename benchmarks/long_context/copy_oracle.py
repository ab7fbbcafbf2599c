"""The copy oracle by bucket on the protocol's held-out windows, with no model: what long context could gain.

    python benchmarks/long_context/copy_oracle.py [--genomes ../shared/data/genomes] [--out DIR]

Builds the held-out windows of recipes/long-context/genome-long.yaml (256K, 32K buckets; each held-out genome
after 3 training strains' homologous regions, and alone) from the genomes in ``--genomes``, and writes, per
held-out group, the share of scored positions whose preceding 20-mer occurred more than 16K tokens earlier in
the window and the bits per base of a simple copy model (``megaseq.eval.copy_oracle``). CPU, about a minute.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import yaml

from megaseq.config import ModelConfig, build_config
from megaseq.data import build_data
from megaseq.eval.copy_oracle import copy_oracle
from megaseq.eval.report import write_json

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "long-context" / "genome-long.yaml"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--genomes", default="../shared/data/genomes", help="directory of the shared genomes")
    ap.add_argument("--out", default="benchmarks/results/long_context/genome_protocol", help="output directory")
    ap.add_argument("--max-windows", type=int, default=4, help="windows per held-out genome and group")
    args = ap.parse_args()
    raw = yaml.safe_load(RECIPE.read_text())
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    raw["model"] = {k: v for k, v in raw["model"].items() if k in known}
    for key in ("train", "heldout"):
        raw["data"][key] = [str(Path(args.genomes) / Path(p).name) for p in raw["data"][key]]
    raw["eval"]["max_windows"] = args.max_windows
    cfg = build_config(raw)
    data = build_data(cfg.data, cfg.eval)
    out = {"recipe": str(RECIPE.relative_to(RECIPE.parents[2])), "seq_len": cfg.eval.seq_len or cfg.data.seq_len,
           "bucket_width": cfg.eval.by_position, "groups": {}}
    for group, batches in data.heldout_batches(1).items():
        out["groups"][group] = {"windows": len(batches.windows),
                                **copy_oracle(batches, cfg.eval.by_position, 20, 16384, data.score_ids)}
        o = out["groups"][group]
        print(f"{group}: {len(batches.windows)} windows, {100 * o['overall_share_with_copy']:.2f}% with a far copy, "
              f"copy model {o['overall_bits_per_base']:.4f} bits per base; by bucket "
              + " ".join("-" if v is None else f"{100 * v:.1f}%" for v in o["share_with_copy"]))
    path = write_json(Path(args.out) / "copy_oracle.json", out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

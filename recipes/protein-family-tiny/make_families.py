"""Writes the generated protein families this recipe trains on (run: python make_families.py).

Each family descends from one random ancestor: every homolog copies it with about 15% substitutions and
a few short insertions and deletions, so the homologs earlier in a family predict the later ones. The
files are small, deterministic, and no real protein: they exercise the pipeline, not biology.
"""

from __future__ import annotations

import numpy as np

AMINO_ACIDS = "ACDEFGHIKLMNPQRSTVWY"


def homolog(ancestor: str, rng: np.random.Generator) -> str:
    out = []
    for ch in ancestor:
        r = rng.random()
        if r < 0.03:
            continue  # deletion
        out.append(rng.choice(list(AMINO_ACIDS)) if r < 0.18 else ch)
        if rng.random() < 0.02:
            out.extend(rng.choice(list(AMINO_ACIDS), size=int(rng.integers(1, 4))))
    return "".join(out)


def family(name: str, seed: int, length: int, count: int) -> str:
    rng = np.random.default_rng(seed)
    ancestor = "M" + "".join(rng.choice(list(AMINO_ACIDS), size=length - 1))
    lines = []
    for i in range(count):
        seq = homolog(ancestor, rng)
        lines.append(f">{name}_{i:03d} generated homolog {i} of family {name}")
        lines += [seq[j:j + 60] for j in range(0, len(seq), 60)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys

    # python make_families.py: famA, famB (training families) and famC (the held-out family), here.
    # python make_families.py DIR RESIDUES: DIR/long_train.fa and DIR/long_heldout.fa, families of at least
    # RESIDUES residues each (for a long run).
    if len(sys.argv) > 2:
        count = int(sys.argv[2]) // 190 + 1
        for name, seed in (("long_train", 11), ("long_heldout", 12)):
            with open(f"{sys.argv[1]}/{name}.fa", "w") as f:
                f.write(family(name, seed, 200, count))
    else:
        for name, seed, length, count in (("famA", 1, 180, 40), ("famB", 2, 140, 40), ("famC", 3, 160, 30)):
            with open(f"{name}.fa", "w") as f:
                f.write(family(name, seed, length, count))

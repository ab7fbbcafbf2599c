"""A recipe's data files, found in another directory: the comma-separated list for --data.train / --data.heldout.

    python benchmarks/long_context/recipe_files.py recipes/long-context-genomes.yaml train .data  # -> .data/a.fa.gz,...

(The device machines carry the shared genomes as .data/, not at the recipe's ../../shared/data/genomes.)
"""

import os
import sys

import yaml

if __name__ == "__main__":
    recipe, key, where = sys.argv[1:4]
    files = yaml.safe_load(open(recipe))["data"][key]
    print(",".join(os.path.join(where, os.path.basename(p)) for p in files))

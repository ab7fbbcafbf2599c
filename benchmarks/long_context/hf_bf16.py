"""A Hugging Face export with its floating-point tensors in bf16 (half an fp32 export: small enough to come back
from a device call and to be carried to the next).

    python benchmarks/long_context/hf_bf16.py RUN/hf OUT/hf
"""

import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

if __name__ == "__main__":
    src, dst = Path(sys.argv[1]), Path(sys.argv[2])
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name.endswith(".safetensors"):
            save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(f).items()},
                      dst / f.name)
        elif f.is_file():
            shutil.copy(f, dst / f.name)

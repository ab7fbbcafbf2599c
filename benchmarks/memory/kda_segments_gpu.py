"""Segmented KDA on the GPU: fla's chunk_kda with a carried state against the plain fla layer, and the
memory of one KDA layer (glm5-flash-1gpu shape) plain vs segmented.

    python benchmarks/memory/kda_segments_gpu.py --out $OUT/kda_segments.json         # about a minute on an H200
    python benchmarks/memory/kda_segments_gpu.py --smoke --out /tmp/kda_segments.json  # CPU, tiny, fp32

Exactness: output, input gradient and every parameter gradient of ``sum(layer(x) * w)``, segmented
(``segment_tokens`` T) vs plain, both in bf16 autocast with fp32 weights; the relative error is the bf16
noise floor of two orders of summation (compare the plain layer run twice with another chunking: none
here, so a few 1e-3 is the expected scale). Memory: ``max_memory_allocated`` above the inputs for one
forward + backward at each length. The JSON is rewritten after every measurement.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from megaseq.memory.kda_segments import segment
from megaseq.models.common.context import SeqContext
from megaseq.models.common.kda import KimiDeltaAttention
from megaseq.models.glm5.model import Glm5Model
from megaseq.models.glm5.spec import glm5_flash_1gpu, glm5_flash_tiny

GIB = 2**30


def _run(layer, x, w, dev, autocast: bool):
    layer.zero_grad(set_to_none=True)
    xg = x.clone().requires_grad_(True)
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
        out = layer(xg, SeqContext())
    (out.float() * w).sum().backward()
    return out.detach().float(), xg.grad.float(), {n: p.grad.float() for n, p in layer.named_parameters()}


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    spec = glm5_flash_tiny() if args.smoke else glm5_flash_1gpu()
    S, T, lengths = (200, 48, (256, 512)) if args.smoke else (16384, 4096, (131072, 262144))
    torch.manual_seed(0)
    with torch.device(dev):
        layer = KimiDeltaAttention(spec)
    Glm5Model.reset_parameters(layer)
    res: dict = {"gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
                 "shape": {"hidden": spec.hidden_size, "heads": spec.linear_num_heads,
                           "head_dim": spec.linear_head_dim}}
    out = Path(args.out)
    save = lambda: out.write_text(json.dumps(res, indent=1))  # noqa: E731
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(1, S, spec.hidden_size, device=dev, generator=g)
    w = torch.randn(1, S, spec.hidden_size, device=dev, generator=g)
    ac = dev.type == "cuda"
    segment(layer, None)
    plain = _run(layer, x, w, dev, ac)
    segment(layer, T)
    seg = _run(layer, x, w, dev, ac)
    errs = {"out": _rel(seg[0], plain[0]), "grad_x": _rel(seg[1], plain[1])}
    errs.update({f"grad_{n}": _rel(seg[2][n], plain[2][n]) for n in plain[2]})
    res["exactness"] = {"S": S, "T": T, "worst": max(errs.values()), "errors": errs}
    print("exactness", S, T, f"worst rel {max(errs.values()):.2e}", flush=True)
    save()
    del x, w, plain, seg
    for L in lengths:
        for name, t in (("plain", None), ("segmented", 16384 if not args.smoke else 64)):
            gc.collect()
            if ac:
                torch.cuda.empty_cache()
            x = torch.randn(1, L, spec.hidden_size, device=dev, generator=g)
            w = torch.randn(1, L, spec.hidden_size, device=dev, generator=g, dtype=torch.bfloat16)
            if ac:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if ac else 0
            segment(layer, t)
            t0 = time.perf_counter()
            try:
                _run(layer, x, w.float() if not ac else w, dev, ac)
                if ac:
                    torch.cuda.synchronize()
                row = {"seconds": time.perf_counter() - t0}
                if ac:
                    row["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / GIB
            except torch.OutOfMemoryError as e:
                row = {"oom": str(e).splitlines()[0][:160]}
            res.setdefault("memory", {}).setdefault(str(L), {})[name] = row
            print(L, name, row, flush=True)
            save()
            del x, w
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

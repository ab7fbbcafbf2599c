"""The DSA indexer learns: recall of the dense attention's top pools at init, after the dense warm-up and after
the sparse stage, for a glm5-family DNA model trained from scratch; random selection is the baseline.

    python benchmarks/long_context/indexer_recall.py --preset tiny --warmup 40 --sparse 40          # CPU, a minute
    python benchmarks/long_context/indexer_recall.py --preset small --seq-len 4096 --device cuda    # one GPU

Writes ``benchmarks/results/long_context/indexer_recall_<preset>.json`` and ``.png``: per stage, per
full-indexer layer, the recall and the random baseline on held-out windows of the lambda phage genome
(the packaged default genome), and the training curves (LM loss, mean indexer KL). The objective's coefficient
is ``--coef`` (default 0.001, ``model.indexer_loss_coef``'s), the indexers' AdamW epsilon times it as megaseq's
optimizer holds them (``--plain-eps``: AdamW's own, for comparison); ``--seed`` picks the weights and windows'
order.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from megaseq.data.fasta import default_genome_path, read_fasta
from megaseq.models.build import build_model
from megaseq.models.glm5.spec import glm5_flash_tiny
from megaseq.train import indexer_training as it

OUT = Path(__file__).resolve().parents[1] / "results" / "long_context"


def spec_for(preset: str, seq_len: int):
    """A glm5-family model of DSA layers only (the indexer is what is measured): tiny (2 layers, hidden 64)
    or small (4 layers, hidden 256); pools of 4, K = 8 pools per query."""
    s = glm5_flash_tiny()
    n, hidden, heads = (2, 64, 4) if preset == "tiny" else (4, 256, 8)
    return s.replace(num_layers=n, layer_types=("dsa",) * n, mlp_types=("dense",) * n, indexer_types=("full",) * n,
                     hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=heads, index_kpool=4,
                     index_topk=32, max_position_embeddings=max(seq_len, 4096))


def windows(seq_len: int, count: int, seed: int, heldout: bool) -> torch.Tensor:
    genome = np.concatenate([r.tokens for r in read_fasta(default_genome_path())]).astype(np.int64)
    half = len(genome) * 4 // 5
    lo, hi = (half, len(genome) - seq_len) if heldout else (0, half - seq_len)
    rng = np.random.default_rng(seed)
    starts = rng.integers(lo, hi, size=count)
    return torch.from_numpy(np.stack([genome[s:s + seq_len] for s in starts]))


def mean_recall(model, ids) -> dict[str, float]:
    model.eval()
    per = [it.recall(model, ids[i:i + 1]) for i in range(ids.shape[0])]
    model.train()
    layers = sorted(per[0])
    return {"recall": float(np.mean([p[i][0] for p in per for i in layers])),
            "random": float(np.mean([p[i][1] for p in per for i in layers])),
            "per_layer": {str(i): float(np.mean([p[i][0] for p in per])) for i in layers}}


def train(model, steps: int, first: int, ids_of, lr: float, device, plain_eps: bool = False) -> list[dict[str, float]]:
    # every parameter (the warm-up freezes the main model step by step), the indexers in their own group with
    # AdamW's epsilon times the objective's coefficient, as megaseq's optimizer holds them (train.optim);
    # ``plain_eps``: AdamW's own epsilon for the indexers too (for comparison)
    ids, coef = it.adam_groups(model)
    opt = torch.optim.AdamW([{"params": [p for p in model.parameters() if id(p) not in ids]},
                             {"params": [p for p in model.parameters() if id(p) in ids],
                              "eps": 1e-8 * (1.0 if plain_eps else coef)}],
                            lr=lr, weight_decay=0.0, eps=1e-8)
    curve = []
    for step in range(first, first + steps):
        it.begin_step(model, step)
        ids = ids_of(step).to(device)
        it.loss_scale(model, ids.numel())
        hidden = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(model.logits(hidden).flatten(0, 1).float(), ids[:, 1:].flatten(),
                                                 reduction="sum") / ids.numel()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        m = it.metrics(model)
        kls = [v for k, v in m.items() if k.startswith("indexer_kl/")]
        kl = float(np.mean(kls)) if kls else float("nan")
        curve.append({"step": step, "loss": float(loss.detach()), "indexer_kl": kl,
                      "dense": m.get("indexer_dense", 0.0)})
    return curve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=("tiny", "small"), default="tiny")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=40, help="dense warm-up steps")
    ap.add_argument("--sparse", type=int, default=40, help="sparse-stage steps")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--coef", type=float, default=0.001, help="the objective's coefficient (model.indexer_loss_coef)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plain-eps", action="store_true",
                    help="the indexers with AdamW's plain epsilon (not times the coefficient), for comparison")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args()
    device = torch.device(a.device)
    torch.manual_seed(a.seed)
    model = build_model(spec_for(a.preset, a.seq_len), dtype=torch.float32, device=device, seed=a.seed)
    it.enable(model, coef=a.coef, warmup_steps=a.warmup)
    held = windows(a.seq_len, 4, seed=99, heldout=True).to(device)
    t0 = time.time()
    stages = {"init": mean_recall(model, held)}
    curve = train(model, a.warmup, 1, lambda s: windows(a.seq_len + 1, a.batch, s, False), a.lr, device, a.plain_eps)
    stages["after_warmup"] = mean_recall(model, held)
    curve += train(model, a.sparse, a.warmup + 1, lambda s: windows(a.seq_len + 1, a.batch, s, False), a.lr, device,
                   a.plain_eps)
    stages["after_sparse"] = mean_recall(model, held)
    result = {"preset": a.preset, "seq_len": a.seq_len, "warmup_steps": a.warmup, "sparse_steps": a.sparse,
              "lr": a.lr, "coef": a.coef, "seed": a.seed, "indexer_eps": "plain" if a.plain_eps else "times coef",
              "device": str(device), "seconds": time.time() - t0, "stages": stages, "curve": curve,
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"indexer_recall_{a.preset}.json"
    path.write_text(json.dumps(result, indent=1))
    plot(result, out / f"indexer_recall_{a.preset}.png")
    print(json.dumps({k: {"recall": v["recall"], "random": v["random"]} for k, v in stages.items()}))


def plot(result: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    names = list(result["stages"])
    ax1.bar(names, [result["stages"][n]["recall"] for n in names], label="indexer")
    ax1.plot(names, [result["stages"][n]["random"] for n in names], "k--", label="random selection")
    ax1.set_ylabel("recall of dense attention's top-K pools")
    ax1.set_ylim(0, 1)
    ax1.legend()
    steps = [c["step"] for c in result["curve"]]
    ax2.plot(steps, [c["loss"] for c in result["curve"]], label="LM loss")
    ax2.set_ylabel("LM loss")
    kl_ax = ax2.twinx()
    kl_ax.plot(steps, [c["indexer_kl"] for c in result["curve"]], color="tab:red", label="indexer KL per query")
    kl_ax.set_ylabel("indexer KL per query", color="tab:red")
    ax2.axvline(result["warmup_steps"] + 0.5, color="gray", ls=":")
    ax2.set_xlabel("step (dense warm-up | sparse stage)")
    fig.suptitle(f"glm5-family {result['preset']} DNA model from scratch, {result['seq_len']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

"""Training loss by step at 16K: equal regions (session 7, call 4) vs related_jitter 0.5 (session 14).

    python benchmarks/results/speed/runs/2026-12-02_fast-plan/long_context_16k_jitter/plot_loss.py   (from the repo root)
"""

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

R = "benchmarks/results/speed/runs/2026-11-29_base-kernels/"
runs = [(R + "session7/call4_stage1_metrics.jsonl", "equal regions (session 7, call 4): learns a fixed-offset copy"),
        (R + "session14/long_context_16k_jitter/metrics.jsonl", "related_jitter 0.5 (session 14): no copy")]
fig, ax = plt.subplots(figsize=(8, 4.5))
for path, label in runs:
    rows = [json.loads(l) for l in open(path) if '"loss"' in l]
    steps = [r["step"] for r in rows]
    loss = [r["loss"] for r in rows]
    k = 10
    sm = [sum(loss[max(0, i - k + 1):i + 1]) / len(loss[max(0, i - k + 1):i + 1]) for i in range(len(loss))]
    ax.plot(steps, sm, label=label)
ax.axhline(1.3863, color="gray", ls="--", lw=1, label="uniform A/C/G/T (1.386 nats)")
ax.set_ylim(0.6, 1.6)
ax.set_xlabel("step (16 windows of 16K bases, 4 strains' homologous regions each)")
ax.set_ylabel("training loss, nats per token (10-step mean)")
ax.set_title("Qwen3-MoE 20M from scratch, one H200: the copy appears only with equal regions")
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(R + "session14/long_context_16k_jitter/loss_equal_vs_jitter.png", dpi=110)

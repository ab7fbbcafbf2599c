"""The indexer learns: a glm5-family DNA model from scratch (two DSA layers, pools of 4), its indexers' recall
of the dense attention's top pools at init and after a dense warm-up on the lambda phage genome, against
random selection's (CPU, float32). The warm-up must lift recall well above both."""

from __future__ import annotations

import numpy as np
import torch

from megaseq.data.fasta import default_genome_path, read_fasta
from megaseq.models.build import build_model
from megaseq.models.glm5.spec import glm5_flash_tiny
from megaseq.train import indexer_training as it

S = 256


def _spec():
    s = glm5_flash_tiny()
    return s.replace(num_layers=2, layer_types=("dsa",) * 2, mlp_types=("dense",) * 2, indexer_types=("full",) * 2,
                     index_kpool=4, index_topk=32)


def _windows(count: int, seed: int, lo: float, hi: float) -> torch.Tensor:
    genome = np.concatenate([r.tokens for r in read_fasta(default_genome_path())]).astype(np.int64)
    rng = np.random.default_rng(seed)
    starts = rng.integers(int(len(genome) * lo), int(len(genome) * hi) - S - 1, size=count)
    return torch.from_numpy(np.stack([genome[s:s + S + 1] for s in starts]))


def _recall(model, ids) -> tuple[float, float]:
    got = it.recall(model, ids[:, :-1])
    return float(np.mean([r for r, _ in got.values()])), float(np.mean([b for _, b in got.values()]))


def test_warmup_lifts_recall_above_random() -> None:
    torch.manual_seed(0)
    model = build_model(_spec(), dtype=torch.float32, seed=0)
    it.enable(model, coef=1.0, warmup_steps=20)
    held = _windows(1, seed=99, lo=0.8, hi=1.0)
    before, random = _recall(model, held)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    main = dict(model.named_parameters())["layers.0.self_attn.q_a_proj.weight"].detach().clone()
    for step in range(1, 21):
        it.begin_step(model, step)
        ids = _windows(2, seed=step, lo=0.0, hi=0.8)
        it.loss_scale(model, ids[:, 1:].numel())
        hidden = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(model.logits(hidden).flatten(0, 1), ids[:, 1:].flatten(),
                                                 reduction="sum") / ids[:, 1:].numel()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        kl = it.metrics(model)
        assert kl["indexer_dense"] == 1.0 and np.isfinite(kl["indexer_kl/0"])
    after, _ = _recall(model, held)
    print(f"\nrecall: init {before:.3f}, after warm-up {after:.3f}, random {random:.3f}")
    torch.testing.assert_close(dict(model.named_parameters())["layers.0.self_attn.q_a_proj.weight"], main,
                               atol=0, rtol=0)  # the main model stayed frozen
    assert after > random + 0.1 and after > before + 0.05
    it.begin_step(model, 21)  # the sparse stage: the main model trains again, the layers attend their selection
    assert all(not m.dense_attention for _, m in it.dsa_layers(model))
    assert dict(model.named_parameters())["layers.0.self_attn.q_a_proj.weight"].requires_grad

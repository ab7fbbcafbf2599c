"""Settings that follow the model's family or the data unless the user sets them: each is None
(``config.FAMILY_DEFAULT`` or ``config.DATA_DEFAULT`` in ``--help``) until ``resolve_family_settings`` fills it in,
once the model's spec is known and before the run directory records the configuration, so the run's config.yaml
holds the values the run used. A value the user set is kept as given (and refused, naming it, where the model cannot
train with it).

- ``moe``: the balancing each family's reference trains its routers with (``train/balance.py``).
- ``eval``: what the held-out report measures follows what is scored (``eval_unit``): DNA on the single-nucleotide
  tokenizer is scored in bits per base beside a k-mer Markov baseline of order 8; protein on the built-in residue
  tokenizer in bits per residue, text, chat and anything through a model's own tokenizer in bits per token, without
  a k-mer baseline (one of tokens or residues is not fitted). The position buckets split the evaluation window into
  8 (a power of two wide), so the by-position table and plot have a few readable buckets at any length.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from megaseq.config import Config, DataConfig, EvalConfig, MoEConfig
from megaseq.train.balance import resolve_balance


def resolve_moe(moe: MoEConfig, spec: Any) -> MoEConfig:
    """``moe`` with each unset setting the family's (``train.balance.resolve_balance``: the mode the routers
    train with, the model's aux-loss coefficient, the family's bias update rate, the sequence-wise loss off)."""
    rule = resolve_balance(moe, spec)
    resolved = {"balance": rule.mode, "aux_loss_coef": rule.aux_loss_coef, "bias_update_rate": rule.bias_update_rate,
                "seq_aux_loss_coef": rule.seq_aux_loss_coef}
    return MoEConfig(**{k: v if getattr(moe, k) is None else getattr(moe, k) for k, v in resolved.items()})


EVAL_BUCKETS = 8  # position buckets per evaluation window when eval.by_position is unset
DNA_KMER_K = 8  # the k-mer baseline's order for DNA scored per base when eval.kmer_k is unset


def eval_unit(data: DataConfig) -> str | None:
    """What the held-out report scores per symbol, as ``data.build_data`` will: 'base' (DNA on the single-nucleotide
    tokenizer), 'residue' (protein on the built-in tokenizer), 'token' (anything else); None for random tokens."""
    if data.kind == "random":
        return None
    if data.kind == "fasta" and data.alphabet == "dna" and data.tokenizer == "dna":
        return "base"
    if data.kind == "fasta" and data.alphabet == "protein" and data.tokenizer == "protein":
        return "residue"
    return "token"


def resolve_eval(ev: EvalConfig, data: DataConfig) -> EvalConfig:
    """``ev`` with the bucket width and the k-mer order resolved for ``data`` where unset. A k-mer order the user
    gives for data not scored per base is kept but warned about: no baseline is fitted for it."""
    window = ev.seq_len or data.seq_len
    by_position = ev.by_position or 1 << max(0, (window // EVAL_BUCKETS).bit_length() - 1)
    unit = eval_unit(data)
    kmer_k = ev.kmer_k if ev.kmer_k is not None else DNA_KMER_K if unit == "base" else 0
    if kmer_k and unit not in ("base", None):
        warnings.warn(f"eval.kmer_k {kmer_k} has no effect: the k-mer baseline is fitted for DNA scored per base, "
                      f"and this run scores per {unit}; set --eval.kmer_k 0 (or leave it unset)", stacklevel=2)
    return dataclasses.replace(ev, by_position=by_position, kmer_k=kmer_k)


def resolve_family_settings(cfg: Config, spec: Any) -> Config:
    """A copy of ``cfg`` with every setting left to the model's family or to the data resolved."""
    return dataclasses.replace(cfg, moe=resolve_moe(cfg.moe, spec), eval=resolve_eval(cfg.eval, cfg.data))

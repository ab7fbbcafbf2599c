"""Held-out evaluation inside a training run: every ``train.eval_every`` steps, and the report at the end.

``HeldoutProbe`` scores the run's held-out windows (``data.heldout_batches``, at most
``eval.max_windows`` per file) with the current weights, a window at a time with its own progress,
and returns one metrics record (``eval_loss`` nats, ``eval_bits_per_<unit>``, the k-mer baseline's
bits on the same tokens); the k-mer baseline is fitted once and reused by the final report.

``evaluate_run`` writes the run's report: the model after training beside the k-mer baseline and
uniform A/C/G/T, and "before" only when the run started from a real checkpoint (``model.init_from``).
A run from random weights has no "before" column: its 4 bits per base (uniform over the 16-symbol
vocabulary) would make any training look like a 50% gain.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch

from megaseq.config import Config, MemorySettings
from megaseq.train import checkpoint as ckpt

RANDOM_INIT_NOTE = ("No 'before' column: the run started from random weights, whose 4.0 bits per base (uniform "
                    "over the 16-symbol vocabulary) would say nothing about what training learned; "
                    "set model.init_from to fine-tune, and compare against that checkpoint.")
RANDOM_INIT_NOTE_TOKENS = ("No 'before' column: the run started from random weights, whose loss (uniform over the "
                           "vocabulary) would say nothing about what training learned; set model.init_from to "
                           "fine-tune, and compare against that checkpoint.")


class HeldoutProbe:
    """Held-out loss of the current weights, for ``train.eval_every`` (one process)."""

    def __init__(self, cfg: Config, data: Any, env: Any, autocast: torch.dtype | None,
                 memory: MemorySettings) -> None:
        self.cfg, self.data, self.env, self.autocast, self.memory = cfg, data, env, autocast, memory
        self.batches = data.heldout_batches(cfg.eval.batch_size)
        self.total = sum(len(b) for b in self.batches.values())
        self._kmer: Any = None
        self._kmer_done = False
        self.kmer_bits: float | None = None

    @property
    def kmer(self) -> Any:
        """The k-mer baseline fitted on the training records (None for non-DNA data or kmer_k 0)."""
        if not self._kmer_done:
            from megaseq.eval import build_kmer_baseline

            self._kmer, self._kmer_done = build_kmer_baseline(self.data, self.cfg.eval.kmer_k), True
        return self._kmer

    def _bits(self, per_token_loss: Any, progress: Any = None) -> tuple[float, int]:
        """(mean nats over the scored held-out tokens, their number), calling ``progress(done, total)``."""
        from megaseq.eval.by_position import scored_mask

        total_nats, count, done = 0.0, 0, 0
        for group_batches in self.batches.values():
            for batch in group_batches:
                mask = scored_mask(batch, self.data.score_ids)
                with torch.no_grad():
                    loss = per_token_loss(batch)
                loss = loss.detach().double().cpu().numpy() if torch.is_tensor(loss) else loss
                total_nats += float(loss[mask].sum())
                count += int(mask.sum())
                done += 1
                if progress is not None:
                    progress(done, self.total)
        if count == 0:
            raise ValueError("train.eval_every: the held-out windows hold no scored token")
        return total_nats / count, count

    def __call__(self, model: torch.nn.Module, step: int, progress: Any = None) -> dict[str, Any]:
        """One record for metrics.jsonl: the held-out loss at ``step``, with the baselines beside it."""
        from megaseq.eval.loss import per_token_loss_fn
        from megaseq.eval.verdict import UNIFORM_BITS

        unit = self.data.unit
        if self.kmer is not None and self.kmer_bits is None:  # once, and not in eval_s (the ETA reads it)
            self.kmer_bits = self._bits(self.kmer.batch_loss)[0] / math.log(2)
        t0 = time.perf_counter()
        was_training = model.training
        fn = per_token_loss_fn(model.eval(), self.env, self.autocast, self.memory.loss_chunk_tokens,
                               self.memory.model_segment_tokens)
        try:
            nats, tokens = self._bits(fn, progress)
        finally:
            model.train(was_training)
        if not math.isfinite(nats):
            raise ValueError(f"held-out loss at step {step} is not finite ({nats}): the run has diverged; "
                             "lower optim.lr or raise optim.warmup_steps")
        record = {"step": step, "eval_loss": nats, f"eval_bits_per_{unit}": nats / math.log(2),
                  "eval_tokens": tokens, "eval_s": time.perf_counter() - t0}
        if self.kmer is not None:
            record["eval_baseline"] = self.kmer.name
            record[f"eval_baseline_bits_per_{unit}"] = self.kmer_bits
        if UNIFORM_BITS.get(unit) is not None:
            record[f"eval_uniform_bits_per_{unit}"] = UNIFORM_BITS[unit]
        return record


def evaluate_run(cfg: Config, run_dir: Path, model: torch.nn.Module, spec: Any, data: Any, env: Any,
                 autocast: torch.dtype | None, memory: MemorySettings, kmer: Any = None,
                 step: int | None = None) -> dict[str, Any]:
    """Held-out loss by position after training (``step``: the last step trained, train.steps when None),
    beside the k-mer baseline (``kmer``: already fitted) and uniform A/C/G/T; "before" (the start) only when the
    run started from ``model.init_from``."""
    from megaseq.eval import report_by_position
    from megaseq.eval.loss import per_token_loss_fn
    from megaseq.train.convert import load_megaseq_checkpoint

    chunk = memory.loss_chunk_tokens
    segment = memory.model_segment_tokens
    models, descriptions, notes = {}, {}, []
    before = Path(run_dir) / ckpt.CKPT_DIR / "step_000000"
    meta0 = ckpt.read_meta(before) if before.is_dir() else None
    if meta0 is not None and meta0.get("trainable_only"):
        # the frozen base is this model's: "before" is it with the step-0 trained tensors swapped in
        fn = per_token_loss_fn(model.eval(), env, autocast, chunk, segment)
        models["before"] = ckpt.with_trained_state(fn, model, ckpt.load_trained_state(before, model))
        descriptions["before"] = f"{cfg.model.init_from}, step 0"
    elif meta0 is not None and not ckpt.is_random_init(meta0):
        m0, _, _ = load_megaseq_checkpoint(before, device=env.device, dtype=next(model.parameters()).dtype)
        models["before"] = per_token_loss_fn(m0.eval(), env, autocast, chunk, segment)
        descriptions["before"] = f"{cfg.model.init_from}, step 0"
    else:
        notes.append(RANDOM_INIT_NOTE if data.unit == "base" else RANDOM_INIT_NOTE_TOKENS)
    models["after"] = per_token_loss_fn(model.eval(), env, autocast, chunk, segment)
    descriptions["after"] = f"step {cfg.train.steps if step is None else step}"
    return report_by_position(models, data, cfg.eval, Path(run_dir) / "eval", kmer=kmer,
                              descriptions=descriptions, notes=notes)

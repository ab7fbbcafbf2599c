"""Shared by the LoRA tests over gloo processes (tests/parallel/test_lora_*.py): a rank's trainer steps held to
the one-process steps (the loss, every trained gradient, every parameter after the last step, no gradient on
the frozen base), and ``megaseq train`` runs (one per rank) compared by their losses and exports."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from test_fsdp_train_step import STEPS, TOL, run_steps


def assert_steps_match(model: torch.nn.Module, env, memory, cfg, ref, trains: set[str]) -> tuple:
    """``run_steps`` on this rank equals ``ref`` (the one-process ``run_steps``): each step's loss (1e-12), each
    step's gradients of exactly ``trains`` (``TOL``), every parameter after the last step; the frozen parameters
    end without a gradient. Returns (losses, gradients per step, parameters after) for the figures."""
    params = dict(model.named_parameters())
    losses, grads, final = run_steps(model, env, memory, cfg)
    ref_losses, ref_grads, ref_params = ref
    for k in range(STEPS):
        assert abs(losses[k] - ref_losses[k]) < 1e-12 * abs(ref_losses[k]), (k, losses[k], ref_losses[k])
        assert grads[k].keys() == ref_grads[k].keys() == trains  # the frozen base has no gradient
        for n, g in grads[k].items():
            torch.testing.assert_close(g, ref_grads[k][n], **TOL, msg=lambda m, n=n, k=k: f"step {k} grad {n}: {m}")
    for n, p in final.items():
        torch.testing.assert_close(p, ref_params[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")
    assert all(p.grad is None for n, p in params.items() if n not in trains)
    return losses, grads, final


# ---- ``megaseq train`` runs ----------------------------------------------------------------------------------
def lora_run_overrides(tmp: Path, run: str, dp: int, batch: int, fsdp: str = "off", **extra) -> dict:
    """A float64 LoRA run of qwen3-moe-tiny on ``tmp/g.fa`` (4 steps, checkpoints every 2, the PEFT adapter and
    the merged HF checkpoint exported), adapters on q_proj, v_proj and the experts, the norms trained."""
    return {"model.name": "qwen3-moe-tiny", "model.dtype": "fp64", "data.train": [str(tmp / "g.fa")],
            "data.seq_len": 32, "data.heldout_tail": 0, "train.steps": 4, "train.batch_size": batch,
            "train.save_every": 2, "train.keep_checkpoints": 10, "train.run_dir": str(tmp / run),
            "train.eval_after": False, "train.export_hf": True, "lora.export_merged": True, "train.device": "cpu",
            "train.trainable": ["norm.weight"], "optim.lr": 3e-3, "optim.warmup_steps": 1, "log.progress": False,
            "log.tensorboard": False, "parallel.dp": dp, "parallel.fsdp": fsdp, "parallel.backend": "gloo",
            "lora.rank": 4, "lora.alpha": 8.0, "lora.targets": ["q_proj", "v_proj", "experts"], **extra}


def train_rank(rank: int, overrides: dict) -> None:
    """One process of ``megaseq train`` with ``overrides`` (``spawn_local``'s target, or rank 0 alone)."""
    from megaseq.config import build_config
    from megaseq.train.trainer import run_training

    torch.set_num_threads(1)
    run_training(build_config(overrides=overrides))


def run_losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def safetensors_in(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in ``path``."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def assert_exports_match(got_run: Path, want_run: Path, subs: tuple[str, ...] = ("adapter", "hf"),
                         label: str = "") -> None:
    """Each export directory ``sub`` of ``got_run`` holds ``want_run``'s tensors (the same names, 1e-10)."""
    for sub in subs:
        want, got = safetensors_in(want_run / sub), safetensors_in(got_run / sub)
        assert got.keys() == want.keys() and got, sub
        for k, t in want.items():
            torch.testing.assert_close(got[k], t, rtol=1e-10, atol=1e-13,
                                       msg=lambda m, k=k, s=label or sub: f"{s} {k}: {m}")

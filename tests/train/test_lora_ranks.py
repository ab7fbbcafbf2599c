"""A frozen base with main's several-rank machinery (the feat-lora x feat-fsdp merge): a 2-rank data-parallel
LoRA run writes trainable-only checkpoints from every rank (DCP, no frozen tensor in them), resumes on one
process on the same loss curve, exports its adapter; the combination not tested yet (bf16 weights) is refused by
the config, naming the settings and the fix (expert parallelism: tests/parallel/test_lora_ep.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from conftest import run_as_of_step
from megaseq.config import build_config
from megaseq.parallel.launch import spawn_local
from megaseq.train import checkpoint as ckpt

STEPS = 4
LORA = {"lora.rank": 4, "lora.alpha": 8.0, "lora.targets": ["q_proj", "v_proj", "experts"]}


@pytest.mark.parametrize("extra, words", [
    ({"model.weights": "bf16"}, ["model.weights bf16", "--model.weights fp32"]),
])
@pytest.mark.parametrize("frozen", [LORA, {"train.trainable": ["norm.weight"]}])
def test_untested_combinations_are_refused(frozen: dict, extra: dict, words: list[str]) -> None:
    if "lora.rank" not in frozen:
        words = ["train.trainable"] + words[1:]
    with pytest.raises(ValueError) as e:
        build_config(overrides={"model.name": "qwen3-moe-tiny", **frozen, **extra})
    for w in words:
        assert w in str(e.value)
    build_config(overrides={"model.name": "qwen3-moe-tiny", **extra})  # the same settings without a frozen base
    build_config(overrides={"model.name": "qwen3-moe-tiny", **frozen})  # and the frozen base alone


def _overrides(tmp: Path, run: str, dp: int, batch: int, **extra) -> dict:
    return {"model.name": "qwen3-moe-tiny", "model.dtype": "fp64", "data.train": [str(tmp / "g.fa")],
            "data.seq_len": 32, "data.heldout_tail": 0, "train.steps": STEPS, "train.batch_size": batch,
            "train.save_every": 2, "train.keep_checkpoints": 10, "train.run_dir": str(tmp / run),
            "train.eval_after": False, "train.export_hf": True, "train.device": "cpu",
            "train.trainable": ["norm.weight"], "optim.lr": 3e-3, "optim.warmup_steps": 1, "log.progress": False,
            "log.tensorboard": False, "parallel.dp": dp, "parallel.backend": "gloo", **LORA, **extra}


def _train_rank(rank: int, overrides: dict) -> None:
    from megaseq.train.trainer import run_training

    torch.set_num_threads(1)
    run_training(build_config(overrides=overrides))


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_rank_lora_checkpoints_hold_what_trains_and_resume_on_one(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    (tmp_path / "g.fa").write_text(">rec\n" + "".join(rng.choice(list("ACGT"), 4000)) + "\n")
    spawn_local(_train_rank, 2, args=(_overrides(tmp_path, "two", 2, 1),))
    two = tmp_path / "two"
    step2 = two / ckpt.CKPT_DIR / "step_000002"
    meta = ckpt.read_meta(step2)
    assert meta["trainable_only"] and meta["base_fingerprint"]
    keys = set(FileSystemReader(str(step2)).read_metadata().state_dict_metadata)
    model_keys = {k for k in keys if k.startswith("model.")}
    assert model_keys and all(".lora_" in k or k.endswith("norm.weight") for k in model_keys), sorted(model_keys)[:5]
    assert not any("embed_tokens" in k or k.endswith("experts.gate_up_proj") for k in keys)
    assert (two / "adapter" / "adapter_model.safetensors").is_file()
    # resume the step-2 checkpoint on one process (batch 2: the same global batch)
    run = run_as_of_step(two, tmp_path / "one", 2, drop=("adapter",))
    _train_rank(0, _overrides(tmp_path, "one", 1, 2, **{"train.resume": True}))
    want, got = _losses(two), _losses(run)
    assert len(got) == STEPS
    np.testing.assert_allclose(got[2:], want[2:], rtol=1e-9, atol=0)
    # the broken variant: another frozen base (seed) is refused on resume by its fingerprint
    bad = tmp_path / "bad"
    shutil.copytree(two, bad)
    shutil.rmtree(bad / ckpt.CKPT_DIR / "step_000004")
    with pytest.raises(ValueError, match="another frozen base"):
        _train_rank(0, _overrides(tmp_path, "bad", 1, 2, **{"train.resume": True, "train.seed": 7}))

"""LoRA runs end to end on the CPU: checkpoints hold only what trains, a resumed run equals the uninterrupted
one, the run ends with a PEFT adapter (and the merged model on request), ``megaseq export`` writes both from
a checkpoint, a run starts from an adapter, and what cannot work is refused before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_train import _cfg, _fasta
from torch.distributed.checkpoint import FileSystemReader

from megaseq.cli.main import main
from megaseq.models.common import lora
from megaseq.train import checkpoint as ckpt
from megaseq.train.convert import load_megaseq_checkpoint
from megaseq.train.trainer import run_training

torch.set_num_threads(2)
LORA = {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj", "experts"]}


def lora_cfg(tmp_path: Path, run: str, train: dict | None = None, **sections):
    _fasta(tmp_path / "g.fa", 3000, seed=1)
    data = {"train": [str(tmp_path / "g.fa")], "seq_len": 64, **sections.pop("data", {})}
    model = {"name": "qwen3-moe-tiny", **sections.pop("model", {})}
    return _cfg(tmp_path, run, data=data, model=model, lora={**LORA, **sections.pop("lora", {})},
                train={"steps": 4, "trainable": ["norm.weight"], **(train or {})}, **sections)


def saved_keys(step_dir: Path) -> set[str]:
    return set(FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata)


def test_checkpoints_hold_only_what_trains_and_resume_is_exact(tmp_path: Path) -> None:
    full = run_training(lora_cfg(tmp_path, "full", {"save_every": 2}))
    step = tmp_path / "full" / "checkpoints" / "step_000004"
    meta = ckpt.read_meta(step)
    assert meta["trainable_only"] and meta["base"]["seed"] == 0
    model_keys = {k.removeprefix("model.") for k in saved_keys(step) if k.startswith("model.")}
    assert model_keys == set(meta["trainable"])  # qwen3_moe has no buffers: exactly the trained tensors
    assert all(lora.is_adapter(k) or k == "norm.weight" for k in model_keys) and "norm.weight" in model_keys
    run_training(lora_cfg(tmp_path, "part", {"steps": 2}))
    resumed = run_training(lora_cfg(tmp_path, "part", {"resume": True}))
    parts = [json.loads(x)["loss"] for x in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    np.testing.assert_allclose(parts, full.losses, rtol=1e-6)
    assert len(resumed.losses) == 2
    with pytest.raises(ValueError, match="another frozen base"):  # adapters of this run on another base
        run_training(lora_cfg(tmp_path, "part", {"resume": True, "steps": 6, "seed": 1}))


def test_run_exports_adapter_evaluates_and_export_verb(tmp_path: Path) -> None:
    from megaseq.models.build import build_model
    from megaseq.models.hf_io import export_hf_checkpoint
    from megaseq.models.presets import get_preset

    spec = get_preset("qwen3-moe-tiny")  # a base checkpoint to start from: "before" is then a real model
    export_hf_checkpoint(build_model(spec, dtype=torch.float32, seed=7), spec, tmp_path / "base")
    cfg = lora_cfg(tmp_path, "r", {"eval_after": True, "export_hf": True}, lora={"export_merged": True},
                   data={"heldout_tail": 0.2}, eval={"by_position": 32, "max_windows": 2, "kmer_k": 0},
                   model={"init_from": str(tmp_path / "base")})
    result = run_training(cfg)
    run = tmp_path / "r"
    assert (run / "adapter" / "adapter_config.json").is_file() and (run / "hf" / "config.json").is_file()
    assert set(result.eval_report["models"]) >= {"before", "after"}
    assert ckpt.read_meta(run / "checkpoints" / "step_000000")["trainable_only"]
    assert main(["export", str(run), str(tmp_path / "adapter2")]) == 0
    assert main(["export", str(run), str(tmp_path / "merged2"), "--merged"]) == 0
    from safetensors.torch import load_file

    for name, sub in (("adapter", "adapter_model.safetensors"), ("hf", "model.safetensors")):
        a = load_file(run / name / sub)
        b = load_file(tmp_path / ("adapter2" if name == "adapter" else "merged2") / sub)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    model, _, _ = load_megaseq_checkpoint(run)  # the frozen base made again, the adapters read
    assert any(lora.is_adapter(n) for n, _ in model.named_parameters())


def test_run_starts_from_an_adapter(tmp_path: Path) -> None:
    first = lora_cfg(tmp_path, "a", {"export_hf": True}, lora={})
    run_training(first)
    start = lora_cfg(tmp_path, "b", {"steps": 1, "eval_after": True},
                     lora={"init_from": str(tmp_path / "a" / "adapter")}, data={"heldout_tail": 0.2},
                     eval={"by_position": 32, "max_windows": 1, "kmer_k": 0})
    run_training(start)
    model, _, _ = load_megaseq_checkpoint(tmp_path / "b" / "checkpoints" / "step_000000")
    final, _, _ = load_megaseq_checkpoint(tmp_path / "a")
    mine = {n: p for n, p in final.named_parameters() if lora.is_adapter(n)}
    for n, p in model.named_parameters():
        if lora.is_adapter(n):
            assert torch.equal(p, mine[n]), n


@pytest.mark.parametrize("sections, match", [
    ({"lora": {"dropout": 0.1}, "memory": {"auto": False, "recompute": True}}, "lora.dropout"),
    ({"lora": {"targets": ["q_proj", "nothing"]}}, "matches no projection"),
    ({"lora": {"init_from": "/no/such/adapter"}}, "not a PEFT adapter"),
])
def test_refused_before_anything_is_written(tmp_path: Path, sections: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        run_training(lora_cfg(tmp_path, "x", **sections))
    assert not (tmp_path / "x" / "checkpoints").exists()

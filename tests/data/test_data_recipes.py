"""The data recipes run on the CPU: a protein-family fine-tune, and an agent-trace fine-tune whose export loads in
transformers with its tokenizer and chat template."""

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import agent_trace_checkpoint
from megaseq.config import load_config
from megaseq.train.trainer import run_training

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
QUIET = ["train.steps=2", "train.eval_every=0", "log.progress=false", "log.tensorboard=false"]

torch.set_num_threads(2)


def test_protein_family_recipe_trains_and_reports_bits_per_residue(tmp_path):
    cfg = load_config(RECIPES / "protein-family-tiny" / "recipe.yaml",
                      [f"train.run_dir={tmp_path / 'run'}", "data.seq_len=256", "eval.by_position=64", *QUIET])
    result = run_training(cfg)
    assert len(result.losses) == 2 and all(math.isfinite(v) for v in result.losses)
    report = result.eval_report
    assert report["unit"] == "residue" and report["tokens"] > 0
    assert 0 < report["models"]["after"]["bits_per_residue"] < 6
    assert "bits per residue" in (tmp_path / "run" / "eval" / "eval_by_position.md").read_text()
    assert json.loads((tmp_path / "run" / "hf" / "config.json").read_text())["vocab_size"] == 32


def test_agent_trace_recipe_export_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    source = agent_trace_checkpoint(tmp_path)
    cfg = load_config(tmp_path / "recipe.yaml", [f"train.run_dir={tmp_path / 'run'}", *QUIET])
    result = run_training(cfg)
    assert all(math.isfinite(v) for v in result.losses)
    assert result.eval_report["unit"] == "token" and "assistant turns only" in " ".join(result.eval_report["notes"])
    export = tmp_path / "run" / "hf"
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(export), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tok = transformers.AutoTokenizer.from_pretrained(str(export))
    record = json.loads((tmp_path / "heldout_traces.jsonl").read_text().splitlines()[0])
    ids = tok.apply_chat_template(record["messages"], tools=record["tools"], tokenize=True, return_dict=True,
                                  return_tensors="pt")["input_ids"]
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss)
    before, after = load_file(str(source / "model.safetensors")), load_file(str(export / "model.safetensors"))
    changed = [k for k in after if k in before and not torch.equal(before[k].float(), after[k].float())]
    assert changed, "two training steps changed no exported weight"

"""A LoRA run's PEFT adapter directory carries the tokenizer files and chat template its HF export carries, so
``AutoTokenizer.from_pretrained(RUN/adapter)`` loads the checkpoint's tokenizer and renders conversations as
training did (the agent-trace recipe with LoRA, on the CPU). The built-in protein tokenizer in the adapter:
``tests/data/test_protein_hf_tokenizer.py``."""

from __future__ import annotations

import json

import pytest

from conftest import agent_trace_checkpoint, torch_threads

transformers = pytest.importorskip("transformers")


def test_a_chat_lora_runs_adapter_loads_with_the_checkpoint_tokenizer_and_template(tmp_path):
    from megaseq.config import load_config
    from megaseq.train.trainer import run_training

    source = agent_trace_checkpoint(tmp_path)
    run = tmp_path / "run"
    cfg = load_config(tmp_path / "recipe.yaml", [
        f"train.run_dir={run}", "train.steps=1", "train.eval_every=0", "train.eval_after=false",
        "log.progress=false", "log.tensorboard=false", "lora.rank=4", "lora.export_merged=true"])
    with torch_threads(1):
        run_training(cfg)
    adapter, export = run / "adapter", run / "hf"
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    # the same tokenizer files as the merged HF export, byte for byte
    names = sorted(p.name for p in export.iterdir() if p.name.startswith(("tokenizer", "chat_template",
                                                                          "special_tokens")))
    assert "tokenizer.json" in names and "tokenizer_config.json" in names
    for name in names:
        assert (adapter / name).read_bytes() == (export / name).read_bytes(), name
    want = transformers.AutoTokenizer.from_pretrained(str(source))
    got = transformers.AutoTokenizer.from_pretrained(str(adapter))
    assert got.chat_template == want.chat_template and got.chat_template
    for line in (tmp_path / "heldout_traces.jsonl").read_text().splitlines():
        record = json.loads(line)
        ids = [tok.apply_chat_template(record["messages"], tools=record["tools"], tokenize=True,
                                       return_dict=True)["input_ids"] for tok in (want, got)]
        assert ids[0] == ids[1] and len(ids[0]) > 20


def test_an_export_outside_a_run_or_with_its_template_gone_has_no_tokenizer_files(tmp_path):
    """``megaseq export`` / ``convert``: a checkpoint outside a run directory writes none; a run whose chat
    template file has gone since warns, naming it, and writes none (the weights are written all the same)."""
    import yaml

    from megaseq.train.convert import write_run_tokenizer_of

    out = tmp_path / "out"
    out.mkdir()
    step = tmp_path / "run" / "checkpoints" / "step_000001"
    step.mkdir(parents=True)
    assert write_run_tokenizer_of(step, out) == []
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    data = {"kind": "chat", "tokenizer": str(tok), "train": ["t.jsonl"], "chat_template": str(tmp_path / "gone.jinja")}
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump({"data": data}))
    with pytest.warns(UserWarning, match="written without the run's tokenizer files.*gone.jinja"):
        assert write_run_tokenizer_of(step, out) == []
    (tmp_path / "gone.jinja").write_text("{% for message in messages %}{{ message.content }}{% endfor %}")
    assert write_run_tokenizer_of(step, out) == ["chat_template.jinja", "tokenizer.json"]

"""Bad input, table-driven: every row of the table below (and each family's unsupported config fields) is one
clear message from ``megaseq train`` naming the setting or file, exit status 2, no traceback, and no run
directory. Then the rows whose answer is not an error: ``model.name: DIR`` with weights trains from them,
a diverging run stops naming the step with nothing written, a foreign config.yaml is never touched, a
checkpoint's pickles are never run, and the export keeps every field of the source's config.json.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from megaseq.cli.main import main
from megaseq.models.presets import get_preset
from megaseq.models.spec import from_hf_config, to_hf_config

torch.set_num_threads(2)


def _fasta(path: Path, text: str) -> str:
    path.write_text(">rec\n" + text + "\n")
    return str(path)


def _acgt(n: int, seed: int = 0) -> str:
    return "".join(np.random.default_rng(seed).choice(list("ACGT"), n))


def _base(tmp: Path) -> dict:
    return {"model": {"name": "qwen3-moe-tiny", "dtype": "fp32"},
            "data": {"train": [_fasta(tmp / "g.fa", _acgt(600))], "seq_len": 32, "heldout_tail": 0},
            "train": {"steps": 2, "run_dir": str(tmp / "r"), "export_hf": False, "eval_after": False},
            "log": {"progress": False, "tensorboard": False}}


def _hf_dir(tmp: Path, family: str, edit=None, weights: str | None = None) -> str:
    """A checkpoint directory: config.json of a tiny preset (edited), and optionally broken weights."""
    d = tmp / f"hf_{family}"
    d.mkdir(exist_ok=True)
    preset = {"glm5": "glm5-flash-tiny", "qwen": "qwen3-moe-tiny"}.get(family, family)  # else a preset name
    c = to_hf_config(get_preset(preset))
    if edit:
        edit(c["text_config"] if family == "glm5" else c)
    (d / "config.json").write_text(json.dumps(c))
    if weights == "empty":
        (d / "model.safetensors").write_bytes(b"")
    elif weights == "truncated":
        from safetensors.torch import save_file

        save_file({"model.embed_tokens.weight": torch.zeros(16, 64)}, str(d / "model.safetensors"))
        data = (d / "model.safetensors").read_bytes()
        (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    return str(d)


def _yaml_text(tmp: Path, text: str) -> Path:
    p = tmp / "recipe.yaml"
    p.write_text(text)
    return p


def _set(field: str, value):
    def edit(c):
        c[field] = value
    return edit


# (row id, recipe changes (section -> settings) or a function tmp -> recipe path, CLI settings, message regex)
ROWS = [
    ("lr inf", {"optim": {"lr": float("inf")}}, [], r"optim\.lr must be a finite number"),
    ("lr inf on the command line", {}, ["--optim.lr", "inf"], r"optim\.lr must be a finite number"),
    ("lr nan", {}, ["--optim.lr", ".nan"], r"optim\.lr must be a finite number"),
    ("min_lr_ratio -1", {"optim": {"min_lr_ratio": -1}}, [], r"optim\.min_lr_ratio must be >= 0"),
    ("steps 2.7", {"train": {"steps": 2.7}}, [], r"train\.steps expects an integer, got 2\.7"),
    ("seq_len 2.7K", {}, ["--data.seq_len", "2.7K"], r"data\.seq_len expects an integer"),
    ("section twice", lambda t: _yaml_text(t, yaml.safe_dump(_base(t)) + "train:\n  steps: 3\n"),
     [], r"recipe\.yaml line \d+, column 1: 'train' is given twice \(first at line \d+\)"),
    ("key twice", lambda t: _yaml_text(t, "optim:\n  lr: 1.0e-3\n  lr: -1\n"), [],
     r"line 3.*'lr' is given twice \(first at line 2\)"),
    ("save_every -1", {"train": {"save_every": -1}}, [], r"train\.save_every must be >= 0"),
    ("grad_clip -1", {"optim": {"grad_clip": -1.0}}, [], r"optim\.grad_clip must be >= 0"),
    ("warmup_steps -1", {"optim": {"warmup_steps": -1}}, [], r"optim\.warmup_steps must be >= 0"),
    ("kmer_k -1", {"eval": {"kmer_k": -1}}, [], r"eval\.kmer_k must be >= 0"),
    ("kmer_k 40", {"eval": {"kmer_k": 40}}, [], r"eval\.kmer_k must be <= 30"),
    ("max_windows -1", {"eval": {"max_windows": -1}}, [], r"eval\.max_windows must be >= 0"),
    ("log.every 0", {"log": {"every": 0}}, [], r"log\.every must be >= 1"),
    ("eval.batch_size 0", {"eval": {"batch_size": 0}}, [], r"eval\.batch_size must be >= 1"),
    ("eval.seq_len 1", {"eval": {"seq_len": 1}}, [], r"eval\.seq_len must be >= 2"),
    ("train: 5", lambda t: _yaml_text(t, "train: 5\n"), [], r"config section 'train' must be a mapping"),
    ("betas one number", {"optim": {"betas": [0.9]}}, [], r"optim\.betas needs two numbers"),
    ("betas >= 1", {"optim": {"betas": [0.9, 1.5]}}, [], r"optim\.betas must be < 1"),
    ("betas a word", {}, ["--optim.betas", "high"], r"optim\.betas expects a number, got 'high'"),
    ("eps negative", {"optim": {"eps": -1e-8}}, [], r"optim\.eps must be > 0"),
    ("keep_checkpoints 0", {"train": {"keep_checkpoints": 0}}, [], r"train\.keep_checkpoints must be >= 1"),
    ("a bool as a number", {"optim": {"lr": True}}, [], r"optim\.lr expects a number, got True"),
    ("a list as a string", {"model": {"dtype": ["fp32"]}}, [], r"model\.dtype expects a single value"),
    ("train.device gpu", {"train": {"device": "gpu"}}, [], r"train\.device must be auto, cpu, cuda or cuda:N"),
    ("backend mpi", {"parallel": {"backend": "mpi"}}, [], r"parallel\.backend must be one of auto, nccl, gloo"),
    ("run_dir under a file", {"train": {"run_dir": "RUN_UNDER_FILE"}}, [], r"train\.run_dir .*g\.fa/r: .*g\.fa is a "
     r"file, not a directory"),
    ("yaml syntax", lambda t: _yaml_text(t, "train:\n  steps: [1,\n"), [], r"recipe\.yaml line \d+, column \d+"),
    ("config.json syntax", lambda t: _recipe_with_model(t, _broken_json(t)), [],
     r"config\.json is not valid JSON \(line 1, column \d+"),
    ("0-byte model.safetensors", lambda t: _recipe_with_model(t, _hf_dir(t, "qwen", weights="empty")), [],
     r"model\.init_from .*model\.safetensors is not a readable safetensors file \(0 bytes"),
    ("truncated model.safetensors", lambda t: _recipe_with_model(t, _hf_dir(t, "qwen", weights="truncated")), [],
     r"model\.safetensors is not a readable safetensors file .*truncated"),
    ("init_from missing", {"model": {"init_from": "/nonexistent/ckpt"}}, [], r"model\.init_from /nonexistent/ckpt "
                                                                             r"does not exist"),
    ("all-N training data", lambda t: _recipe_with_data(t, train=_fasta(t / "n.fa", "N" * 600)), [],
     r"data\.train \(.*n\.fa\): the sequences hold no A, C, G or T"),
    ("all-N held-out data", lambda t: _recipe_with_data(t, heldout=_fasta(t / "n.fa", "N" * 600)), [],
     r"data\.heldout \(n\.fa\): the held-out windows hold no A, C, G or T"),
    # GLM-5 (glm5_next): every field its loader does not implement
    ("glm5 hidden_act gelu", lambda t: _recipe_with_model(t, _hf_dir(t, "glm5", _set("hidden_act", "gelu"))), [],
     r"text_config\.hidden_act = 'gelu' is not supported by megaseq's glm5_next: .*'silu'"),
    ("glm5 attention_dropout", lambda t: _recipe_with_model(t, _hf_dir(t, "glm5", _set("attention_dropout", 0.1))),
     [], r"text_config\.attention_dropout = 0\.1 is not supported"),
    ("glm5 RoPE dim", lambda t: _recipe_with_model(t, _hf_dir(t, "glm5", _set("qk_rope_head_dim", 8))), [],
     r"text_config\.qk_rope_head_dim = 8 is not supported.*NoPE"),
    ("glm5 rope_scaling", lambda t: _recipe_with_model(
        t, _hf_dir(t, "glm5", _set("rope_scaling", {"rope_type": "yarn", "factor": 4}))), [],
     r"text_config\.rope_scaling = .*yarn.* is not supported"),
    ("glm5 aux loss", lambda t: _recipe_with_model(t, _hf_dir(t, "glm5", _set("output_router_logits", True))), [],
     r"text_config\.output_router_logits = True is not supported.*auxiliary"),
    ("glm5 unknown field", lambda t: _recipe_with_model(t, _hf_dir(t, "glm5", _set("sliding_windw", 128))), [],
     r"text_config\.sliding_windw .*is not a field megaseq's glm5_next loader knows"),
    ("glm5 mlp type", lambda t: _recipe_with_model(
        t, _hf_dir(t, "glm5", _set("mlp_layer_types", ["dense"] + ["moe"] * 7))), [],
     r"text_config\.mlp_layer_types holds \['moe'\]; megaseq's glm5_next supports dense and sparse"),
    ("glm5 linear_attn_config", lambda t: _recipe_with_model(
        t, _hf_dir(t, "glm5", _set("linear_attn_config", {"head_dim": 16, "chunk": 64}))), [],
     r"linear_attn_config\.chunk is not supported"),
    ("glm5 kv heads", lambda t: _recipe_with_model(t, _hf_dir(t, "glm5", _set("num_key_value_heads", 2))), [],
     r"num_key_value_heads = 2 differs from num_attention_heads = 4"),
    # Qwen3-MoE
    # YaRN and linear RoPE are implemented for Qwen3 (models/common/rope.py); other types are refused
    ("qwen3 rope dynamic", lambda t: _recipe_with_model(t, _hf_dir(
        t, "qwen", _set("rope_parameters", {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4}))), [],
     r"qwen3_moe rope_type 'dynamic' is not supported; megaseq implements default, linear, yarn RoPE"),
    ("qwen3 rope yarn without its length", lambda t: _recipe_with_model(t, _hf_dir(
        t, "qwen", _set("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4}))), [],
     r"qwen3_moe yarn RoPE needs rope_parameters\.original_max_position_embeddings"),
    ("qwen3 router jitter", lambda t: _recipe_with_model(t, _hf_dir(t, "qwen", _set("router_jitter_noise", 0.1))),
     [], r"router_jitter_noise = 0\.1 is not supported by megaseq's qwen3_moe"),
    ("qwen3 sliding window", lambda t: _recipe_with_model(t, _hf_dir(t, "qwen", _set("use_sliding_window", True))),
     [], r"use_sliding_window = True is not supported"),
    ("qwen3 hidden_act", lambda t: _recipe_with_model(t, _hf_dir(t, "qwen", _set("hidden_act", "gelu"))), [],
     r"hidden_act = 'gelu' is not supported by megaseq's qwen3_moe"),
    ("qwen3 attention_dropout", lambda t: _recipe_with_model(t, _hf_dir(t, "qwen", _set("attention_dropout", 0.1))),
     [], r"attention_dropout = 0\.1 is not supported"),
    ("qwen3 layer types", lambda t: _recipe_with_model(t, _hf_dir(
        t, "qwen", _set("layer_types", ["full_attention", "sliding_attention"] * 2))), [],
     r"layer_types holds \['sliding_attention'\]"),
    *[(f"{preset} {field}", lambda t, p=preset, f=field, v=value: _recipe_with_model(t, _hf_dir(t, p, _set(f, v))),
       [], rf"config\.json {field} = {value!r} is not supported by megaseq's {family}: ")
      for preset, family, field, value in (
          ("olmoe-tiny", "olmoe", "hidden_act", "gelu"), ("mixtral-tiny", "mixtral", "router_jitter_noise", 0.1),
          ("glm4-moe-tiny", "glm4_moe", "hidden_act", "gelu"),
          ("deepseek-v3-tiny", "deepseek_v3", "scoring_func", "softmax"),
          ("deepseek-v32-tiny", "deepseek_v32", "mlp_bias", True),
          ("kimi-linear-tiny", "kimi_linear", "mla_use_nope", False),
          ("qwen3-next-tiny", "qwen3_next", "attention_dropout", 0.1))],
    ("qwen3 unknown field", lambda t: _recipe_with_model(t, _hf_dir(t, "qwen", _set("moe_capacity", 1.25))), [],
     r"config\.json moe_capacity .*is not a field megaseq's qwen3_moe loader knows"),
]


def _broken_json(tmp: Path) -> str:
    d = tmp / "hf_broken"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "qwen3_moe", "hidden_size": 64,,}')
    return str(d)


def _recipe_with_model(tmp: Path, name: str) -> Path:
    raw = _base(tmp)
    raw["model"]["name"] = name
    return _yaml_text(tmp, yaml.safe_dump(raw))


def _recipe_with_data(tmp: Path, train: str | None = None, heldout: str | None = None) -> Path:
    raw = _base(tmp)
    if train:
        raw["data"]["train"] = [train]
    if heldout:
        raw["data"]["heldout"] = [heldout]
        raw["train"]["eval_after"] = True
    return _yaml_text(tmp, yaml.safe_dump(raw))


def _train(tmp: Path, changes, argv: list[str], capsys) -> tuple[int, str]:
    if callable(changes):
        recipe = changes(tmp)
    else:
        raw = _base(tmp)
        for section, values in changes.items():
            raw.setdefault(section, {}).update(values)
        if raw["train"]["run_dir"] == "RUN_UNDER_FILE":  # a path inside the training FASTA file
            raw["train"]["run_dir"] = str(tmp / "g.fa" / "r")
        recipe = _yaml_text(tmp, yaml.safe_dump(raw))
    capsys.readouterr()
    rc = main(["train", str(recipe), *argv])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("row, changes, argv, match", ROWS, ids=[r[0] for r in ROWS])
def test_bad_input_is_one_message_before_any_run_directory(row, changes, argv, match, tmp_path, capsys):
    rc, err = _train(tmp_path, changes, argv, capsys)
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("megaseq train: error: "), err
    import re

    assert re.search(match, lines[0]), lines[0]
    assert not (tmp_path / "r").exists(), "the run directory was created before the error"


def test_broken_message_check_would_fail(tmp_path, capsys):
    """The table's check is not vacuous: a good recipe passes it (rc 0 and a run directory)."""
    rc, err = _train(tmp_path, {"train": {"steps": 1}}, [], capsys)
    assert rc == 0 and (tmp_path / "r" / "metrics.jsonl").is_file(), err


# ---- a foreign config.yaml, overwrite ------------------------------------------------------------
@pytest.mark.parametrize("overwrite", [False, True])
def test_foreign_files_are_never_replaced_or_deleted(overwrite, tmp_path, capsys):
    run = tmp_path / "r"
    run.mkdir()
    (run / "config.yaml").write_text("my: own notes\n")
    (run / "data.csv").write_text("1,2\n")
    rc, err = _train(tmp_path, {"train": {"overwrite": overwrite}}, [], capsys)
    assert rc == 2 and "config.yaml not written by megaseq" in err and "even with --train.overwrite" in err, err
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", "data.csv"]
    assert (run / "config.yaml").read_text() == "my: own notes\n"


def test_overwrite_removes_only_what_megaseq_wrote(tmp_path, capsys):
    rc, err = _train(tmp_path, {"train": {"steps": 1, "export_hf": True}}, [], capsys)
    assert rc == 0, err
    run = tmp_path / "r"
    (run / "notes.txt").write_text("mine")
    (run / "extra").mkdir()
    (run / "extra" / "a.fa").write_text(">x\nA\n")
    rc, err = _train(tmp_path, {"train": {"steps": 1, "overwrite": True}}, [], capsys)
    assert rc == 0, err
    assert "kept 2 entries megaseq did not write: extra, notes.txt" in err
    assert (run / "notes.txt").read_text() == "mine" and (run / "extra" / "a.fa").is_file()
    assert not (run / "hf").exists()  # the first run's export went with it


@pytest.mark.parametrize("outputs", [["../victim"], ["/abs"], [".."], ["ok", 3], "config.yaml", None])
def test_a_manifest_naming_paths_outside_the_run_is_refused(outputs, tmp_path, capsys):
    """Overwrite removes the manifest's names: one that reaches outside the run directory (or is not a
    list of plain names) is a damaged manifest, refused with nothing removed."""
    rc, err = _train(tmp_path, {"train": {"steps": 1}}, [], capsys)
    assert rc == 0, err
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    run = tmp_path / "r"
    (run / ".megaseq-run.json").write_text(json.dumps({"megaseq_run": 1, "outputs": outputs}))
    before = sorted(p.name for p in run.iterdir())
    rc, err = _train(tmp_path, {"train": {"steps": 1, "overwrite": True}}, [], capsys)
    assert rc == 2 and ".megaseq-run.json is damaged" in err and "Traceback" not in err, err
    assert victim.read_text() == "keep me" and sorted(p.name for p in run.iterdir()) == before


# ---- model.name: a checkpoint directory with weights ---------------------------------------------
def test_model_name_dir_with_weights_trains_from_them(tmp_path, capsys):
    from megaseq.models.build import build_model
    from megaseq.models.hf_io import export_hf_checkpoint
    from megaseq.train.convert import load_megaseq_checkpoint

    spec = get_preset("qwen3-moe-tiny")
    src = build_model(spec, dtype=torch.float32, seed=123)
    export_hf_checkpoint(src, spec, tmp_path / "ckpt")
    raw = _base(tmp_path)
    raw["model"]["name"] = str(tmp_path / "ckpt")
    raw["train"]["eval_after"] = True  # writes the starting weights as step 0
    capsys.readouterr()
    assert main(["train", str(_yaml_text(tmp_path, yaml.safe_dump(raw)))]) == 0
    assert f"model weights from {tmp_path / 'ckpt'}" in capsys.readouterr().err
    before, _, _ = load_megaseq_checkpoint(tmp_path / "r" / "checkpoints" / "step_000000")
    for (name, a), b in zip(src.state_dict().items(), before.state_dict().values()):
        assert torch.equal(a, b), name  # not the seed-0 random init
    assert yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())["model"]["init_from"] == str(tmp_path / "ckpt")


# ---- divergence ------------------------------------------------------------------------------------
@pytest.mark.parametrize("save_every", [0, 1])
def test_diverging_run_stops_naming_the_step_and_writes_nothing_non_finite(save_every, tmp_path, capsys):
    from megaseq.train import checkpoint as ckpt
    from megaseq.train.convert import load_megaseq_checkpoint

    # lr 1e10: the first update overflows the forward. (At 1e6 the weights explode too, but RMSNorm's chunked
    # backward, written through the normalised value, stays finite where autograd of the reference overflowed.)
    rc, err = _train(tmp_path, {"optim": {"lr": 1e10}, "train": {"steps": 6, "save_every": save_every,
                                                                  "export_hf": True}}, [], capsys)
    assert rc == 2 and "Traceback" not in err, err
    import re

    m = re.search(r"training diverged at step (\d+): the loss is \S+ and the gradient norm \S+; the run stopped "
                  r"before updating the weights and wrote nothing for this step", err)
    assert m, err
    step = int(m.group(1))
    run = tmp_path / "r"
    assert not (run / "hf").exists() and not list(run.glob(".hf*"))
    found = ckpt.list_complete(run)
    assert all(s < step for s, _ in found) and [s for s, _ in found] == list(range(1, step))[-2:] * save_every
    for _, p in found:  # whatever was written is finite
        model, _, _ = load_megaseq_checkpoint(p)
        assert all(torch.isfinite(t).all() for t in model.state_dict().values())
    last = ckpt.latest_resumable(run)
    assert f"The newest resumable checkpoint is {last or 'none'}" in err


@pytest.mark.parametrize("weights", ["fp32", "bf16"])  # bf16: MasterAdamW, the finiteness decided in its step
def test_skip_policy_skips_then_stops(weights, tmp_path, capsys):
    model = {"model": {"dtype": weights, "weights": weights}} if weights == "bf16" else {}
    rc, err = _train(tmp_path, {"optim": {"lr": 1e10}, "train": {"steps": 12, "on_nonfinite": "skip"}, **model}, [],
                     capsys)
    import re

    assert rc == 2 and "on_nonfinite skip" not in err and "5 steps in a row were not finite" in err, err
    assert len(re.findall(r"step \d+ skipped: loss", err)) == 5, err


# ---- no pickle from checkpoints --------------------------------------------------------------------
class _Evil:
    def __reduce__(self):
        return (Path.touch, (Path("/tmp/megaseq-pwned"),))


def test_checkpoint_pickles_are_never_run(tmp_path, capsys):
    from megaseq.models.build import build_model
    from megaseq.train import checkpoint as ckpt

    rc, err = _train(tmp_path, {"train": {"steps": 1}}, [], capsys)
    assert rc == 0, err
    good = ckpt.latest_resumable(tmp_path / "r")
    spec = get_preset("qwen3-moe-tiny")
    ckpt.load_checkpoint(good, build_model(spec))  # the real metadata reads through the safe unpickler
    Path("/tmp/megaseq-pwned").unlink(missing_ok=True)
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    (bad / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(ValueError, match=r"\.metadata references pathlib\.Path\.touch|references pathlib"):
        ckpt.load_checkpoint(bad, build_model(spec))
    assert not Path("/tmp/megaseq-pwned").exists()
    (bad / ".metadata").write_bytes((good / ".metadata").read_bytes())
    (bad / "trainer_state.json").unlink()
    torch.save({"x": 1}, bad / "trainer_state.pt")
    model = build_model(spec)
    from megaseq.config import MemorySettings, OptimConfig
    from megaseq.train.optim import build_optimizer

    opt, sched = build_optimizer(model, OptimConfig(), 2, MemorySettings())
    with pytest.raises(ValueError, match=r"trainer_state\.pt \(a pickle.*not read"):
        ckpt.load_checkpoint(bad, model, opt, sched)


def test_resume_before_the_first_resumable_checkpoint_says_so(tmp_path, capsys):
    from megaseq.models.build import build_model
    from megaseq.models.hf_io import export_hf_checkpoint
    from megaseq.train import checkpoint as ckpt

    spec = get_preset("qwen3-moe-tiny")  # a run from a checkpoint writes its starting weights as step 0
    export_hf_checkpoint(build_model(spec, dtype=torch.float32, seed=123), spec, tmp_path / "ckpt")
    start = {"model": {"init_from": str(tmp_path / "ckpt")}}
    rc, err = _train(tmp_path, {**start, "train": {"steps": 2, "eval_after": True}}, [], capsys)
    assert rc == 0
    shutil.rmtree(tmp_path / "r" / "checkpoints" / "step_000002")  # as if killed before the end
    assert ckpt.latest_complete(tmp_path / "r") is not None and ckpt.latest_resumable(tmp_path / "r") is None
    rc, err = _train(tmp_path, {**start, "train": {"steps": 2, "eval_after": True, "resume": True}}, [], capsys)
    assert rc == 0 and "holds no resumable checkpoint: it stopped before its first resumable checkpoint" in err
    assert "starting again from step 0" in err


# ---- the export keeps every field of the source config ---------------------------------------------
def _same(src, out, path=""):
    """Every key of ``src`` is in ``out`` with an equal value (recursively); returns the differing paths."""
    diffs = []
    for k, v in src.items():
        if k not in out:
            diffs.append(f"{path}{k} (missing)")
        elif isinstance(v, dict) and isinstance(out[k], dict):
            diffs += _same(v, out[k], f"{path}{k}.")
        elif out[k] != v:
            diffs.append(f"{path}{k}: {v!r} -> {out[k]!r}")
    return diffs


def test_export_keeps_every_config_field_of_the_source(tmp_path):
    transformers = pytest.importorskip("transformers")
    from transformers.models.glm5_next import configuration_glm5_next as g

    text = dict(vocab_size=37, hidden_size=32, intermediate_size=40, moe_intermediate_size=12, num_hidden_layers=4,
                num_attention_heads=2, num_key_value_heads=2, n_routed_experts=6, num_experts_per_tok=2,
                kv_lora_rank=8, q_lora_rank=12, qk_nope_head_dim=8, v_head_dim=8, index_topk=8, index_head_dim=8,
                index_n_heads=4, index_kpool=4, linear_head_dim=8, linear_num_heads=2, pad_token_id=0,
                bos_token_id=1, eos_token_id=[2, 3], max_position_embeddings=4096,
                mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
                layer_types=["linear_attention"] * 3 + ["indexed_attention"])
    vision = dict(depth=2, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=32,
                  projection_intermediate_size=16, patch_size=14, image_size=56)
    glm = json.loads(g.Glm5NextConfig(text_config=text, vision_config=vision, image_token_id=30,
                                      video_token_id=31).to_json_string())
    qwen = json.loads(transformers.Qwen3MoeConfig(
        vocab_size=37, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12, intermediate_size=24,
        bos_token_id=1, eos_token_id=2, sliding_window=4096, max_window_layers=28).to_json_string())
    for src in (glm, qwen):
        out = to_hf_config(from_hf_config(src))
        diffs = [d for d in _same(src, out) if not d.startswith(("dtype", "text_config.dtype"))]
        assert diffs == [], diffs
        assert from_hf_config(out) == from_hf_config(src)
    # the broken variant: a spec without the carried fields drops them, and the check sees it
    bare = from_hf_config(glm).replace(hf_extra={})
    assert any("eos_token_id" in d or "image_token_id" in d for d in _same(glm, to_hf_config(bare)))

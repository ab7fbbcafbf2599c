"""``megaseq bench --baseline`` on a LoRA recipe: the peer (transformers + PEFT on the same targets, Liger where
it is installed, activation checkpointing) runs a step in the same job and reports its figures; the routing each
row used; bench's choice of routing; the peer's table with out-of-memory rows and the longest length reached."""

from __future__ import annotations

import pytest

from megaseq.config import load_config

pytest.importorskip("transformers")
pytest.importorskip("peft")

TINY = "recipes/qwen3-moe-tiny-dna.yaml"
LORA = ["lora.rank=4", "lora.targets=[all]", "data.kind=random"]


def _expected_adapter_params(cfg) -> int:
    """megaseq's adapter parameters for the recipe (its own target resolution, not PEFT's)."""
    from megaseq.models.adapters import projections, resolve_targets
    from megaseq.models.presets import resolve_spec
    from megaseq.plan.params import param_table

    table = param_table(resolve_spec(cfg.model.name))
    return sum(p.adapter_params(cfg.lora.rank) for p in resolve_targets(projections(table), cfg.lora.targets, table))


def _check_peer_row(row: dict, cfg) -> None:
    assert row["status"] == "ok" and row["tokens_per_s"] > 0 and row["system"] == "transformers"
    assert row["trained_params"] == _expected_adapter_params(cfg), "PEFT must adapt exactly megaseq's targets"
    peer = row["peer"]
    assert "LoRA r4" in peer["peft"] and "expert tensors" in peer["peft"]
    assert "checkpointing" in peer and peer["routing"] == "balanced"


def test_lora_recipe_runs_the_peer_in_the_same_job(tmp_path) -> None:
    from megaseq.bench.report import markdown
    from megaseq.bench.run import run_bench

    cfg = load_config(TINY, LORA)
    result = run_bench(cfg, [64], steps=1, baseline=True, out=str(tmp_path / "bench"), isolate=False)
    ours = result["rows"][0]
    assert ours["status"] == "ok" and ours["routing"] == "balanced"
    assert ours["moe_load_max"] == pytest.approx(1.0)  # 64 tokens x top-2 over 8 experts: 16 rows each
    row = result["reference_rows"][0]
    _check_peer_row(row, cfg)
    assert row["peer"]["liger"] == "not applied: Liger's kernels run on CUDA, the model is on cpu"
    assert result["longest"] == {"megaseq": 64, "reference": 64}
    md = markdown(result)
    assert "1.00 (balanced)" in md and "reference (the peer): system: transformers" in md
    assert ours["first_step_s"] > 0 and row["first_step_s"] > 0
    assert "first step against a warm step: 64 (random)" in md
    assert ours["build_s"] > 0 and "s to the first step's end" in md  # the first call's wall time
    import bench_scripts

    summary = bench_scripts.load("speed/speed_summary").summarize(result)["rows"][0]
    assert summary["megaseq_over_peer"] == pytest.approx(ours["tokens_per_s"] / row["tokens_per_s"])
    assert summary["first_over_warm"] > 0 and summary["peer"]["trained_params"] == row["trained_params"]
    assert (tmp_path / "bench.json").is_file()


def test_peer_check_fails_on_other_targets(monkeypatch) -> None:
    """A broken peer (PEFT without the expert tensors) is caught by the trained-parameter check."""
    from megaseq.bench import peer
    from megaseq.bench.reference import measure_reference

    real = peer.peft_lora_config

    def no_experts(cfg, spec):
        return {**real(cfg, spec), "target_parameters": []}

    monkeypatch.setattr(peer, "peft_lora_config", no_experts)
    cfg = load_config(TINY, LORA)
    row = measure_reference(cfg, 32, 1, "balanced")
    with pytest.raises(AssertionError, match="exactly megaseq's targets"):
        _check_peer_row(row, cfg)


def test_routing_auto_and_its_refusals() -> None:
    from megaseq.bench.run import resolve_routing

    cfg = load_config(TINY, ["data.kind=random"])
    assert resolve_routing(cfg, "auto", "random") == "balanced"
    assert resolve_routing(cfg, "auto", "genome") == "natural"
    assert resolve_routing(cfg, "natural", "random") == "natural"
    cfg.model.init_from = "some/checkpoint"  # trained weights route as they were trained
    assert resolve_routing(cfg, "auto", "random") == "natural"
    assert resolve_routing(cfg, "balanced", "random") == "balanced"
    with pytest.raises(ValueError, match="--routing balanced with --source genome"):
        resolve_routing(cfg, "balanced", "genome")
    with pytest.raises(ValueError, match="--routing must be one of"):
        resolve_routing(cfg, "even", "random")


def test_bench_refuses_a_bad_routing_before_any_work(capsys) -> None:
    from megaseq.cli.main import main

    assert main(["bench", TINY, "--routing", "even", "--seq-lens", "64"]) == 2
    assert "--routing must be one of natural, balanced" in capsys.readouterr().err


def test_peer_table_says_out_of_memory_and_the_longest_length() -> None:
    from megaseq.bench.report import reference_lines

    ok = {"seq_len": 8192, "status": "ok", "tokens_per_s": 100.0, "measured_gpu_gib": 70.0, "mfu": 0.2}
    oom = {"seq_len": 65536, "status": "oom", "error": "CUDA out of memory"}
    result = {"rows": [{"seq_len": 8192, "source": "random", "tokens_per_s": 250.0}],
              "reference_rows": [ok, oom], "longest": {"megaseq": 8192, "reference": 8192}}
    text = "\n".join(reference_lines(result))
    assert "| 8,192 | ok | 100 | 70.0 | 20.0% | 2.50x |" in text
    assert "| 65,536 | out of memory |" in text
    assert "megaseq 8192, reference 8192" in text


def test_peer_of_a_large_model_is_built_by_transformers(monkeypatch) -> None:
    """Past ``SAME_WEIGHTS_MAX_PARAMS`` the peer is transformers' own random init (no fp32 copy on the host)."""
    import torch

    from megaseq.bench import peer

    monkeypatch.setattr(peer, "SAME_WEIGHTS_MAX_PARAMS", 0)
    cfg = load_config(TINY, LORA)
    model, spec, notes = peer.build_peer(cfg, torch.device("cpu"), "natural")
    assert notes["weights"].startswith("transformers' random init") and notes["routing"] == "natural"
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == _expected_adapter_params(cfg)
    ids = torch.randint(0, spec.vocab_size, (1, 17))
    model(input_ids=ids, labels=ids).loss.backward()

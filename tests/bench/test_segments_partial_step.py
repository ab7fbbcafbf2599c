"""benchmarks/lora/segments_partial_step.py: the planned sequence-segments step (kimi-linear-tiny LoRA, 64-token
segments, K/V in host memory, the base streamed) run to the last segment's backward and stopped; its forward
pass's loss is the whole step's, and a run stopped before the last segment's backward fails its checks."""

from __future__ import annotations

import json

import pytest
import torch

import bench_scripts

bench = bench_scripts.load("lora/segments_partial_step", "segments_partial_step")
ARGS = ["256", "--smoke", "--warm-tokens", "32", "--forward-loss"]


def run(tmp_path, *extra: str) -> dict:
    out = tmp_path / "partial.json"
    assert bench.main([*ARGS, *extra, "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_partial_step_forward_loss_is_the_whole_steps(tmp_path):
    row = run(tmp_path, "--check-full")
    assert row["checks"] == []
    assert row["memory_plan"]["model_segment_tokens"] == 64 and row["memory_plan"]["stream_base"]
    assert {"model_segments", "stream_base"} <= set(row["fixes"])
    assert row["segments"] == 4 and len(row["forward_segment_s"]) == 4
    assert row["backward_segments_run"] == row["backward_segments"] == 2 == len(row["backward_segment_s"])
    assert row["trainable_with_grad"] == row["trainable"] > 0
    assert row["stopped"].startswith("stopped after the backward of 2 of 4")
    assert row["full_step_loss"] == pytest.approx(row["forward_loss"], rel=1e-5)
    assert row["estimate_step_s"] > row["forward_s"] > 0
    assert set(row["planned_phase_peaks_gib"]) >= {"forward", "backward"}
    lines = [json.loads(t) for t in (tmp_path / "partial.json.progress.jsonl").read_text().splitlines()]
    assert [t["phase"] for t in lines[:2]] == ["built", "warmed"] and lines[1]["host_peak_gib"] > 0
    assert [(t["phase"], t["done"]) for t in lines[2:]] == [("forward", j) for j in range(4)] + [
        ("backward", 0), ("backward", 1), ("backward", 2)]


def test_stopped_before_the_last_segments_backward_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "should_stop", lambda done, k: True)  # stops as the forward pass ends
    row = run(tmp_path)
    assert row["backward_segments_run"] == 0 and row["trainable_with_grad"] == 0
    assert any("the backward ran 0 segments" in c for c in row["checks"])
    assert row["estimate_step_s"] is None


def test_a_forward_loss_missing_a_segment_fails(tmp_path, monkeypatch):
    on_hidden = bench.Probe.on_hidden

    def skip_first(self, mod, args, hidden):  # the first segment's loss left out
        if self.j != 0:
            on_hidden(self, mod, args, hidden)

    monkeypatch.setattr(bench.Probe, "on_hidden", skip_first)
    row = run(tmp_path, "--check-full")
    assert any("is not the whole step's" in c for c in row["checks"])


def split(tmp_path, *extra: str) -> tuple[dict, dict]:
    """The forward pass in two processes: segments [0, 2) saved, then the rest from the save."""
    carry = str(tmp_path / "carry")
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert bench.main([*ARGS, *extra, "--forward-until", "2", "--carry", carry, "--out", str(a)]) == 0
    assert bench.main([*ARGS, *extra, "--resume", carry, "--check-full", "--out", str(b)]) == 0
    return json.loads(a.read_text()), json.loads(b.read_text())


@pytest.mark.parametrize("kv_host", ["true", "false"])
def test_a_forward_pass_split_over_two_processes_is_the_whole_steps(tmp_path, kv_host):
    a, b = split(tmp_path, f"memory.segment_kv_host={kv_host}")
    assert a["checks"] == [] and a["carry_saved_before"] == 2 and len(a["forward_segment_s"]) == 2
    assert a["stopped"].startswith("stopped before the forward of segment 2 of 4")
    assert b["checks"] == [] and b["resumed_from"] == 2 and len(b["forward_segment_s"]) == 4
    assert b["full_step_loss"] == pytest.approx(b["forward_loss"], rel=1e-6)
    lines = [json.loads(t) for t in (tmp_path / "b.json.progress.jsonl").read_text().splitlines()]
    assert [(t["phase"], t["done"]) for t in lines[2:4]] == [("forward", 2), ("forward", 3)]


def test_a_split_forward_pass_without_the_carried_states_fails(tmp_path, monkeypatch):
    load = bench.Carry._load

    def drop_states(self, st):  # the linear layers' states at segment 2 not restored: they start from zero
        load(self, st)
        for per in st.carried.values():
            if per[2] is not None:
                per[2] = tuple(torch.zeros_like(t) for t in per[2])

    monkeypatch.setattr(bench.Carry, "_load", drop_states)
    _, b = split(tmp_path)
    assert any("is not the whole step's" in c for c in b["checks"])


def test_resume_refuses_another_batch_and_a_partial_save(tmp_path):
    carry = tmp_path / "carry"
    assert bench.main([*ARGS, "--forward-until", "2", "--carry", str(carry), "--out", str(tmp_path / "a.json")]) == 0
    with pytest.raises(SystemExit, match="batch differs"):
        bench.main([*ARGS, "--resume", str(carry), "--out", str(tmp_path / "b.json"), "data.seed=7"])
    (carry / "meta.json").unlink()
    with pytest.raises(SystemExit, match="no meta.json"):
        bench.main([*ARGS, "--resume", str(carry), "--out", str(tmp_path / "b.json")])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_partial_step_peaks_on_gpu(tmp_path):
    row = run(tmp_path, "--check-full")
    assert row["device"] != "cpu" and row["checks"] == []
    assert row["backward_peak_gib"] > 0 and row["forward_peak_gib"] > 0
    assert row["measured_peak_gib"] == max(row["forward_peak_gib"], row["backward_peak_gib"])
    assert {"plan_vs_measured", "plan_vs_measured_backward"} <= set(row)

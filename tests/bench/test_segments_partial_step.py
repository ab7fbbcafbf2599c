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
    assert row["backward_segments_run"] == row["backward_segments"] == 1 == len(row["backward_segment_s"])
    assert row["trainable_with_grad"] == row["trainable"] > 0
    assert row["stopped"].startswith("stopped after the backward of 1 of 4")
    assert row["full_step_loss"] == pytest.approx(row["forward_loss"], rel=1e-5)
    assert row["estimate_step_s"] > row["forward_s"] > 0
    assert set(row["planned_phase_peaks_gib"]) >= {"forward", "backward"}
    lines = [json.loads(t) for t in (tmp_path / "partial.json.progress.jsonl").read_text().splitlines()]
    assert [t["phase"] for t in lines[:2]] == ["built", "warmed"] and lines[1]["host_peak_gib"] > 0
    assert [(t["phase"], t["done"]) for t in lines[2:]] == [("forward", j) for j in range(4)] + [
        ("backward", 0), ("backward", 1)]


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_partial_step_peaks_on_gpu(tmp_path):
    row = run(tmp_path, "--check-full")
    assert row["device"] != "cpu" and row["checks"] == []
    assert row["backward_peak_gib"] > 0 and row["forward_peak_gib"] > 0
    assert row["measured_peak_gib"] == max(row["forward_peak_gib"], row["backward_peak_gib"])
    assert {"plan_vs_measured", "plan_vs_measured_forward", "plan_vs_measured_backward"} <= set(row)

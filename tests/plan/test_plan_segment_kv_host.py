"""The planner's side of ``memory.segment_kv_host`` (sequence segments' K/V, or MLA latents, and their fp32
gradients in host memory): chosen only where the GPU-resident store does not fit and the host holds it; its host
bytes, its GPU bytes in flight and its copy traffic against what the runtime (``memory/segment_host.py``) holds
and copies in a CPU step; a forced setting without sequence segments refused with the fix."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from megaseq.config import AdapterSettings, MemoryConfig, MemorySettings, load_config, parse_size
from megaseq.models.presets import resolve_spec
from megaseq.plan import GB, Mesh
from megaseq.plan import components as C
from megaseq.plan.choice import _fits
from megaseq.plan.fixes import Budgets, segment_kv_host_copies
from megaseq.plan.given import run_for
from megaseq.plan.phases import evaluate
from megaseq.plan.planner import plan_from_config
from megaseq.plan.run import Run
from megaseq.plan.segments import segment_kv_host_bytes, segment_kv_rows, segment_store_bytes

K = 1024
ROOT = Path(__file__).resolve().parents[2]


def _qwen3_30b_lora(n: int, host: str | None = None):
    cfg = load_config(str(ROOT / "recipes/qwen3-30b-a3b-lora.yaml"),
                      [f"data.seq_len={n}", f"model.name={ROOT / 'recipes/qwen3-30b-a3b/config.json'}"])
    return plan_from_config(cfg, world_size=1, host_bytes=parse_size(host) if host else None)


def test_qwen3_30b_lora_at_1m_on_one_h200_with_a_larger_host():
    """Qwen3-30B-A3B LoRA at 1M on one H200: the K/V store (48 layers x 6 KB a token, 288 GiB) fits neither the
    GPU nor the 128 GB host, so the plan does not fit there; with a 320 GB host it fits with the store in host
    memory, about two layers' worth (14 GiB) on the GPU. At 512K on the 128 GB host the plan does not take it."""
    big = _qwen3_30b_lora(1 << 20, "320G")
    assert big.fits and big.memory["segment_kv_host"] and big.memory["model_segment_tokens"]
    comps = {c[0]: c for c in big.components}
    assert comps["host: segment K/V + fp32 gradients (memory.segment_kv_host)"][2] == 48 * (1 << 20) * 1024 * 6
    assert comps["segment K/V in flight (host-kept store)"][1] == (1 << 20) * 1024 * 14
    assert "host memory" in dict((f[0], f[2]) for f in big.fixes)["model_segments"]
    assert not _qwen3_30b_lora(1 << 20).fits
    assert not _qwen3_30b_lora(512 * K).memory["segment_kv_host"]


def test_chosen_only_where_the_gpu_store_does_not_fit():
    """Where the plan keeps the store in host memory, the same settings with the store on the GPU do not fit."""
    big = _qwen3_30b_lora(1 << 20, "320G")
    cfg = load_config(str(ROOT / "recipes/qwen3-30b-a3b-lora.yaml"),
                      [f"model.name={ROOT / 'recipes/qwen3-30b-a3b/config.json'}"])
    run = run_for(resolve_spec(cfg.model.name), 1 << 20, big.memory, weights="fp32",
                  adapters=AdapterSettings.of(cfg))
    budgets = Budgets(host_bytes=320 * GB)
    assert _fits(evaluate(run), budgets, run.mesh)
    on_gpu = evaluate(replace(run, memory=run.memory.replace(segment_kv_host=False)))
    assert not _fits(on_gpu, budgets, run.mesh) and on_gpu.peak_gpu > 2 * budgets.gpu_bytes


def test_forced_without_segments_names_the_fix():
    with pytest.raises(ValueError, match="memory.segment_kv_host.*--memory.model_segment_tokens"):
        MemoryConfig(auto=False, segment_kv_host=True)
    assert MemorySettings(segment_kv_host=True, model_segment_tokens=8).segment_kv_host


def test_host_bytes_and_copies_are_the_runtimes(monkeypatch):
    """A float64 CPU step of qwen3-moe-tiny with the host store: the host bytes the runtime allocates equal
    ``segment_kv_host_bytes``; the bytes it copies in and out lie within the planner's per-pass count, which is
    an upper bound (it counts the accumulated gradient of the last segment's rows and of the first backward's
    earlier rows, which do not exist yet)."""
    import test_segment_kv_host as host_test

    from megaseq.memory import segment_host as sh
    from megaseq.ops import dispatch

    copied = {"in": 0, "out": 0}
    orig_fetch, orig_out, orig_rows = sh.HostKV._fetch, sh.HostKV._copy_out, sh.HostKV.grad_rows

    def fetch(self, key, r, grads, device):
        got = orig_fetch(self, key, r, grads, device)
        copied["in"] += sum(t.numel() * t.element_size() for t in got[0] + got[1] if t is not None)
        return got

    def out(self, host, s, x):
        copied["out"] += x.numel() * x.element_size()
        orig_out(self, host, s, x)

    def rows(self, name, s, e, dtype, device):
        copied["in"] += self.grad[name][:, s:e].numel() * self.grad[name].element_size()
        return orig_rows(self, name, s, e, dtype, device)

    monkeypatch.setattr(sh.HostKV, "_fetch", fetch)
    monkeypatch.setattr(sh.HostKV, "_copy_out", out)
    monkeypatch.setattr(sh.HostKV, "grad_rows", rows)
    hosted = []
    orig_release = sh.HostKV.release
    monkeypatch.setattr(sh.HostKV, "release", lambda self: (hosted.append(self.host_bytes()), orig_release(self))[1])
    with dispatch.configured(preferred={"attention": ["torch_exact"]}):
        model = host_test._model("qwen3-moe-tiny")
        ids, labels = host_test._batch(model)
        host_test.segmented(model, ids[:1], labels[:1], 9, None, kv_host=True)
    run = Run(spec=model.spec, seq_len=host_test.S, batch=1, mesh=Mesh(), model_dtype="fp64",
              memory=MemorySettings(model_segment_tokens=9, segment_kv_host=True),
              counts=C.gpu_counts(C.count_params(model.spec), Mesh()))
    assert hosted == [segment_kv_host_bytes(run)]
    planned = sum(segment_kv_host_copies(run))
    measured = copied["in"] + copied["out"]
    print(f"\ncopied {measured} B, planned {planned} B; in flight {segment_store_bytes(run)}")
    assert measured <= planned <= 1.25 * measured
    assert segment_kv_rows(run) == [2 * 2 * 16] * 4

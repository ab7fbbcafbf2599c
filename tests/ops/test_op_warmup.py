"""The op warm-up (``ops.op_warmup``): the distinct aten ops of a step, backward included, recorded with their
layouts; replayed once each on zeros with the random-number state kept; manifests named and checked like the
kernel manifests; replayed inside the precompile's join and recorded beside its first-step record."""

from __future__ import annotations

import json
import threading

import pytest
import torch
import torch.nn.functional as F

from megaseq.ops import op_warmup, precompile


def _step(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> None:
    """A layer's forward and backward: a linear of a transposed input, a norm, a softmax, an indexing op."""
    y = F.linear(x.t(), w, b)
    y = F.rms_norm(y, (y.shape[-1],))
    idx = torch.zeros(3, dtype=torch.long)
    (y.softmax(-1)[idx].sum() + y.pow(2).mean()).backward()


def _tensors(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 5, dtype=dtype, generator=g, requires_grad=True)
    w = torch.randn(6, 8, dtype=dtype, generator=g, requires_grad=True)
    b = torch.randn(6, dtype=dtype, generator=g, requires_grad=True)
    return x, w, b


def _record(fn, *args) -> list:
    rec = op_warmup.Recorder(torch.device("cpu"))
    with rec:
        fn(*args)
    return rec.entries


def _names(entries):
    return [e[0] for e in entries]


def test_the_backward_is_recorded_with_each_layout_and_no_view_or_factory():
    x, w, b = _tensors()
    entries = _record(_step, x, w, b)
    names = _names(entries)
    assert len(names) == len({json.dumps(e) for e in entries})  # each distinct op once
    assert not any(n.split(".")[1] in ("view", "t", "transpose", "empty", "empty_strided", "expand") for n in names)
    # the weight's gradient (6 x 8) is an mm of the backward: the autograd engine carries the mode there
    grads = [e for e in entries if e[0] in ("aten.mm.default", "aten.addmm.default")]
    shapes = [[a["T"][0] for a in e[1] if isinstance(a, dict)] for e in grads]
    assert [[6, 5], [5, 8]] in shapes, shapes
    # the transposed input keeps its strides (a column-major 5 x 8)
    assert any(a["T"][:2] == [[5, 8], [1, 5]] for e in grads for a in e[1] if isinstance(a, dict))


def test_a_replay_calls_the_recorded_ops_again_at_the_same_layouts():
    """Recording the replay gives back the manifest: the same ops, at the same shapes, strides and dtypes (a
    replay that made contiguous tensors, or dropped an argument, fails this)."""
    x, w, b = _tensors()
    entries = _record(_step, x, w, b)
    again = _record(op_warmup.replay, entries, torch.device("cpu"))
    got = {json.dumps(e) for e in again}
    assert all(json.dumps(e) in got for e in entries)
    r = op_warmup.replay(entries, torch.device("cpu"))
    assert (r.ops, r.skipped, r.failed) == (len(entries), 0, 0)


def test_replay_keeps_the_random_state_and_counts_what_it_skips_or_what_raises():
    entries = _record(lambda t: t.bernoulli_(0.5), torch.empty(64))
    assert _names(entries) == ["aten.bernoulli_.float"]
    big = [["aten.add.Tensor", [{"T": [[1 << 20], [1], 0, "float32", False]}] * 2, {}]]
    bad = [["aten.mm.default", [{"T": [[2, 3], [3, 1], 0, "float32", False]}] * 2, {}]]  # 2x3 @ 2x3 raises
    before = torch.get_rng_state()
    r = op_warmup.replay(entries + big + bad, torch.device("cpu"), max_bytes=1 << 20)
    assert (r.ops, r.skipped, r.failed) == (1, 1, 1)
    assert torch.equal(torch.get_rng_state(), before)


def test_replay_stops_when_told_and_counts_what_it_left():
    entries = _record(_step, *_tensors())
    calls = iter(range(len(entries)))
    r = op_warmup.replay(entries, torch.device("cpu"), until=lambda: next(calls) >= 2)
    assert (r.ops, r.left) == (2, len(entries) - 2)


def test_the_join_replays_only_while_the_compiles_run(monkeypatch, tmp_path):
    """The warm-up is handed the background's ``done``: false while the compiles run, true once they end."""
    monkeypatch.setattr(precompile, "current_target", lambda: ("3.6.0", "cuda:90"))
    monkeypatch.setattr("megaseq.ops.triton_autotune.install", lambda: None)
    gate = threading.Event()
    monkeypatch.setattr(precompile, "precompile", lambda *a, **k: (gate.wait(), precompile.Result())[1])
    seen = []

    class Probe:
        def replay(self, log, until):
            seen.append(until())
            gate.set()
            pre.background._thread.join()
            seen.append(until())

        def summary(self):
            return {}

    user = tmp_path / "k"
    precompile.write_manifest(user / precompile.manifest_name("fp", "cuda:90"), [{"kernel": "m.k", "spec": "s"}],
                              "3.6.0", "cuda:90")
    pre = precompile.RunPrecompile("fp", None, None, 1, shipped=tmp_path / "none", user=user, warmup=Probe())
    pre.join(lambda line: None)
    assert seen == [False, True]


@torch.library.custom_op("megaseq_test::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_ops_over_many_tensors_or_of_other_namespaces_are_not_recorded():
    ts = [torch.ones(2) for _ in range(op_warmup.MAX_TENSORS + 1)]
    assert _record(lambda: torch._foreach_add_(ts, 1.0)) == []
    assert _names(_record(lambda: torch._foreach_add_(ts[:2], 1.0))) == ["aten._foreach_add_.Scalar"]
    assert _record(_twice, torch.ones(3)) == []  # another namespace: a kernel of its own, not replayable
    assert _names(_record(lambda x: x * 2, torch.ones(3))) == ["aten.mul.Tensor"]


def test_manifests_round_trip_and_another_torch_or_gpu_is_not_used(tmp_path, caplog):
    want = {"torch": "2.11.0", "device": "NVIDIA H100 80GB HBM3"}
    p = tmp_path / op_warmup.name("fp", 8192, 1)
    assert p.name == "fp-8192x1.json" and op_warmup.read(p, want) is None
    op_warmup.write(p, [["aten.mm.default", [], {}]], want)
    assert op_warmup.read(p, want) == [["aten.mm.default", [], {}]]
    with caplog.at_level("INFO"):
        assert op_warmup.read(p, {**want, "device": "NVIDIA H200"}) is None
        p.write_text("{")
        assert op_warmup.read(p, want) is None
    assert "not used" in caplog.text


def _run_warmup(tmp_path, shipped_entries=None):
    shipped, user = tmp_path / "shipped", tmp_path / "user"
    want = op_warmup.target(torch.device("cpu"))
    if shipped_entries is not None:
        op_warmup.write(shipped / op_warmup.name("fp", 64, 1), shipped_entries, want)
    return op_warmup.RunWarmup("fp", 64, 1, torch.device("cpu"), shipped=shipped, user=user), user


def test_a_run_without_a_manifest_records_its_first_step_and_the_next_replays_it(tmp_path):
    w, user = _run_warmup(tmp_path)
    assert w.replay() is None
    x, wt, b = _tensors()
    with w.recording():
        _step(x, wt, b)
    assert w.summary()["recorded"] > 5 and (user / "fp-64x1.json").exists()
    nxt, _ = _run_warmup(tmp_path)
    r = nxt.replay(lambda line: None)
    assert r is not None and r.ops == w.summary()["recorded"] and r.failed == 0
    with nxt.recording():  # a manifest found: nothing recorded again
        _step(*_tensors())
    assert nxt.summary()["recorded"] == 0


def test_a_step_longer_than_the_recording_limit_is_not_recorded(tmp_path):
    w = op_warmup.RunWarmup("fp", op_warmup.RECORD_MAX_LEN * 2, 1, torch.device("cpu"), shipped=tmp_path,
                            user=tmp_path / "user")
    with w.recording():
        _step(*_tensors())
    assert w.summary()["recorded"] == 0 and not (tmp_path / "user").exists()


def test_the_shipped_manifest_wins_over_the_users(tmp_path):
    w, user = _run_warmup(tmp_path, [["aten.neg.default", [{"T": [[4], [1], 0, "float32", False]}], {}]])
    op_warmup.write(user / "fp-64x1.json", [], op_warmup.target(torch.device("cpu")))
    assert _names(w.entries) == ["aten.neg.default"]


def test_the_precompiles_join_replays_the_warmup_and_its_record_holds_the_ops(monkeypatch, tmp_path):
    """``RunPrecompile(warmup=...)``: ``join`` replays before it waits, ``recording`` records the ops beside the
    kernels, ``summary`` carries the warm-up's counts; a warm-up that raises is said and the join goes on."""
    monkeypatch.setattr(precompile, "current_target", lambda: ("3.6.0", "cuda:90"))
    monkeypatch.setattr("megaseq.ops.triton_autotune.install", lambda: None)
    w, user = _run_warmup(tmp_path)
    pre = precompile.RunPrecompile("fp", None, None, 1, shipped=tmp_path / "none", user=tmp_path / "k", warmup=w)
    lines: list[str] = []
    pre.join(lines.append)
    with pre.recording():
        _step(*_tensors())
    s = pre.summary()["op_warmup"]
    assert s["recorded"] > 5 and s["entries"] == 0

    class Broken:
        def replay(self, log, until):
            raise RuntimeError("boom")

        def summary(self):
            return {}

    pre = precompile.RunPrecompile("fp", None, None, 1, shipped=tmp_path / "none", user=tmp_path / "k",
                                   warmup=Broken())
    lines = []
    pre.join(lines.append)
    assert any("op warm-up failed (RuntimeError: boom)" in line for line in lines)
    assert any(line.startswith("precompiled") for line in lines)


def test_start_precompile_adds_the_warmup_unless_switched_off(monkeypatch):
    from megaseq.config import build_config
    from megaseq.models.presets import resolve_spec
    from megaseq.ops import autotune, switches
    from megaseq.train import build

    monkeypatch.setattr(precompile, "enabled", lambda device_type: True)
    monkeypatch.setattr(autotune, "mode", lambda: "full")
    monkeypatch.setattr(precompile, "RunPrecompile", lambda *a, **k: k["warmup"])
    monkeypatch.setattr(op_warmup, "RunWarmup", lambda fp, seq_len, batch, device: (seq_len, batch, device))
    cfg = build_config(None, ["model.name=qwen3-moe-tiny", "data.seq_len=64"])
    spec = resolve_spec(cfg.model.name)
    cuda = torch.device("cuda", 0)
    assert build.start_precompile(cfg, spec, cuda) == (64, cfg.train.batch_size, cuda)
    monkeypatch.setenv("MEGASEQ_WARM_OPS", "0")
    assert build.start_precompile(cfg, spec, cuda) is None
    monkeypatch.setenv("MEGASEQ_WARM_OPS", "2")
    with pytest.raises(ValueError, match="MEGASEQ_WARM_OPS"):
        switches.warm_ops()


# ---- on a GPU ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_step_replays_without_a_failure_and_keeps_the_cuda_random_state():
    dev = torch.device("cuda")
    x, w, b = (t.detach().to(dev, torch.bfloat16).requires_grad_() for t in _tensors())
    rec = op_warmup.Recorder(dev)
    with rec:
        _step(x, w, b)
        torch.nn.functional.dropout(torch.ones(128, device=dev), 0.5)
    assert any(e[0] == "aten.mm.default" for e in rec.entries)
    before = torch.cuda.get_rng_state(dev)
    r = op_warmup.replay(rec.entries, dev)
    assert (r.ops, r.failed) == (len(rec.entries), 0)
    assert torch.equal(torch.cuda.get_rng_state(dev), before)

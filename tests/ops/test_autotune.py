"""Autotuning a new machine does not pay for again (``ops.autotune``, ``ops.triton_autotune``, ``megaseq tune``):
length buckets, the per-user cache directory, shipped and user tables read before tuning, pruned spaces, Triton's
autotuner reading the tables (through a stand-in with Triton's ``run`` / ``prune_configs`` contract, CPU only),
and the tune verb's argument handling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megaseq.ops import autotune, triton_autotune
from megaseq.ops.autotune import TunedTable, entry_key, prune, seq_bucket


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Each test its own cache root and tables, no mode set."""
    monkeypatch.setenv("MEGASEQ_CACHE_DIR", str(tmp_path / "cache"))
    for var in ("MEGASEQ_AUTOTUNE", "MEGASEQ_FLA_AUTOTUNE", "TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING",
                "TRITON_INTERPRET"):  # (the stand-in autotuner is not Triton's interpreter)
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(autotune, "_tables", {})
    # the pruned clock's benchmarker (Triton's, on a GPU): the stand-in launches the config once
    monkeypatch.setattr(triton_autotune, "benchmarker",
                        lambda: lambda fn, warmup, rep, quantiles: fn() or [1.0] * len(quantiles))


class Cfg:
    """A Triton ``Config`` stand-in: ``kwargs``, ``num_warps``, ``num_stages``."""

    def __init__(self, B: int, num_warps: int = 4, num_stages: int = 2) -> None:
        self.kwargs, self.num_warps, self.num_stages = {"B": B}, num_warps, num_stages

    def __repr__(self) -> str:
        return f"Cfg({self.kwargs['B']}, {self.num_warps}, {self.num_stages})"


SPACE = [Cfg(b, w, s) for b in (32, 64, 128) for w in (4, 8) for s in (2, 3)]
FASTEST = SPACE[7]  # the stand-in's timings make this one the fastest (elsewhere: the smallest block)


def fake_autotuner_class() -> type:
    """A class with Triton 3.6's ``Autotuner.run`` / ``prune_configs`` contract: on a key (the ``keys``
    arguments) not tuned yet, ``prune_configs`` gives the configs, and each is launched on ``do_bench`` (Triton's
    clock unless the instance sets its own), even when one is left; ``timed`` lists the configs launched to time
    them, per tuning. A space of one config is never tuned."""

    class FakeAutotuner:
        def __init__(self, fn, arg_names, configs, keys) -> None:
            self.fn = self.base_fn = fn
            self.arg_names, self.configs, self.keys = arg_names, configs, keys
            self.cache, self.timed, self.nargs = {}, [], None

        def do_bench(self, kernel_call, quantiles):  # Triton's own clock (25 ms warm-up, 100 ms of launches)
            kernel_call()
            return [1.0] * len(quantiles)

        def prune_configs(self, kwargs):
            return self.configs

        def run(self, *args, **kwargs):
            self.nargs = dict(zip(self.arg_names, args))
            config = self.configs[0]
            if len(self.configs) > 1:
                all_args = {**self.nargs, **kwargs}
                key = tuple(all_args[k] for k in self.keys if k in all_args)
                if key not in self.cache:
                    pruned = self.prune_configs(kwargs)
                    launched = []
                    for c in pruned:
                        self.do_bench(lambda c=c: launched.append(c), quantiles=(0.5, 0.2, 0.8))
                    if launched:
                        self.timed.append(launched)
                    self.bench_time = 0.25 * len(launched)  # Triton's: the wall time of the timings
                    self.cache[key] = min(pruned, key=lambda c: 0 if c is FASTEST else c.kwargs["B"])
                config = self.cache[key]
            self.best_config, self.nargs = config, None
            return config

    return FakeAutotuner


def chunk_kernel(x, T, H):  # the kernel a stand-in autotuner wraps (its length argument: T)
    pass


def _tuner(cls):
    return cls(chunk_kernel, ["x", "T", "H"], SPACE, ["H"])


def test_length_buckets() -> None:
    assert [seq_bucket(n) for n in (1, 2, 3, 4096, 4097, 8192, 1_000_000)] == [1, 2, 4, 4096, 8192, 8192, 1 << 20]
    assert entry_key({"H": 8}, 5000) == entry_key({"H": 8}, 8192) == "H=8|len=8192"
    assert entry_key({"H": 8}, 8193) != entry_key({"H": 8}, 8192)


def _nearby_lengths_share_an_entry() -> None:
    assert entry_key({"H": 8}, 5000) == entry_key({"H": 8}, 8192)


def test_broken_bucket_fails(monkeypatch) -> None:
    monkeypatch.setattr(autotune, "seq_bucket", lambda n: n)
    with pytest.raises(AssertionError):
        _nearby_lengths_share_an_entry()


def test_triton_cache_dir_defaults_to_the_user_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("MEGASEQ_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert autotune.use_persistent_cache() == str(tmp_path / "home/.cache/megaseq/triton")
    import os

    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "1"
    monkeypatch.setenv("TRITON_CACHE_DIR", "/mine")
    assert autotune.use_persistent_cache() == "/mine"
    from megaseq.ops.kernels import cold_start_note

    monkeypatch.delenv("TRITON_CACHE_DIR")
    assert str(tmp_path / "home/.cache/megaseq/triton") in cold_start_note("cuda")


def _write(path: Path, kernels: dict) -> Path:
    autotune.write_table(path, kernels, "NVIDIA H200")
    return path


def test_shipped_table_is_read_and_the_users_wins(tmp_path) -> None:
    full = {"kwargs": {"B": 64}, "num_warps": 8, "num_stages": 3, "tuned": "full"}
    shipped = _write(tmp_path / "shipped.json", {"k": {"H=8|len=8192": full, "H=8|len=65536": full}})
    t = TunedTable("NVIDIA H200", shipped=shipped, user=tmp_path / "user.json")
    assert t.lookup("k", {"H": 8}, 6000) == full  # same bucket
    assert t.lookup("k", {"H": 8}, 20000) == full  # bucket 32768: the nearest within two buckets (65536)
    assert t.lookup("k", {"H": 8}, 1 << 20) is None  # 16 buckets away: tune
    assert t.lookup("k", {"H": 16}, 8192) is None
    mine = {"kwargs": {"B": 32}, "num_warps": 4, "num_stages": 2, "tuned": "full"}
    pruned = {**mine, "tuned": "pruned"}
    _write(tmp_path / "user.json", {"k": {"H=8|len=8192": mine, "H=8|len=65536": pruned}})
    t = TunedTable("NVIDIA H200", shipped=shipped, user=tmp_path / "user.json")
    assert t.lookup("k", {"H": 8}, 8192) == mine and t.lookup("k", {"H": 8}, 65536) == full
    assert TunedTable("NVIDIA H200").shipped_path == autotune.SHIPPED_DIR / "nvidia-h200.json"


def test_a_gpu_without_its_own_table_reads_its_architectures(tmp_path) -> None:
    full = {"kwargs": {"B": 64}, "num_warps": 8, "num_stages": 3, "tuned": "full"}
    ship = tmp_path / "ship"
    ship.mkdir()
    autotune.write_table(ship / "nvidia-h100-80gb-hbm3.json", {"k": {"H=8|len=8192": full}}, "NVIDIA H100 80GB HBM3",
                         "sm90")
    autotune.write_table(ship / "nvidia-a100-sxm4-80gb.json", {"k": {"H=8|len=8192": {**full, "num_warps": 4}}},
                         "NVIDIA A100-SXM4-80GB", "sm80")
    assert json.loads((ship / "nvidia-h100-80gb-hbm3.json").read_text())["arch"] == "sm90"
    assert autotune.shipped_table("NVIDIA H200", "sm90", ship) == ship / "nvidia-h100-80gb-hbm3.json"
    assert autotune.shipped_table("NVIDIA A100 40GB", "sm80", ship) == ship / "nvidia-a100-sxm4-80gb.json"
    assert autotune.shipped_table("NVIDIA H200", "sm100", ship) is None
    assert autotune.shipped_table("NVIDIA H200", None, ship) is None
    # a table of its own wins over its architecture's
    autotune.write_table(ship / "nvidia-h200.json", {"k": {}}, "NVIDIA H200", "sm90")
    assert autotune.shipped_table("NVIDIA H200", "sm90", ship) == ship / "nvidia-h200.json"
    (ship / "nvidia-h200.json").unlink()

    user = tmp_path / "user.json"
    t = TunedTable("NVIDIA H200", shipped=autotune.shipped_table("NVIDIA H200", "sm90", ship), user=user)
    assert t.borrowed_from == "NVIDIA H100 80GB HBM3"
    hit = t.lookup("k", {"H": 8}, 8192)
    assert hit["kwargs"] == {"B": 64} and hit["num_warps"] == 8 and hit["tuned"] == "full on NVIDIA H100 80GB HBM3"
    # a pruned tuning on this GPU replaces a full one made on another model (not one made on this model)
    pruned = {"kwargs": {"B": 32}, "num_warps": 4, "num_stages": 2, "tuned": "pruned"}
    _write(user, {"k": {"H=8|len=8192": pruned}})
    t = TunedTable("NVIDIA H200", shipped=autotune.shipped_table("NVIDIA H200", "sm90", ship), user=user)
    assert t.lookup("k", {"H": 8}, 8192) == pruned
    # its own table borrows nothing
    assert TunedTable("NVIDIA H100 80GB HBM3", shipped=ship / "nvidia-h100-80gb-hbm3.json", user=user).borrowed_from \
        is None


def test_the_h200_reads_the_shipped_h100_table() -> None:
    t = TunedTable("NVIDIA H200", arch="sm90")
    h100 = json.loads((autotune.SHIPPED_DIR / "nvidia-h100-80gb-hbm3.json").read_text())
    assert h100["arch"] == "sm90" and t.borrowed_from == h100["device"]
    assert set(t.kernels) == set(h100["kernels"])
    assert TunedTable("NVIDIA H200", arch="sm100").kernels == {}  # another architecture: tune


def test_record_persists_and_keeps_other_entries(tmp_path) -> None:
    user = _write(tmp_path / "user.json", {"other": {"H=1": {"kwargs": {}, "num_warps": 4, "num_stages": 1}}})
    t = TunedTable("NVIDIA H200", shipped=tmp_path / "none.json", user=user)
    cfg = {"kwargs": {"B": 64}, "num_warps": 8, "num_stages": 3, "tuned": "pruned"}
    t.record("k", {"H": 8}, 3000, cfg)
    on_disk = json.loads(user.read_text())
    assert on_disk["format"] == 1 and on_disk["kernels"]["k"]["H=8|len=4096"] == cfg and "other" in on_disk["kernels"]
    assert t.recorded == {"k": {"H=8|len=4096": cfg}}
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json: not a megaseq tuned table"):
        TunedTable("x", shipped=tmp_path / "bad.json", user=user)


def test_pruned_spaces(monkeypatch) -> None:
    assert prune(SPACE, "full") == SPACE
    assert prune(SPACE, "one") == [SPACE[0]]  # B=32, 4 warps, 2 stages: the most conservative
    picked = prune(SPACE, "pruned")
    assert len(picked) == autotune.PRUNED_CONFIGS == len(set(map(id, picked))) and picked[0] is SPACE[0]
    assert autotune.mode() == "pruned"
    monkeypatch.setenv("MEGASEQ_FLA_AUTOTUNE", "full")
    assert autotune.mode() == "full"
    monkeypatch.setenv("MEGASEQ_FLA_AUTOTUNE", "one")
    assert autotune.mode() == "one"
    monkeypatch.setenv("MEGASEQ_AUTOTUNE", "fast")
    with pytest.raises(ValueError, match="MEGASEQ_AUTOTUNE must be one of pruned, full, one"):
        autotune.mode()


def test_autotuner_reads_and_fills_the_tables() -> None:
    cls = fake_autotuner_class()
    triton_autotune.patch(cls)
    first = _tuner(cls)
    first.run("x", 6000, 8)  # untuned: a pruned space is timed, the winner kept in the user's table
    assert len(first.timed) == 1 and len(first.timed[0]) == autotune.PRUNED_CONFIGS
    user = autotune.table().user_path
    entry = json.loads(user.read_text())["kernels"][f"{__name__}.chunk_kernel"]["H=8|len=8192"]
    assert entry["tuned"] == "pruned" and entry["kwargs"] == first.best_config.kwargs
    autotune._tables.clear()  # a new process: the table from disk
    second = _tuner(cls)
    second.run("x", 8000, 8)  # same bucket: the table's config, nothing timed
    assert second.timed == [] and second.best_config is first.best_config
    third = _tuner(cls)
    third.run("x", 8000, 16)  # another key: tuned
    assert len(third.timed) == 1


def test_full_mode_tunes_afresh_and_one_records_nothing(monkeypatch) -> None:
    cls = fake_autotuner_class()
    triton_autotune.patch(cls)
    _tuner(cls).run("x", 6000, 8)
    monkeypatch.setenv("MEGASEQ_AUTOTUNE", "full")
    full = _tuner(cls)
    full.run("x", 6000, 8)
    assert full.timed == [SPACE] and full.best_config is FASTEST
    autotune._tables.clear()
    monkeypatch.setenv("MEGASEQ_AUTOTUNE", "one")
    one = _tuner(cls)
    one.run("x", 1 << 20, 4)
    assert one.timed == [] and autotune.table().recorded == {}


def test_forget_tunings_tunes_each_length_bucket_again(monkeypatch) -> None:
    """``megaseq tune`` at 8K then 1M: Triton's key has no length, so without ``forget_tunings`` the 1M bucket
    would get no tuning of its own."""
    cls = fake_autotuner_class()
    triton_autotune.patch(cls)
    monkeypatch.setenv("MEGASEQ_AUTOTUNE", "full")
    tuner = _tuner(cls)
    tuner.cache_results = True
    tuner.run("x", 8192, 8)
    tuner.run("x", 1 << 20, 8)
    assert len(tuner.timed) == 1  # Triton's own cache: the 8K result reused
    assert triton_autotune.forget_tunings() >= 1 and tuner.cache_results is False
    tuner.run("x", 1 << 20, 8)
    assert len(tuner.timed) == 2
    assert set(autotune.table().recorded[f"{__name__}.chunk_kernel"]) == {"H=8|len=8192", "H=8|len=1048576"}


def test_interpreter_runs_are_left_alone(monkeypatch) -> None:
    cls = fake_autotuner_class()
    triton_autotune.patch(cls)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    tuner = _tuner(cls)
    tuner.run("x", 6000, 8)
    assert tuner.timed == [SPACE] and autotune.table().recorded == {}
    assert not autotune.table().user_path.exists()


def test_broken_patch_that_ignores_the_table_fails(monkeypatch) -> None:
    """Without the lookup (a patch that always times) the table-reading check fails."""
    cls = fake_autotuner_class()
    triton_autotune.patch(cls)
    _tuner(cls).run("x", 6000, 8)
    autotune._tables.clear()
    monkeypatch.setattr(TunedTable, "lookup", lambda self, *a, **k: None)
    second = _tuner(cls)
    second.run("x", 8000, 8)
    with pytest.raises(AssertionError):
        assert second.timed == []


# ---- megaseq tune --------------------------------------------------------------------------------------
def test_tune_lengths_and_refusals(tmp_path) -> None:
    from megaseq.bench.tune import run_tune, tune_lengths
    from megaseq.config import load_config

    cfg = load_config("recipes/glm5-flash-1gpu.yaml")
    assert tune_lengths(cfg, None) == [cfg.data.seq_len]
    assert tune_lengths(cfg, "32K,8K,8K") == [8192, 32768]
    with pytest.raises(ValueError, match="--seq-lens expects an integer"):
        tune_lengths(cfg, "8K,lots")
    with pytest.raises(ValueError, match="--out .*a tuned table is a .json file"):
        run_tune(cfg, [8192], out=str(tmp_path / "table.txt"))
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        run_tune(cfg, [8192], out=str(tmp_path / "table.json"))


def test_tune_verb_on_a_cpu_is_one_clear_message(capsys) -> None:
    from megaseq.cli.main import main

    assert main(["tune", "recipes/glm5-flash-1gpu.yaml", "--seq-lens", "8K"]) == 2
    assert "megaseq tune: error: megaseq tune times the GPU kernels" in capsys.readouterr().err
    assert main(["tune", "recipes/glm5-flash-1gpu.yaml", "--seq-lens", "8Q"]) == 2
    assert "--seq-lens expects an integer" in capsys.readouterr().err


def test_tune_writes_what_it_tuned_merged_into_the_table(tmp_path, monkeypatch) -> None:
    import torch

    from megaseq.bench.tune import run_tune
    from megaseq.config import load_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    seen = []

    def measure(cfg, L, steps, source, routing):  # stands in for the planned step: its kernels tune
        import os

        seen.append((L, steps, source, routing, os.environ["MEGASEQ_AUTOTUNE"]))
        autotune.table().record("k", {"H": 8}, L, {"kwargs": {"B": 64}, "num_warps": 8, "num_stages": 3,
                                                    "tuned": "full"}, persist=False)
        return {"seq_len": L, "status": "ok", "step_s": 1.0}

    out = _write(tmp_path / "ship" / "nvidia-h200.json", {"old": {"H=2": {"kwargs": {}, "num_warps": 4,
                                                                          "num_stages": 1}}})
    cfg = load_config("recipes/glm5-flash-1gpu.yaml")
    result = run_tune(cfg, [8192, 32768], out=str(out), measure=measure)
    assert seen == [(8192, 0, "random", "balanced", "full"), (32768, 0, "random", "balanced", "full")]
    kernels = json.loads(out.read_text())["kernels"]
    assert set(kernels["k"]) == {"H=8|len=8192", "H=8|len=32768"} and "old" in kernels
    assert result["entries"] == 2 and result["table"] == str(out)
    # a recipe that sets model.autotune is tuned over the whole space all the same (the config wins over the
    # variable inside a run, so tune sets both)
    seen.clear()

    def measure_mode(cfg, L, steps, source, routing):
        from megaseq.ops import switches

        with switches.configured(cfg.model.autotune):
            seen.append(switches.autotune_mode())
        return {"seq_len": L, "status": "ok", "step_s": 1.0}

    cfg = load_config("recipes/glm5-flash-1gpu.yaml", {"model.autotune": "one"})
    run_tune(cfg, [8192], out=str(out), measure=measure_mode)
    assert seen == ["full"]



def test_sparse_mla_reads_the_table_before_its_default(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # as conftest sets it: the kernel module's kernels stay interpreted
    pytest.importorskip("triton")
    import torch

    from megaseq.ops.sparse_mla import kernels as k

    monkeypatch.setattr(k, "_UNTIMED", {})
    monkeypatch.delenv("MEGASEQ_MLA_AUTOTUNE", raising=False)
    default = k._pick("fwd", 16, 512, torch.bfloat16, None, 8192)
    assert default == k.default_config("fwd", 16, 512, torch.bfloat16)
    monkeypatch.setattr(k, "_UNTIMED", {})
    fields = {"kind": "fwd", "Hh": 16, "R": 512, "dtype": str(torch.bfloat16)}
    autotune.table().record(k.TABLE_KERNEL, fields, 8192, {"kwargs": {"BH": 32, "BW": 16}, "num_warps": 8,
                                                            "num_stages": 2, "tuned": "full"}, persist=False)
    assert k._pick("fwd", 16, 512, torch.bfloat16, None, 6000) == k.Config(32, 16, 8, 2)


def _real_scale_kernel():
    """A Triton kernel autotuned over 6 configs on key ``H``, its length argument ``T``."""
    import triton
    import triton.language as tl

    @triton.autotune(configs=[triton.Config({"B": b}, num_warps=w) for b in (64, 128, 256) for w in (2, 4)],
                     key=["H"])
    @triton.jit
    def scale_kernel(x_ptr, out_ptr, T, H, B: tl.constexpr):
        offs = tl.program_id(0) * B + tl.arange(0, B)
        m = offs < T * H
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=m) * 2, mask=m)

    return scale_kernel


@pytest.mark.gpu
def test_real_triton_autotuner_writes_then_reads_the_table(monkeypatch) -> None:
    """Triton's own ``Autotuner`` with the patch: a pruned tuning kept under its length bucket, then a new
    autotuner (a new process's) at a nearby length takes it untimed."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    triton = pytest.importorskip("triton")
    triton_autotune.install()
    monkeypatch.delenv("MEGASEQ_FLA_AUTOTUNE", raising=False)  # the GPU suite's own setting: one config, untimed
    monkeypatch.setenv("MEGASEQ_AUTOTUNE", "pruned")
    x = torch.randn(1000 * 8, device="cuda")
    out = torch.empty_like(x)
    first = _real_scale_kernel()
    first[lambda meta: (triton.cdiv(x.numel(), meta["B"]),)](x, out, 1000, 8)
    torch.testing.assert_close(out, 2 * x)
    kernels = json.loads(autotune.table().user_path.read_text())["kernels"]
    entry = kernels[f"{__name__}.scale_kernel"]["H=8,dtype=torch.float32|len=1024"]
    assert entry["tuned"] == "pruned" and entry["kwargs"]["B"] in (64, 128, 256)
    autotune._tables.clear()
    second = _real_scale_kernel()
    second[lambda meta: (triton.cdiv(900 * 8, meta["B"]),)](x, out, 900, 8)
    assert len(getattr(second, "configs_timings", {})) <= 1, "a table entry's key must not time the space again"
    assert second.__dict__.get("do_bench") is triton_autotune.untimed, "a table's lone config must run untimed"
    assert second.best_config.kwargs == entry["kwargs"] and second.best_config.num_warps == entry["num_warps"]


def test_tune_leaves_the_environment_as_it_was(tmp_path, monkeypatch) -> None:
    """``run_tune`` sets full tuning for its steps only: a variable it found unset is unset after it, one set keeps
    its value (a library caller's later runs, and the tests after this one, do not tune everything)."""
    import os

    import torch

    from megaseq.bench.tune import run_tune
    from megaseq.config import load_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.delenv("MEGASEQ_MLA_AUTOTUNE", raising=False)
    monkeypatch.setenv("MEGASEQ_AUTOTUNE", "one")
    seen = []

    def measure(cfg, L, steps, source, routing):
        seen.append((os.environ.get("MEGASEQ_AUTOTUNE"), os.environ.get("MEGASEQ_MLA_AUTOTUNE")))
        return {"seq_len": L, "status": "ok", "step_s": 1.0}

    run_tune(load_config("recipes/glm5-flash-1gpu.yaml"), [8192], out=str(tmp_path / "t.json"), measure=measure)
    assert seen == [("full", "1")]
    assert os.environ.get("MEGASEQ_AUTOTUNE") == "one" and "MEGASEQ_MLA_AUTOTUNE" not in os.environ


def _pruned_tuning_on_the_shorter_clock(cls, calls: list) -> None:
    tuner = _tuner(cls)
    tuner.run("x", 6000, 8)
    assert calls == [(*autotune.BENCH_MS["pruned"], (0.5, 0.2, 0.8))] * autotune.PRUNED_CONFIGS
    assert tuner.timed == [] and autotune.BENCH_MS["pruned"] < (25, 100)


def _recording_benchmarker(monkeypatch) -> list:
    calls: list = []
    monkeypatch.setattr(triton_autotune, "benchmarker",
                        lambda: lambda fn, warmup, rep, quantiles: calls.append((warmup, rep, quantiles)) or [1.0] * 3)
    return calls


def test_pruned_spaces_are_timed_on_the_shorter_clock(monkeypatch) -> None:
    """A pruned tuning times each candidate with ``autotune.BENCH_MS["pruned"]`` (warm-up, repetitions) on
    Triton's benchmarker; ``full`` (``megaseq tune``) on Triton's own clock again; a kernel that brought its own
    ``do_bench`` keeps it."""
    cls = fake_autotuner_class()
    triton_autotune.patch(cls)
    calls = _recording_benchmarker(monkeypatch)
    _pruned_tuning_on_the_shorter_clock(cls, calls)
    monkeypatch.setenv("MEGASEQ_AUTOTUNE", "full")
    tuner = _tuner(cls)
    tuner.run("x", 6000, 16)  # a new key, tuned over the whole space: Triton's clock
    assert "do_bench" not in tuner.__dict__ and tuner.timed == [SPACE]
    own = _tuner(cls)
    own._do_bench = "the kernel's"
    monkeypatch.setenv("MEGASEQ_AUTOTUNE", "pruned")
    own.run("x", 6000, 32)
    assert "do_bench" not in own.__dict__


def test_broken_clock_left_at_tritons_fails(monkeypatch) -> None:
    """A patch that never sets the clock (pruned spaces timed for Triton's 125 ms a config) fails the check."""
    cls = fake_autotuner_class()
    triton_autotune.patch(cls)
    calls = _recording_benchmarker(monkeypatch)
    monkeypatch.setattr(triton_autotune, "time_with", lambda tuner, ms: None)
    with pytest.raises(AssertionError):
        _pruned_tuning_on_the_shorter_clock(cls, calls)


def _a_lone_config_is_taken_untimed(cls, monkeypatch) -> None:
    tuned = _tuner(cls)
    tuned.run("x", 6000, 8)  # a pruned tuning, kept in the table
    hit = _tuner(cls)
    hit.run("x", 7000, 8)  # the table's config: one left
    assert hit.timed == [] and hit.best_config is tuned.best_config
    monkeypatch.setenv("MEGASEQ_AUTOTUNE", "one")
    one = _tuner(cls)
    one._do_bench = "the kernel's"  # even a kernel's own clock is not run for a lone config
    one.run("x", 6000, 16)
    assert one.timed == [] and one.best_config is SPACE[0]
    monkeypatch.setenv("MEGASEQ_AUTOTUNE", "pruned")
    hit.run("x", 6000, 32)  # the same autotuner, a key the table lacks: timed again, on the pruned clock
    assert len(hit.timed) == 1 and hit.__dict__["_megaseq_clock"] == autotune.BENCH_MS["pruned"]


def test_a_lone_config_is_taken_untimed(monkeypatch) -> None:
    """Triton 3.6 times a lone config (a table's, or a space pruned to one) on its benchmarker before it runs it:
    125 ms of launches a kernel on a new machine. The patch takes it untimed; a later key with a choice is timed."""
    cls = fake_autotuner_class()
    triton_autotune.patch(cls)
    _a_lone_config_is_taken_untimed(cls, monkeypatch)
    assert triton_autotune.untimed(lambda: 1 / 0, (0.5, 0.2)) == [0.0, 0.0]


def test_broken_lone_config_timed_fails(monkeypatch) -> None:
    """A patch that leaves a lone config on Triton's clock (as Triton 3.6 does) fails the check."""
    cls = fake_autotuner_class()
    triton_autotune.patch(cls)
    time_with = triton_autotune.time_with
    monkeypatch.setattr(triton_autotune, "time_with",
                        lambda tuner, ms: None if ms == triton_autotune.UNTIMED else time_with(tuner, ms))
    with pytest.raises(AssertionError):
        _a_lone_config_is_taken_untimed(cls, monkeypatch)


def test_the_timings_a_step_waited_for_are_listed() -> None:
    """``recording_tunings`` lists each key Triton timed (kernel, seconds), not a table's config: what ``megaseq
    bench`` reports of a first step."""
    cls = fake_autotuner_class()
    triton_autotune.patch(cls)
    with triton_autotune.recording_tunings() as timed:
        _tuner(cls).run("x", 6000, 8)  # untuned: timed
        _tuner(cls).run("x", 7000, 8)  # in the table now (this process's record): not timed
    assert timed == [(f"{__name__}.chunk_kernel", 0.25 * autotune.PRUNED_CONFIGS)]
    _tuner(cls).run("x", 6000, 16)  # outside the block: not listed
    assert len(timed) == 1 and triton_autotune._recorders == []

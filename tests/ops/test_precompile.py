"""``ops.precompile``: the kernels a run compiled recorded from Triton's post-compile hook (the hook installed
before still called, and restored), manifests written atomically and read only for their Triton version and
target, the shipped and the user's merged, a fingerprint shared by a recipe's lengths, the precompile on several
threads skipping stale entries, the gating (a CUDA device, the switch) and, on a GPU, a launch after the
precompile that compiles nothing."""

from __future__ import annotations

import importlib
import json
import logging
import sys
import threading
from contextvars import ContextVar
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

from megaseq.ops import precompile, switches

try:
    from triton import AsyncCompileMode, knobs
    from triton.runtime._async_compile import active_mode

    HAVE_TRITON = True
except ImportError:  # a CPU build of torch without Triton: stand-ins of the hook and of AsyncCompileMode
    HAVE_TRITON = False
    knobs = SimpleNamespace(runtime=SimpleNamespace(jit_post_compile_hook=None, jit_cache_hook=None),
                            cache=SimpleNamespace(dir=None))
    active_mode: ContextVar = ContextVar("active_mode", default=None)

    class AsyncCompileMode:  # Triton's: submit compiles to the executor, finalise them all on leaving the block
        def __init__(self, executor, *, ignore_errors=False):
            self.executor, self.ignore_errors, self.futures = executor, ignore_errors, []

        def submit(self, key, compile_fn, finalize_fn):
            fk = SimpleNamespace(kernel=None, future=self.executor.submit(compile_fn), finalize=finalize_fn)
            self.futures.append(fk)
            return fk

        def __enter__(self):
            active_mode.set(self)
            return self

        def __exit__(self, *exc):
            for fk in self.futures:
                try:
                    fk.kernel = fk.future.result()
                except Exception:
                    if not self.ignore_errors:
                        raise
                    continue
                fk.finalize(fk.kernel)
            active_mode.set(None)


@pytest.fixture(autouse=True)
def triton_stand_in(monkeypatch, tmp_path):
    """``precompile`` reads ``triton.knobs`` and ``triton.AsyncCompileMode``: Triton's where installed, else the
    stand-ins; the user's manifests in a temporary cache."""
    if not HAVE_TRITON:
        fake = ModuleType("triton")
        fake.knobs, fake.AsyncCompileMode = knobs, AsyncCompileMode
        monkeypatch.setitem(sys.modules, "triton", fake)
        monkeypatch.setattr(knobs.cache, "dir", str(tmp_path / "triton"))
    monkeypatch.setenv("MEGASEQ_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MEGASEQ_PRECOMPILE", raising=False)
    yield
    knobs.runtime.jit_post_compile_hook = knobs.runtime.jit_cache_hook = None


def post_compile(module: str, name: str, spec: str) -> None:
    """What ``JITFunction._do_compile`` calls once a kernel is compiled: the hook with ``JitFunctionInfo`` (the
    module's name, the function's qualname) and the specialization data."""
    hook = knobs.runtime.jit_post_compile_hook
    if hook is not None:
        hook(key=spec, repr=name, fn=SimpleNamespace(module=module, name=name, jit_function=None),
             compile={"key": spec, "specialization_data": spec}, is_manual_warmup=False, already_compiled=False)


# ---- record ----------------------------------------------------------------------------------------------
def test_record_collects_each_spec_once_and_keeps_the_hook_it_found():
    seen = []
    before = knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(kw["key"])
    with precompile.record() as entries:
        post_compile("megaseq.ops.swiglu.kernels", "swiglu_fwd_kernel", "s1")
        post_compile("megaseq.ops.swiglu.kernels", "swiglu_fwd_kernel", "s1")  # the same spec again
        post_compile("megaseq.ops.swiglu.kernels", "swiglu_fwd_kernel", "s2")
        post_compile("tests.ops.x", "test_fn.<locals>.kernel", "s3")  # not importable by name
        post_compile("__main__", "kernel", "s4")
    assert entries == [{"kernel": "megaseq.ops.swiglu.kernels.swiglu_fwd_kernel", "spec": "s1"},
                       {"kernel": "megaseq.ops.swiglu.kernels.swiglu_fwd_kernel", "spec": "s2"}]
    assert seen == ["s1", "s1", "s2", "s3", "s4"] and knobs.runtime.jit_post_compile_hook is before
    post_compile("m", "k", "s5")
    assert len(entries) == 2


def test_record_restores_the_hook_when_the_block_raises():
    with pytest.raises(RuntimeError), precompile.record():
        raise RuntimeError("step failed")
    assert knobs.runtime.jit_post_compile_hook is None


# ---- manifests --------------------------------------------------------------------------------------------
E1 = {"kernel": "m.k1", "spec": '{"name": "k1", "x": 1}'}
E2 = {"kernel": "m.k2", "spec": '{"name": "k2"}'}
E3 = {"kernel": "m.k1", "spec": '{"name": "k1", "x": 2}'}


def test_manifest_round_trip_and_other_versions_or_targets_not_used(tmp_path, caplog):
    path = tmp_path / "m.json"
    precompile.write_manifest(path, [E2, E1, E1], "3.6.0", "cuda:90", {"model": "x"})
    data = json.loads(path.read_text())
    assert data["format"] == 1 and (data["triton"], data["target"]) == ("3.6.0", "cuda:90")
    assert data["entries"] == [E1, E2] and data["describes"] == {"model": "x"}
    assert precompile.read_manifest(path, "3.6.0", "cuda:90") == [E1, E2]
    with caplog.at_level(logging.INFO, logger="megaseq.ops.precompile"):
        assert precompile.read_manifest(path, "3.7.0", "cuda:90") == []
        assert precompile.read_manifest(path, "3.6.0", "cuda:100") == []
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "recorded under Triton 3.6.0 for cuda:90, this is Triton 3.7.0" in said[0]
    assert precompile.read_manifest(tmp_path / "none.json", "3.6.0", "cuda:90") == []
    (tmp_path / "bad.json").write_text("{not json")
    assert precompile.read_manifest(tmp_path / "bad.json", "3.6.0", "cuda:90") == []  # said, not raised


def test_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "m.json"
    precompile.write_manifest(path, [E1], "3.6.0", "cuda:90")

    def interrupted(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(precompile.os, "replace", interrupted)
    with pytest.raises(OSError):
        precompile.write_manifest(path, [E1, E2], "3.6.0", "cuda:90")
    assert precompile.read_manifest(path, "3.6.0", "cuda:90") == [E1]  # the old manifest, whole


def test_add_merges_with_what_is_on_disk_and_replaces_another_version(tmp_path):
    path = tmp_path / "m.json"
    assert precompile.add(path, [E1], "3.6.0", "cuda:90") == 1
    assert precompile.add(path, [E1, E2], "3.6.0", "cuda:90") == 1
    assert precompile.add(path, [E2], "3.6.0", "cuda:90") == 0
    assert precompile.read_manifest(path, "3.6.0", "cuda:90") == [E1, E2]
    assert precompile.add(path, [E3], "3.7.0", "cuda:90") == 1
    assert precompile.read_manifest(path, "3.7.0", "cuda:90") == [E3]


def test_load_is_the_union_of_the_shipped_and_the_users(tmp_path):
    shipped, user = tmp_path / "shipped", tmp_path / "user"
    name = precompile.manifest_name("abc", "cuda:90")
    assert name == "abc-cuda90.json"
    precompile.write_manifest(shipped / name, [E1, E2], "3.6.0", "cuda:90")
    precompile.write_manifest(user / name, [E2, E3], "3.6.0", "cuda:90")
    precompile.write_manifest(user / precompile.manifest_name("abc", "cuda:100"), [E1], "3.6.0", "cuda:100")
    got = precompile.load("abc", "3.6.0", "cuda:90", shipped, user)
    assert sorted(e["spec"] for e in got) == sorted(e["spec"] for e in (E1, E2, E3))
    assert precompile.load("other", "3.6.0", "cuda:90", shipped, user) == []
    assert precompile.user_dir() == switches.cache_root() / "kernels"


def test_the_fingerprint_is_a_recipes_across_lengths_and_differs_across_dtypes_and_models():
    from megaseq.bench.measure import cfg_for
    from megaseq.config import build_config
    from megaseq.models.presets import resolve_spec
    from megaseq.train.build import kernel_fingerprint

    def fp(*overrides, seq_len=8192):
        cfg = cfg_for(build_config(None, list(overrides)), seq_len, "random")
        return kernel_fingerprint(cfg, resolve_spec(cfg.model.name))[0]

    base = fp("model.name=qwen3-moe-tiny")
    assert len(base) == 16 and base == fp("model.name=qwen3-moe-tiny", seq_len=1 << 20)
    assert base != fp("model.name=qwen3-moe-tiny", "model.dtype=fp32")
    assert base != fp("model.name=glm5-flash-tiny")
    assert base != fp("model.name=qwen3-moe-tiny", "lora.rank=8")
    assert base != fp("model.name=qwen3-moe-tiny", "model.kernels=base")


# ---- precompile -------------------------------------------------------------------------------------------
class StandIn:
    """A kernel whose ``preload`` does what ``JITFunction.preload`` does under ``AsyncCompileMode``: submits the
    compile to the mode's executor and puts the kernel in its cache when the mode finalises it."""

    def __init__(self, barrier: threading.Barrier | None = None, fail: bool = False) -> None:
        self.cache: dict[str, object] = {}
        self.threads: set[int] = set()
        self.barrier, self.fail = barrier, fail

    def preload(self, spec: str):
        if "stale" in spec:  # Triton's preload refuses a spec for another function or signature
            raise RuntimeError("Specialization data is for another kernel")

        def compile_fn():
            self.threads.add(threading.get_ident())
            if self.fail:
                raise RuntimeError("compile error")
            if self.barrier is not None:
                self.barrier.wait()  # two compiles at once, or BrokenBarrierError after its timeout
            return ("compiled", spec)

        return active_mode.get().submit(spec, compile_fn, lambda k: self.cache.__setitem__(spec, k))


def test_precompile_preloads_every_entry_on_several_threads_and_counts_the_stale_ones():
    good, broken = StandIn(threading.Barrier(2, timeout=20)), StandIn(fail=True)
    kernels = {"m.good": good, "m.broken": broken}

    def resolver(name):
        if name not in kernels:
            raise ValueError(f"{name}: no Triton kernel of that name")
        return kernels[name]

    entries = [{"kernel": "m.good", "spec": f"s{i}"} for i in range(4)]
    entries += [{"kernel": "m.gone", "spec": "x"}, {"kernel": "m.good", "spec": "stale"},
                {"kernel": "m.broken", "spec": "b"}]
    result = precompile.precompile(entries, workers=2, resolver=resolver)
    assert (result.compiled, result.skipped, result.workers) == (4, 3, 2)
    assert set(good.cache) == {"s0", "s1", "s2", "s3"} and not broken.cache
    assert len(good.threads) == 2 and threading.get_ident() not in good.threads
    line = result.line()
    assert line.startswith("precompiled 4 kernels (3 skipped; 0 loaded) in ") and line.endswith("2 threads")
    assert precompile.precompile([], workers=3).summary() == {"compiled": 0, "skipped": 0, "seconds": 0.0,
                                                               "workers": 3, "cached": 0, "loaded": 0, "from_disk": 0,
                                                               "seeded": 0, "untimed": 0}


class Loadable:
    """A compiled kernel as Triton's ``CompiledKernel`` stands before its first launch: ``_init_handles`` builds
    its launcher and loads its binary (here: notes the thread; ``over`` raises as a kernel over the GPU's limits)."""

    def __init__(self, over: bool = False) -> None:
        self.over, self.loaded_on = over, None

    def _init_handles(self) -> None:
        if self.over:
            raise RuntimeError("out of resources: shared memory")
        self.loaded_on = threading.get_ident()


def test_precompile_loads_each_compiled_kernel_on_the_pool():
    """After the compiles, each compiled kernel's launcher and binary are made on the pool's threads, not at its
    first launch on the caller's; a kernel that raises there (over the GPU's limits) is left to raise at its
    launch, as without the precompile. Broken variant: the loading step removed leaves ``loaded_on`` None."""
    made = {"a": Loadable(), "b": Loadable(), "c": Loadable(over=True)}

    class Compiles(StandIn):
        def preload(self, spec: str):
            return active_mode.get().submit(spec, lambda: made[spec], lambda k: self.cache.__setitem__(spec, k))

    k = Compiles()
    result = precompile.precompile([{"kernel": "m.k", "spec": s} for s in "abc"], workers=2, resolver=lambda n: k)
    assert (result.compiled, result.loaded, result.skipped) == (3, 2, 0)
    assert None not in (made["a"].loaded_on, made["b"].loaded_on) and made["c"].loaded_on is None
    assert threading.get_ident() not in (made["a"].loaded_on, made["b"].loaded_on)
    assert "; 2 loaded) in " in result.line()


def test_background_runs_on_its_own_thread_and_join_returns_the_result():
    k = StandIn()
    bg = precompile.Background([{"kernel": "m.k", "spec": "s"}], 1, None, lambda name: k)
    result = bg.join()
    assert result.compiled == 1 and k.cache == {"s": ("compiled", "s")}
    bg = precompile.Background([{"kernel": "m.k", "spec": "s"}], 1, None, lambda name: 1 / 0)
    assert bg.join().skipped == 1  # a resolver that raises: skipped, the run goes on


def test_default_workers_are_the_usable_cpus_capped(monkeypatch):
    monkeypatch.setattr(precompile.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert precompile.default_workers() == precompile.MAX_WORKERS
    assert precompile.default_workers(8) == 8
    monkeypatch.setattr(precompile.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert precompile.default_workers() == 2 and precompile.default_workers(4) == 1


def test_tuned_only_drops_the_configs_an_autotuner_did_not_choose():
    fn = SimpleNamespace(arg_names=["x_ptr", "n", "BLOCK"])

    def spec(block, warps):
        return json.dumps({"constant_keys": [[2]], "constant_vals": [{"constexpr": block}],
                           "options": {"num_warps": warps, "num_stages": 3}})

    chose = SimpleNamespace(kwargs={"BLOCK": 128}, num_warps=4, num_stages=3)
    entries = [{"kernel": "m.k", "spec": spec(b, w)} for b, w in ((64, 4), (128, 4), (128, 8))]
    other = {"kernel": "m.plain", "spec": spec(64, 4)}
    plain = SimpleNamespace(arg_names=["x_ptr", "n", "BLOCK"])
    kept = precompile.tuned_only(entries + [other], {id(fn): [chose]},
                                 lambda name: fn if name == "m.k" else plain)
    assert kept == [entries[1], other]


def table_spec(block, warps, stages=3):
    """A specialization of ``m.k(x_ptr, n, BLOCK)`` as a manifest holds it (its signature names the arguments)."""
    return json.dumps({"signature": {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                       "constant_keys": [[2]], "constant_vals": [block],
                       "options": {"num_warps": warps, "num_stages": stages}})


def test_launched_keeps_what_the_tuned_table_chose_and_the_kernels_it_does_not_tune():
    tuned = {"m.k": {"n=1|len=8192": {"kwargs": {"BLOCK": 128}, "num_warps": 4, "num_stages": 3, "tuned": "full"},
                     "n=1|len=32768": {"kwargs": {"BLOCK": 64}, "num_warps": 8, "num_stages": 2,
                                       "tuned": "pruned"}}}
    ks = [{"kernel": "m.k", "spec": table_spec(b, w, st)}
          for b, w, st in ((128, 4, 3), (64, 8, 2), (128, 8, 3), (64, 4, 3), (128, 4, 2))]
    plain = {"kernel": "m.plain", "spec": table_spec(32, 4)}
    odd = {"kernel": "m.k", "spec": "not json"}
    keep, rest = precompile.launched(ks + [plain, odd], tuned)
    assert keep == [ks[0], ks[1], plain, odd] and rest == ks[2:]
    assert precompile.launched(ks, {}) == (ks, [])
    # a length the table's buckets do not reach (8K and 32K, two powers of two either side): tuned, all kept
    assert precompile.launched(ks, tuned, 2048)[1] == ks[2:] and precompile.launched(ks, tuned, 131072)[1] == ks[2:]
    assert precompile.launched(ks, tuned, 1024) == (ks, []) and precompile.launched(ks, tuned, 1 << 20) == (ks, [])


def test_covers_is_the_lookups_reach():
    from megaseq.ops import autotune

    t = autotune.TunedTable("x", shipped=Path("/nonexistent"), user=Path("/nonexistent"))
    t.kernels["k"] = {"D=1|len=8192": {"kwargs": {}}, "D=2|len=32768": {"kwargs": {}}}
    for n in (1000, 1025, 2048, 8192, 100_000, 131072, 131073, 1 << 20):
        reached = t.lookup("k", {"D": 1}, n) is not None or t.lookup("k", {"D": 2}, n) is not None
        assert autotune.covers(t.kernels["k"], n) == reached, n
    assert autotune.covers({"D=1": {}}, 1 << 20) and autotune.covers(t.kernels["k"], None)


def test_the_run_loads_only_what_its_tuned_table_launches(monkeypatch, tmp_path):
    """``RunPrecompile(tuned=...)``: the other configs of the tuned kernels are not loaded, and said; without a
    table every entry is; ``train.build.start_precompile`` gives the table under the default mode only."""
    monkeypatch.setattr(precompile, "current_target", lambda: ("3.6.0", "cuda:90"))
    monkeypatch.setattr("megaseq.ops.triton_autotune.install", lambda: None)
    monkeypatch.setattr(switches, "kernel_pack", lambda: False)
    given = []
    monkeypatch.setattr(precompile, "Background", lambda entries, *a, **k: given.append(entries) or SimpleNamespace(
        join=lambda: precompile.Result(compiled=len(entries))))
    user = tmp_path / "user"
    ks = [{"kernel": "m.k", "spec": table_spec(b, 4)} for b in (64, 128)]
    precompile.write_manifest(user / precompile.manifest_name("fp", "cuda:90"), ks, "3.6.0", "cuda:90")
    tuned = {"m.k": {"n=1|len=8192": {"kwargs": {"BLOCK": 128}, "num_warps": 4, "num_stages": 3}}}
    pre = precompile.RunPrecompile("fp", None, user=user, shipped=tmp_path / "none", tuned=tuned)
    res = pre.join(lambda line: given.append(line))
    assert given[0] == [ks[1]] and res.untimed == 1 and pre.summary()["entries"] == 2
    assert "1 configs the tuned table does not choose left out" in given[1]
    precompile.RunPrecompile("fp", None, user=user, shipped=tmp_path / "none")
    assert sorted(e["spec"] for e in given[2]) == sorted(e["spec"] for e in ks)

    from megaseq.ops import autotune
    from megaseq.train import build

    monkeypatch.setattr(precompile, "enabled", lambda device_type: True)
    monkeypatch.setattr(build, "kernel_fingerprint", lambda cfg, spec: ("fp", {}))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA Test GPU")
    monkeypatch.setattr(autotune, "table", lambda device: SimpleNamespace(kernels={"from": device}))
    seen = []
    monkeypatch.setattr(precompile, "RunPrecompile", lambda *a, **k: seen.append((k.get("tuned"), k["length"])))
    monkeypatch.setenv("MEGASEQ_WARM_OPS", "0")  # the op warm-up: tests/ops/test_op_warmup.py
    cfg = SimpleNamespace(data=SimpleNamespace(seq_len=32768))
    for mode in ("pruned", "full", "one"):
        monkeypatch.setattr(autotune, "mode", lambda m=mode: m)
        build.start_precompile(cfg, None, torch.device("cuda", 0))
    assert seen == [({"from": "NVIDIA Test GPU"}, 32768), (None, 32768), (None, 32768)]


# ---- with Triton: resolving names --------------------------------------------------------------------------
def test_resolve_unwraps_the_autotuner_and_heuristics(monkeypatch, request):
    if not HAVE_TRITON:
        pytest.skip("needs Triton")
    from triton.runtime.jit import JITFunction

    monkeypatch.setattr(knobs.runtime, "interpret", False)  # compiled kernels (JITFunction), as on a GPU
    sys.modules.pop("precompile_kernels", None)  # imported afresh, dropped after
    request.addfinalizer(lambda: sys.modules.pop("precompile_kernels", None))
    mod = importlib.import_module("precompile_kernels")
    assert precompile.resolve("precompile_kernels.add_constant") is mod.add_constant
    tuned = precompile.resolve("precompile_kernels.tuned_add")
    assert isinstance(tuned, JITFunction) and tuned.fn.__name__ == "tuned_add"
    with pytest.raises(ValueError, match="no Triton kernel"):
        precompile.resolve("precompile_kernels.no_such_kernel")
    with pytest.raises(ValueError, match="no Triton kernel"):
        precompile.resolve("no_such_module.kernel")
    with pytest.raises(ValueError, match="no Triton kernel"):
        precompile.resolve("precompile_kernels.triton")  # a module, not a kernel


REAL_TRITON = """
import sys, torch
from megaseq.ops import precompile
import precompile_kernels as mod
mod.use_stand_in_driver()
with precompile.record() as entries:
    for c in (3, 4, 5):
        mod.add_constant.warmup(torch.float32, 1000, C=c, BLOCK=256, grid=(4,))
assert [e["kernel"] for e in entries] == ["precompile_kernels.add_constant"] * 3, entries
mod.add_constant.device_caches.clear()
stale = {"kernel": "precompile_kernels.add_constant", "spec": entries[0]["spec"].replace("add_constant", "x")}
result = precompile.precompile(entries + [stale], workers=2, device=0)
assert (result.compiled, result.skipped) == (3, 1), result
with precompile.record() as again:
    for c in (3, 4, 5):
        mod.add_constant.warmup(torch.float32, 1000, C=c, BLOCK=256, grid=(4,))
assert again == [], again  # without the precompile: three compiles
assert precompile.precompile(entries, workers=2, device=0).cached == 3
print("ok")
"""


def test_real_triton_compiles_a_recorded_kernel_on_the_pool_without_a_gpu(tmp_path):
    """Triton's own ``preload`` and ``AsyncCompileMode`` for sm_90 under a stand-in driver (no GPU), in a process
    of its own (compiled kernels, not the CPU interpreter the test process uses): specialisations recorded by
    compiling them (``warmup``: compiled, not launched), the JIT state made fresh, precompiled on two threads (a
    stale spec skipped); compiling them again then builds nothing, and a second precompile finds them cached."""
    if not HAVE_TRITON:
        pytest.skip("needs Triton")
    import os
    import subprocess
    from pathlib import Path

    here = Path(__file__).resolve().parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "triton"),
               PYTHONPATH=os.pathsep.join([str(here.parents[1] / "src"), str(here)]))
    out = subprocess.run([sys.executable, "-c", REAL_TRITON], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


# ---- gating and wiring -------------------------------------------------------------------------------------
def test_enabled_on_a_gpu_unless_switched_off(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())  # Triton installed
    assert precompile.enabled("cuda") and not precompile.enabled("cpu")
    monkeypatch.setenv("MEGASEQ_PRECOMPILE", "0")
    assert not precompile.enabled("cuda")
    with switches.configured(precompile=True):  # the config wins over the variable
        assert precompile.enabled("cuda")
    monkeypatch.setenv("MEGASEQ_PRECOMPILE", "1")
    with switches.configured(precompile=False):
        assert not precompile.enabled("cuda")
    monkeypatch.setenv("MEGASEQ_PRECOMPILE", "yes")
    with pytest.raises(ValueError, match="MEGASEQ_PRECOMPILE must be one of 1, 0, compile, got 'yes'"):
        precompile.enabled("cuda")
    monkeypatch.delenv("MEGASEQ_PRECOMPILE")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # no Triton
    assert not precompile.enabled("cuda")


def test_a_cpu_bench_and_train_start_no_precompile(monkeypatch, tmp_path):
    from megaseq.bench import measure
    from megaseq.config import build_config
    from megaseq.train import build, trainer

    started = []
    monkeypatch.setattr(precompile, "RunPrecompile", lambda *a, **k: started.append(a))
    calls = []
    real = build.start_precompile

    def spy(cfg, spec, device, processes=1):
        out = real(cfg, spec, device, processes)
        calls.append((device.type, out))
        return out

    monkeypatch.setattr(build, "start_precompile", spy)
    monkeypatch.setattr(trainer, "start_precompile", spy)
    cfg = build_config(None, ["model.name=qwen3-moe-tiny", "data.kind=random", "model.dtype=fp32",
                              "train.device=cpu", "model.precompile=true"])
    row = measure.measure_megaseq(cfg, 64, 1, "random")
    assert row["status"] == "ok" and row["precompile"] is None
    cfg = build_config(None, ["model.name=qwen3-moe-tiny", "data.kind=random", "model.dtype=fp32",
                              "train.device=cpu", "data.seq_len=64", "train.steps=1",
                              f"train.run_dir={tmp_path / 'run'}", "train.eval_after=false",
                              "train.export_hf=false"])
    trainer.run_training(cfg)
    assert calls == [("cpu", None), ("cpu", None)] and started == []


def test_the_first_step_joins_and_records_into_the_users_manifest(monkeypatch, tmp_path):
    """``timed_steps`` with a precompile: joined before the first step, that step's new compiles added to the
    user's manifest, the later steps not recorded."""
    from megaseq.bench import measure

    monkeypatch.setattr(measure, "_sync", lambda device: None)
    monkeypatch.setattr(precompile, "current_target", lambda: ("3.6.0", "cuda:90"))
    monkeypatch.setattr("megaseq.ops.triton_autotune.install", lambda: None)
    user = tmp_path / "user"
    precompile.write_manifest(user / precompile.manifest_name("fp", "cuda:90"), [E1], "3.6.0", "cuda:90")
    k = StandIn()
    monkeypatch.setattr(precompile, "resolve", lambda name: k)
    pre = precompile.RunPrecompile("fp", None, None, 1, shipped=tmp_path / "none", user=user)  # no device here
    steps = iter(range(3))

    def step():
        i = next(steps)
        post_compile("m", "k1", E1["spec"])  # in the manifest: not added again
        post_compile("m", f"new{i}", f"spec{i}")

    lines: list[str] = []
    monkeypatch.setattr(measure.logger, "info", lines.append)
    measure.timed_steps(step, 2, torch.device("cpu"), None, None, pre)
    got = precompile.read_manifest(user / precompile.manifest_name("fp", "cuda:90"), "3.6.0", "cuda:90")
    assert [e["spec"] for e in got] == [E1["spec"], "spec0"]
    s = pre.summary()
    assert (s["compiled"], s["skipped"], s["entries"], s["added"]) == (1, 0, 1, 1) and s["wait_s"] >= 0
    assert any(line.startswith("megaseq bench: precompiled 1 kernels (0 skipped; 0 loaded) in ") for line in lines)


# ---- on a GPU ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_precompiled_kernel_launches_without_compiling():
    """A real kernel: recorded at its first launch, its JIT state then made fresh (its kernel caches cleared:
    the next launch would compile, as in a new process), the manifest precompiled on a background thread (the
    device set there as a run sets it), and the launch after compiles nothing and computes the right values.
    Without the precompile (the ``Background`` line removed) the last launch compiles once: ``count`` is 1 and
    the test fails. A stale entry (another kernel's spec) and an unknown kernel are skipped, not raised."""
    import random

    from megaseq.bench.compiles import compile_record

    mod = importlib.import_module("precompile_kernels")
    x = torch.zeros(1000, device="cuda")
    c = random.randint(1, 10**6)  # a constant no earlier run specialised on
    with precompile.record() as entries:
        mod.add_constant[(4,)](x, 1000, C=c, BLOCK=256)
        torch.cuda.synchronize()
    assert [e["kernel"] for e in entries] == ["precompile_kernels.add_constant"]
    mod.add_constant.device_caches.clear()
    stale = {"kernel": "precompile_kernels.add_constant", "spec": entries[0]["spec"].replace("add_constant", "x")}
    result = precompile.Background(entries + [stale, {"kernel": "no_such.kernel", "spec": "{}"}], 2,
                                   torch.cuda.current_device()).join()
    assert (result.compiled, result.skipped, result.loaded) == (1, 2, 1)  # its launcher built, its binary loaded
    with compile_record() as rec:
        mod.add_constant[(4,)](x, 1000, C=c, BLOCK=256)
        torch.cuda.synchronize()
    assert rec.summary()["count"] == 0 and float(x[0]) == 2 * c and float(x[999]) == 2 * c
    again = precompile.precompile(entries, 2, torch.cuda.current_device())
    assert (again.compiled, again.cached) == (0, 1)  # in the kernel cache already: not compiled again


def test_cancel_drops_the_compiles_not_started():
    """``Background.cancel`` (a run that stops before its first step): the compiles queued behind the running one
    are dropped and counted as skipped, and the join returns once the running one ends. Broken variants: a
    ``cancel`` that does nothing compiles all six; one that cancels the executor's queued futures never returns
    (``AsyncCompileMode`` waits for them to be done)."""
    started, gate = threading.Event(), threading.Event()

    class Slow(StandIn):
        def preload(self, spec: str):
            def compile_fn():
                started.set()
                gate.wait(20)
                return ("compiled", spec)

            return active_mode.get().submit(spec, compile_fn, lambda k: self.cache.__setitem__(spec, k))

    k = Slow()
    bg = precompile.Background([{"kernel": "m.k", "spec": f"s{i}"} for i in range(6)], 1, None, lambda name: k)
    assert started.wait(20)  # the one thread holds the first compile; the other five wait behind it
    bg.cancel()
    gate.set()
    result = bg.join()
    assert (result.compiled, result.skipped) == (1, 5) and set(k.cache) == {"s0"}

"""``bench.compiles.compile_record``: the Triton compiles a step runs, timed between Triton's two JIT hooks, with the
hooks that were installed before it still called and restored after; and ``timed_steps`` records the warm-up
step's compiles (the ones a first step spends beyond a warm one) and no later step's."""

from __future__ import annotations

import sys
import time
from types import ModuleType, SimpleNamespace

import pytest
import torch

from megaseq.bench import measure
from megaseq.bench.compiles import compile_record

try:
    from triton import knobs
except ImportError:  # a CPU build of torch without Triton: a stand-in with the two hooks, as Triton's knobs hold them
    knobs = SimpleNamespace(runtime=SimpleNamespace(jit_cache_hook=None, jit_post_compile_hook=None))


@pytest.fixture(autouse=True)
def triton_knobs(monkeypatch):
    """``compile_record`` reads ``triton.knobs``: Triton's own where installed, else the stand-in."""
    if "triton" not in sys.modules or not hasattr(sys.modules["triton"], "knobs"):
        fake = ModuleType("triton")
        fake.knobs = knobs
        monkeypatch.setitem(sys.modules, "triton", fake)
    yield
    knobs.runtime.jit_cache_hook = knobs.runtime.jit_post_compile_hook = None


def fake_compile(name: str, key: str, seconds: float) -> None:
    """What ``JITFunction._do_compile`` does around a compile: the cache hook (a fresh ``fn`` object each call, as
    Triton builds one per call), the compile, the post-compile hook."""
    rt = knobs.runtime
    made = []  # kept alive, so that no two calls' objects share an id

    def fn():
        made.append(SimpleNamespace(module="megaseq.ops.k", name=name))
        return made[-1]

    if rt.jit_cache_hook is not None and rt.jit_cache_hook(key=key, fn=fn(), repr=name, compile={},
                                                           is_manual_warmup=False, already_compiled=False):
        return
    time.sleep(seconds)
    if rt.jit_post_compile_hook is not None:
        rt.jit_post_compile_hook(key=key, fn=fn(), repr=name, compile={}, is_manual_warmup=False,
                                 already_compiled=False)


def test_records_each_compile_and_keeps_the_hooks_it_found():
    seen = []
    before = (lambda **kw: seen.append(("pre", kw["key"])), lambda **kw: seen.append(("post", kw["key"])))
    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before
    try:
        with compile_record() as rec:
            fake_compile("rms_norm_fwd", "k1", 0.05)
            fake_compile("swiglu_bwd", "k2", 0.01)
        s = rec.summary()
        assert s["count"] == 2 and [n for n, _ in s["slowest"]] == ["megaseq.ops.k.rms_norm_fwd",
                                                                    "megaseq.ops.k.swiglu_bwd"]
        assert 0.05 <= s["slowest"][0][1] < 1 and 0.06 <= s["seconds"] < 2
        assert seen == [("pre", "k1"), ("post", "k1"), ("pre", "k2"), ("post", "k2")]
        assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == before
        fake_compile("outside", "k3", 0.0)
        assert rec.summary()["count"] == 2
    finally:
        knobs.runtime.jit_cache_hook = knobs.runtime.jit_post_compile_hook = None


def test_a_compile_that_an_earlier_hook_skips_is_not_counted():
    knobs.runtime.jit_cache_hook = lambda **kw: True  # e.g. a hook that serves the kernel itself
    try:
        with compile_record() as rec:
            fake_compile("served", "k1", 0.0)
        assert rec.summary()["count"] == 0 and not rec.pending
    finally:
        knobs.runtime.jit_cache_hook = None


def test_timed_steps_record_the_warm_up_steps_compiles_only(monkeypatch):
    monkeypatch.setattr(measure, "_sync", lambda device: None)
    calls = iter(range(10))

    def step():
        i = next(calls)
        fake_compile(f"kernel_{i}", f"k{i}", 0.0)  # a new kernel every step: only the first is the warm-up's

    compiles: dict = {}
    first: list[float] = []
    assert len(measure.timed_steps(step, 2, torch.device("cpu"), first, compiles)) == 2
    assert compiles["count"] == 1 and compiles["slowest"][0][0].endswith("kernel_0") and len(first) == 1
    assert knobs.runtime.jit_cache_hook is None and knobs.runtime.jit_post_compile_hook is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_real_kernel_build_is_recorded_on_a_gpu():
    """Triton's own hooks, on a GPU: a kernel with a specialisation this process has not built is counted once,
    by its name; launching it again builds nothing."""
    import random

    import triton
    import triton.language as tl

    @triton.jit
    def add_constant(x_ptr, n, C: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + C, mask=mask)

    x = torch.zeros(1000, device="cuda")
    c = random.randint(1, 10**6)  # a constant no earlier run specialised on
    with compile_record() as rec:
        add_constant[(4,)](x, 1000, C=c, BLOCK=256)
        torch.cuda.synchronize()
        add_constant[(4,)](x, 1000, C=c, BLOCK=256)
    s = rec.summary()
    assert s["count"] == 1 and s["slowest"][0][0].endswith("add_constant") and s["seconds"] > 0
    assert float(x[0]) == 2 * c


def test_the_report_names_the_first_steps_builds():
    from megaseq.bench.report import first_step_lines

    row = {"seq_len": 32768, "source": "random", "first_step_s": 20.0, "step_s": 5.0, "timed_steps": 2,
           "first_step_compiles": {"count": 37, "seconds": 11.04, "slowest": []}}
    assert "4.0x (37 Triton kernels built in 11.0 s)" in first_step_lines([row])[1]
    row["first_step_tunings"] = {"count": 36, "seconds": 4.62, "slowest": []}
    assert "4.0x (37 Triton kernels built in 11.0 s, 36 autotuned kernels timed in 4.6 s)" in first_step_lines([row])[1]
    row["first_step_compiles"] = {"count": 0, "seconds": 0.0, "slowest": []}
    row["first_step_tunings"] = {"count": 0, "seconds": 0.0, "slowest": []}
    assert first_step_lines([row])[1].endswith("= 4.0x")


def test_the_report_says_which_first_steps_ran_after_another_row():
    from megaseq.bench.report import first_step_lines

    rows = [{"seq_len": L, "source": "random", "first_step_s": 2.0, "step_s": 1.0, "timed_steps": 2}
            for L in (8192, 32768)]
    first, second = first_step_lines(rows)[1].split("; ")
    assert "after" not in first
    assert second.endswith("(in the process after the 8,192 (random) row, whose kernels it reuses: "
                           "not a new process's first step)")


def test_the_report_gives_the_op_warmups_share_of_the_wait():
    from megaseq.bench.report import first_step_lines

    row = {"seq_len": 8192, "source": "random", "first_step_s": 0.4, "step_s": 0.2, "timed_steps": 2,
           "build_s": 7.0, "precompile": {"wait_s": 3.6, "op_warmup": {"seconds": 0.8, "ops": 300}}}
    assert ("the precompile's wait 3.6 s (of it the op warm-up 0.8 s): 11.0 s to the first step's end"
            in first_step_lines([row])[1])
    row["precompile"] = {"wait_s": 3.6}
    assert "op warm-up" not in first_step_lines([row])[1]


def test_the_report_gives_the_second_step_s_capture_and_the_graphs_memory():
    from megaseq.bench.report import first_step_lines

    row = {"seq_len": 8192, "source": "random", "first_step_s": 0.4, "step_s": 0.2, "timed_steps": 2,
           "capture_step_s": 0.61, "cuda_graphs": {"layers": [1, 2, 3], "capture_s": 0.41, "pool_gib": 5.25}}
    assert first_step_lines([row])[1].endswith(
        "; the second step 0.61 s, capturing 3 layers as CUDA graphs in 0.41 s, their memory 5.25 GiB")
    row["cuda_graphs"] = {"layers": [], "capture_s": 0.0, "pool_gib": 0.0, "failed": "their memory (9.00 GiB) "
                          "exceeds the plan's headroom (2.00 GiB)"}
    assert first_step_lines([row])[1].endswith("; the second step 0.61 s, its layers eager (CUDA graphs: their memory "
                                               "(9.00 GiB) exceeds the plan's headroom (2.00 GiB))")
    row["cuda_graphs"], row["capture_step_s"] = None, None  # no graphs asked for, or none the run allows
    assert "second step" not in first_step_lines([row])[1]


def test_without_triton_nothing_is_recorded(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    with compile_record() as rec:
        pass
    assert rec.summary() == {"count": 0, "seconds": 0, "slowest": []}

"""``bench.measure.warm_planned_step`` (the memory benchmarks' step) runs under the dispatcher set up as
``megaseq train`` sets it: without that it runs the base kernels whatever ``model.kernels`` says, so a memory
census of the fast set measures the base set (and runs out of memory at 32K on the H200)."""

from __future__ import annotations

from pathlib import Path

import torch

from megaseq.bench import measure
from megaseq.config import load_config
from megaseq.ops import dispatch
from megaseq.train import build

ROOT = Path(__file__).resolve().parents[2]


def test_warm_planned_step_configures_the_dispatcher(monkeypatch):
    monkeypatch.chdir(ROOT)
    prefer = {"rms_norm": ["torch"]}  # a preference a CPU step can honour, standing in for the fast set
    # what kernel_settings reads
    monkeypatch.setattr(build, "preferred_kernels", lambda device_type, kernels: dict(prefer))
    before = (dict(dispatch._state.preferred), dict(dispatch._state.planned), dispatch._state.strict)
    try:
        cfg = load_config("recipes/glm5-flash-tiny-dna.yaml", [])
        measure.warm_planned_step(cfg, 256, torch.device("cpu"))
        assert dispatch._state.preferred == prefer
    finally:
        dispatch.configure(*before)
    assert dispatch._state.preferred == before[0]


def test_timed_steps_say_the_cold_first_step_compiles_on_a_gpu(monkeypatch, capsys):
    """On a GPU the warm-up step compiles and autotunes for minutes (467 s at 1M on a fresh H200): the bench
    says so before it starts, and then reports each step; on the CPU there is nothing to compile."""
    import torch

    from megaseq.bench import measure

    monkeypatch.setattr(measure, "_sync", lambda device: None)
    calls = []
    assert len(measure.timed_steps(lambda: calls.append(1), 2, torch.device("cuda"))) == 2 and len(calls) == 3
    err = capsys.readouterr().err.splitlines()
    assert "compiles and autotunes" in err[0] and "step 1 of 3 (warm-up)" in err[1] and len(err) == 4
    measure.timed_steps(lambda: None, 0, torch.device("cpu"))
    err = capsys.readouterr().err
    assert "compiles" not in err and "step 1 of 1 (timed)" in err


def test_the_cold_start_note_is_for_gpus_only(monkeypatch):
    from megaseq.ops.kernels import cold_start_note

    monkeypatch.setenv("TRITON_CACHE_DIR", "/cache/here")
    assert "/cache/here" in cold_start_note("cuda") and cold_start_note("cpu") is None


def test_a_row_names_what_earlier_rows_left_allocated(monkeypatch, capsys):
    """A row's measured peak is ``max_memory_allocated``, which counts what earlier rows of the process left on the
    GPU (the indexer benchmark's second row read 3.3 GiB above the same run in a process of its own at 32K, and ran
    out of memory at 1M where that run peaked at 53 GiB): the row records it and a leftover above
    ``LEFT_WARN_BYTES`` is named in the log with the fix; nothing is read off CUDA."""
    allocated = {"bytes": 0}
    monkeypatch.setattr(measure, "free_memory", lambda device: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated["bytes"])
    cuda = torch.device("cuda")
    assert measure.left_allocated(cuda) == 0 and "still allocated" not in capsys.readouterr().err
    allocated["bytes"] = 3 << 30
    assert measure.left_allocated(cuda) == 3 << 30
    err = capsys.readouterr().err
    assert "3.00 GiB" in err and "still allocated" in err and "process of its own" in err
    assert measure.left_allocated(torch.device("cpu")) is None


def test_a_row_frees_its_step_before_it_returns(monkeypatch):
    """What the row's step holds (the optimizer and its state) is gone when ``measure_megaseq`` returns, even held
    in a reference cycle: the collection runs after the row's model, data and step are dropped, so the next row
    does not start with them allocated."""
    import gc
    import weakref

    monkeypatch.chdir(ROOT)

    class State:  # the optimizer's state, in a cycle with the step that uses it
        pass

    held = []

    def planned_step(c, spec, device, plan, total_steps):
        state = State()
        state.self = state
        held.append(weakref.ref(state))
        return torch.nn.Linear(2, 2), None, lambda: None, lambda batch: state

    monkeypatch.setattr(measure, "planned_step", planned_step)
    cfg = load_config("recipes/glm5-flash-tiny-dna.yaml", [])
    gc.disable()
    try:
        row = measure.measure_megaseq(cfg, 256, 1, "random")
        assert row["status"] == "ok" and held and held[0]() is None
    finally:
        gc.enable()


def test_the_fixes_column_names_the_layers_that_keep_attention():
    from megaseq.bench.report import fix_names

    row = {"fixes": ["tiled_mlp", "recompute"], "memory_plan": {"keep_attention_layers": 48,
                                                               "keep_attention_host_layers": 40}}
    assert fix_names(row) == "tiled_mlp, recompute (48 keep attention, 40 of them in host memory)"
    row["memory_plan"] = {"keep_attention_layers": 0}
    assert fix_names(row) == "tiled_mlp, recompute"
    assert fix_names({"fixes": []}) == "-"

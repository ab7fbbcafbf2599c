"""``benchmarks/speed/profile_step.py``'s attribution of GPU time to forward parts and backward functions.

The profiler returns each ``record_function`` label twice: the CPU-side range (whose device time is the kernels
launched inside it) and a GPU-side annotation of the same name (whose device time is the range's elapsed time
on the GPU, idle gaps included). Only the first is kernels. Here with stand-in events, so that the rule is
checked without a GPU; a real CPU profile runs too (the CPU has no GPU-side annotations: the same figures).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import bench_scripts

CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
BWD = "autograd::engine::evaluate_function: "


@pytest.fixture(scope="module")
def profile_step():
    return bench_scripts.load("speed/profile_step", "profile_step_bench")


def _evt(name, device_us, device_type=CPU, parent=None):
    return SimpleNamespace(name=name, device_time_total=device_us, device_type=device_type, cpu_parent=parent)


def test_forward_parts_count_the_cpu_side_ranges_only(profile_step):
    layer = _evt("fwd:self_attn:MLA", 100.0)  # its kernels, the indexer's included (children count in torch)
    indexer = _evt("fwd:self_attn.indexer:Indexer", 30.0, parent=layer)
    events = [layer, indexer,
              _evt("fwd:self_attn:MLA", 180.0, CUDA),  # the GPU-side annotations: elapsed ranges, not kernels
              _evt("fwd:self_attn.indexer:Indexer", 90.0, CUDA),
              _evt(BWD + "MulBackward0", 40.0), _evt("aten::mm", 500.0)]
    fwd, bwd = profile_step.by_label(events)
    assert fwd == {"fwd:self_attn:MLA": 70.0, "fwd:self_attn.indexer:Indexer": 30.0}
    assert bwd == {"MulBackward0": 40.0}


def test_labels_of_a_real_cpu_profile(profile_step):
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("fwd:lin:Linear"):
            y = lin(x)
        y.square().sum().backward()
    fwd, bwd = profile_step.by_label(prof.events(), time_of=lambda e: float(e.cpu_time_total))
    assert set(fwd) == {"fwd:lin:Linear"} and fwd["fwd:lin:Linear"] > 0
    assert any("Backward" in k for k in bwd), bwd


def test_the_engines_adds_are_their_own_row(profile_step):
    """An aten op right under an evaluate_function, beside the node's own event, is the engine summing a
    tensor's gradients (or casting them): its own row, not the node's."""
    node = _evt(BWD + "ViewBackward0", 100.0)
    own = _evt("ViewBackward0", 10.0, parent=node)
    add = _evt("aten::add_", 90.0, parent=node)
    inner = _evt("aten::mm", 5.0, parent=own)  # inside the node's own backward: the node's
    _, bwd = profile_step.by_label([node, own, add, inner])
    assert bwd == {"ViewBackward0": 10.0, profile_step.ENGINE: 90.0}


def test_the_engines_adds_in_a_real_cpu_profile(profile_step):
    x = torch.randn(64, 64, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        (x.view(-1).square().sum() + x.exp().sum()).backward()  # x's two uses: the engine adds their gradients
    _, bwd = profile_step.by_label(prof.events(), time_of=lambda e: float(e.cpu_time_total))
    assert bwd.get(profile_step.ENGINE, 0) > 0, bwd



def _x(cat, name, ts, dur, tid=1, corr=None):
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0 if cat == "kernel" else 1, "tid": tid}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def test_idle_gaps_count_for_the_launch_after_them(profile_step):
    """A gap between two kernels counts for the host context that launched the second (here the add after a
    sync inside the indexer's label), overlapping kernels count once, and the sync is listed where it ran."""
    trace = {"traceEvents": [
        _x("user_annotation", "fwd:self_attn.indexer:Indexer", 0, 100),
        _x("cpu_op", "aten::mm", 10, 10), _x("cuda_runtime", "cudaLaunchKernel", 12, 2, corr=5),
        _x("cpu_op", "aten::item", 30, 40), _x("cuda_runtime", "cudaStreamSynchronize", 35, 30),
        _x("cpu_op", "aten::add", 80, 10), _x("cuda_runtime", "cudaLaunchKernel", 82, 2, corr=6),
        _x("user_annotation", BWD + "MmBackward0", 120, 50, tid=2),
        _x("cuda_driver", "cuLaunchKernelEx", 125, 2, tid=2, corr=7),  # a Triton kernel's launch
        _x("kernel", "k1", 20, 40, tid=7, corr=5), _x("kernel", "k1b", 30, 10, tid=8),
        _x("kernel", "k2", 90, 5, tid=7, corr=6), _x("kernel", "k3", 130, 10, tid=7, corr=7),
    ]}
    g = profile_step.idle_gaps(trace)
    assert g["busy_ms"] == pytest.approx((40 + 5 + 10) / 1e3)
    assert g["idle_ms"] == pytest.approx((30 + 35) / 1e3)
    assert g["by_where"] == pytest.approx({"fwd:self_attn.indexer:Indexer > aten::add": 0.030,
                                           "bwd:MmBackward0 > -": 0.035})
    assert g["longest"][0]["next_kernel"] == "k3"
    assert g["longest"][0]["after"] == "fwd:self_attn.indexer:Indexer > aten::add"  # k2 ended last before it
    assert g["longest"][1]["after"] == "fwd:self_attn.indexer:Indexer > aten::mm"
    assert g["longest"][1]["outer"] == "aten::add"
    assert g["syncs"] == {"cudaStreamSynchronize in fwd:self_attn.indexer:Indexer > aten::item":
                          {"count": 1, "host_ms": pytest.approx(0.03)}}

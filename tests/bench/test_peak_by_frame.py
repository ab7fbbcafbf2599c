"""benchmarks/memory/peak_by_frame.py's analysis of a CUDA memory history: the peak of the replayed allocations,
the blocks live at it, and their bytes by the innermost megaseq frame. A replay that ignores frees (a broken
variant) reports another peak and fails."""

from __future__ import annotations

import pytest

import bench_scripts

F_OURS = {"filename": "/x/src/megaseq/memory/offload.py", "line": 120, "name": "offload"}
F_TORCH = {"filename": "/y/torch/nn/functional.py", "line": 7, "name": "linear"}


def _alloc(addr: int, size: int, *frames) -> dict:
    return {"action": "alloc", "addr": addr, "size": size, "frames": list(frames)}


def _free(addr: int) -> dict:
    return {"action": "free_completed", "addr": addr}


TRACE = [
    _free(99),                            # allocated before the window: skipped
    _alloc(1, 100, F_TORCH, F_OURS),      # 100
    _alloc(2, 300, F_TORCH),              # 400
    _free(1),                             # 300
    _alloc(3, 250, F_OURS),               # 550: the peak, blocks 2 and 3
    _free(2), _free(3),
    _alloc(4, 500, F_OURS),               # 500
]


def check_replay(peak_blocks) -> None:
    peak, blocks = peak_blocks(TRACE)
    assert peak == 550 and sorted(b["addr"] for b in blocks) == [2, 3]


def test_peak_and_live_blocks():
    bench = bench_scripts.load("memory/peak_by_frame")
    check_replay(bench.peak_blocks)
    peak, blocks = bench.peak_blocks(TRACE)
    assert bench.frame_key(TRACE[1], 1) == "megaseq/memory/offload.py:120:offload"  # ours before torch's
    assert bench.frame_key(TRACE[2], 1) == "/y/torch/nn/functional.py:7:linear"
    lines = bench.report(peak, blocks)
    assert lines[0].startswith("peak of the recorded allocations: 0.00 GiB in 2 live blocks")


def test_the_peak_from_a_frame_on():
    """From the first allocation inside ``step`` on: block 2 (made before it, still live) counts, the earlier
    peak does not."""
    bench = bench_scripts.load("memory/peak_by_frame")
    step = {"filename": "/x/src/megaseq/train/step.py", "line": 9, "name": "step"}
    trace = [*TRACE[:5], _free(3), _alloc(5, 50, F_TORCH, step), _free(5), _alloc(6, 10, step)]
    # replayed: 100, 400, 300, 550 (before the window), 300, 350 (block 5 in step: the peak), 300, 310
    peak, blocks = bench.peak_blocks(trace, "step")
    assert peak == 350 and sorted(b["addr"] for b in blocks) == [2, 5]
    assert bench.peak_blocks(trace, "") == bench.peak_blocks(trace)
    assert bench.peak_blocks(trace, "nowhere") == (0, [])


def test_broken_replay_without_frees_fails():
    bench = bench_scripts.load("memory/peak_by_frame")
    with pytest.raises(AssertionError):
        check_replay(lambda trace: bench.peak_blocks([e for e in trace if e["action"] == "alloc"]))


def test_a_block_stops_counting_when_its_free_is_requested():
    """A block used on a side stream (``record_stream``) completes its free late; ``max_memory_allocated`` stops
    counting it at the request, and so does the replay (counting to the completion reports 800 here)."""
    bench = bench_scripts.load("memory/peak_by_frame")
    trace = [_alloc(1, 500, F_OURS), {"action": "free_requested", "addr": 1}, _alloc(2, 300, F_TORCH),
             _free(1), _alloc(3, 100, F_OURS)]
    peak, blocks = bench.peak_blocks(trace)
    assert peak == 500 and [b["addr"] for b in blocks] == [1]
    later = [_alloc(1, 500, F_OURS), {"action": "free_requested", "addr": 1}, _alloc(2, 300, F_TORCH),
             _alloc(3, 400, F_OURS), _free(1)]
    assert bench.peak_blocks(later)[0] == 700

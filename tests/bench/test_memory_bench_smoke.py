"""benchmarks/memory/bench_memory_schemes.py runs end to end on tiny CPU shapes (--smoke) and writes its report."""

from __future__ import annotations

import gc
import json

import bench_scripts


def test_memory_benchmark_smoke(tmp_path):
    bench = bench_scripts.load("memory/bench_memory_schemes", "bench_memory_schemes")
    out = tmp_path / "mem.json"
    # the script calls gc.collect() before every measurement (CUDA memory baselines); frozen, the objects of the
    # test session so far (tens of seconds of collections in a full run) are not rescanned each time, while
    # what the script makes is collected as before
    gc.freeze()
    try:
        assert bench.main(["--smoke", "--out", str(out)]) == 0
    finally:
        gc.unfreeze()
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"vocab_loss", "chunked_long", "tiled_moe", "indexer", "sco", "offload_adam"}
    assert results["indexer"]["256_identical"] and results["indexer"]["512_identical_to_x8"]
    for name, section in results.items():
        assert "error" not in section, (name, section.get("error"))
    assert results["sco"]["sco_all_offloaded"]["offloaded_per_step"] == 3
    assert "| SCO step time |" in out.with_suffix(".md").read_text()

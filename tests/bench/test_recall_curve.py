"""``benchmarks/long_context/recall_curve.py``: the indexer's recall by stage from a run's metrics, against sums
worked out by hand on a synthetic run (a dense warm-up of 3 steps, then 4 sparse steps, two layers)."""

import json

import pytest

from bench_scripts import load

rc = load("long_context/recall_curve")


def rows():
    out = []
    for step in range(1, 8):
        dense = step <= 3
        out.append({"step": step, "loss": 1.0, "indexer_dense": 1.0 if dense else 0.0,
                    "indexer_recall/3": 0.1 * step, "indexer_recall_random/3": 0.2 if dense else 0.3,
                    "indexer_recall/7": 0.5, "indexer_recall_random/7": 0.25})
    return out


def test_stages_average_their_own_steps(tmp_path):
    s = rc.summarise(rows(), window=2)
    assert s["steps"] == 7 and s["warmup_steps"] == 3
    L3 = s["layers"]["3"]
    assert L3["init"]["recall"] == pytest.approx(0.15) and L3["init"]["steps"] == [1, 2]
    assert L3["after_warmup"]["recall"] == pytest.approx(0.25) and L3["after_warmup"]["random"] == pytest.approx(0.2)
    assert L3["end"]["recall"] == pytest.approx(0.65) and L3["end"]["random"] == pytest.approx(0.3)
    assert "| 7 | 0.500 (0.250) | 0.500 (0.250) | 0.500 (0.250) | 2.00x |" in rc.table(s)


def test_writes_json_md_png_and_refuses_a_run_without_recall(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows()) + "\n")
    assert rc.main([str(run), "--out", str(tmp_path / "out" / "recall"), "--window", "2"]) == 0
    data = json.loads((tmp_path / "out" / "recall.json").read_text())
    assert data["layers"]["3"]["end"]["recall"] == pytest.approx(0.65)
    assert (tmp_path / "out" / "recall.png").stat().st_size > 0
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    with pytest.raises(SystemExit, match="model.train_indexer"):
        rc.main([str(run), "--out", str(tmp_path / "x")])

"""Runs that read well: plain lines outside a terminal, rank 0 only, held-out evaluation every N steps with
its own progress, the loss curve, recipes whose paths resolve from the recipe, one message for a bad start."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from megaseq.config import build_config, load_config
from megaseq.train.metrics import MetricsLogger, over_plan, scheme_drift, step_line
from megaseq.train.trainer import run_training

torch.set_num_threads(2)
LINE = re.compile(r"^step (\d+)/(\d+) \| loss \d+\.\d{4} \| [\d,]+ tok/s \| \d+\.\d+ s/step \| host \d+\.\d GiB"
                  r"( \| ETA \d+[smh])?")


def _fasta(path: Path, n: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    path.write_text(">rec\n" + "".join(rng.choice(list("ACGT"), n)) + "\n")
    return path


def _cfg(tmp_path: Path, **sections):
    raw = {
        "data": {"train": [str(_fasta(tmp_path / "g.fa", 1200))], "seq_len": 64, "heldout_tail": 0.25},
        "train": {"steps": 4, "run_dir": str(tmp_path / "r"), "eval_after": False, "export_hf": False},
        "optim": {"lr": 1e-2, "warmup_steps": 2},
        "log": {"progress": True, "tensorboard": False},
        "eval": {"by_position": 32, "kmer_k": 3, "max_windows": 2},
        "model": {"dtype": "fp32"},
    }
    for k, v in sections.items():
        raw.setdefault(k, {}).update(v)
    return build_config(raw)


def test_plain_step_lines_outside_a_terminal(tmp_path, capsys):
    run_training(_cfg(tmp_path))
    out = capsys.readouterr().out.splitlines()
    steps = [ln for ln in out if ln.startswith("step ")]
    assert [int(LINE.match(ln).group(1)) for ln in steps] == [1, 2, 3, 4], out
    assert all("ETA" in ln for ln in steps)


def test_no_output_when_progress_is_off(tmp_path, capsys):
    run_training(_cfg(tmp_path, log={"progress": False}))
    assert not [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(("step ", "eval "))]


def test_step_line_eta_and_memory():
    logger = MetricsLogger(Path("."), 10, enabled=False)
    logger._step_s = [2.0, 4.0]
    assert logger.eta(4) == pytest.approx(3.0 * 6)
    rec = {"step": 4, "loss": 1.25, "tokens_per_s": 1234.5, "step_s": 3.0, "gpu_peak_gib": 12.34,
           "plan_gpu_gib": 13.0, "host_peak_gib": 2.0}
    assert step_line(rec, 10, 18.0) == ("step 4/10 | loss 1.2500 | 1,234 tok/s | 3.00 s/step | gpu 12.3 GiB "
                                        "(plan 13.0) | host 2.0 GiB | ETA 18s")


def test_over_plan_warns_only_above_the_plans_whole_figure():
    rec = {"step": 3, "gpu_peak_gib": 70.6, "plan_gpu_gib": 43.4}
    msg = over_plan(rec, "runs/x")
    assert msg.startswith("step 3: the GPU peak, 70.6 GiB of tensors, is above the plan's 43.4 GiB (+63%)")
    assert "runs/x/plan.json" in msg
    assert over_plan(dict(rec, gpu_peak_gib=43.4), "r") is None  # at the plan: no warning
    assert over_plan(dict(rec, gpu_peak_gib=0.0), "r") is None  # no GPU
    assert over_plan({"step": 1, "gpu_peak_gib": 5.0}, "r") is None  # no plan figure


def test_a_step_above_its_plan_is_reported_once(tmp_path, caplog, monkeypatch):
    """The trainer says so at the first step whose GPU peak outgrew the plan, and not again (a broken loop that
    warns at every step, or never, fails)."""
    import logging

    from megaseq.train import loop

    monkeypatch.setattr(loop, "gpu_peak_bytes", lambda device: 10**15)  # ~931,000 GiB: above any plan
    with caplog.at_level(logging.INFO, logger="megaseq"):
        run_training(_cfg(tmp_path, log={"progress": False}))
    said = [r.getMessage() for r in caplog.records if "is above the plan's" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("step 1: the GPU peak"), said


def test_scheme_drift_names_what_stayed_on_the_gpu():
    rec = {"step": 2, "offloaded_layers": 24, "plan_offloaded_layers": 48, "streamed_layers_resident": 2}
    msg = scheme_drift(rec)
    assert msg.startswith("step 2: memory.checkpoint_offload put 24 of the plan's 48 layer inputs in host memory; "
                          "the other 24 stayed on the GPU"), msg
    assert scheme_drift(dict(rec, offloaded_layers=48)) is None  # as planned
    assert scheme_drift(dict(rec, offloaded_layers=48, streamed_layers_resident=3)).startswith(
        "step 2: memory.stream_base had 3 layers on the GPU at once; the plan counts 2")
    assert scheme_drift({"step": 1, "loss": 1.0}) is None  # no scheme applied


def _sco_stream_cfg(tmp_path: Path):
    return _cfg(tmp_path, log={"progress": False}, data={"seq_len": 128},
                model={"name": "qwen3-moe-tiny", "dtype": "fp32"}, lora={"rank": 4, "targets": ["all"]},
                train={"steps": 2},
                memory={"auto": False, "recompute": True, "checkpoint_offload": True, "stream_base": True})


def test_the_records_count_what_the_schemes_did_beside_the_plan(tmp_path, caplog):
    """Each step records the layer inputs SCO put in host memory and the streamed layers on the device at once,
    beside the plan's count; as planned, nothing is said."""
    import logging

    with caplog.at_level(logging.INFO, logger="megaseq"):
        run_training(_sco_stream_cfg(tmp_path))
    records = [json.loads(ln) for ln in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    layers = json.loads((tmp_path / "r" / "plan.json").read_text())["offloaded_layers"]
    assert layers == 4  # qwen3-moe-tiny's layers, all offloaded within the default budget
    for r in records:
        assert (r["offloaded_layers"], r["plan_offloaded_layers"], r["streamed_layers_resident"]) == (4, 4, 2)
    assert not [r for r in caplog.records if "layer inputs in host memory" in r.getMessage()]


def test_a_step_whose_offload_fell_short_of_the_plan_is_reported_once(tmp_path, caplog, monkeypatch):
    """An offloader that runs out of host slots (a pool planned for one slot) keeps the other layer inputs on the
    GPU: the first step says so, once."""
    import logging

    from megaseq.memory.offload import BoundaryOffloader

    plan_pool = BoundaryOffloader._plan_pool

    def one_slot(self, nbytes, on_cuda):
        self.max_slots = 1
        plan_pool(self, nbytes, on_cuda)

    monkeypatch.setattr(BoundaryOffloader, "_plan_pool", one_slot)
    with caplog.at_level(logging.INFO, logger="megaseq"):
        run_training(_sco_stream_cfg(tmp_path))
    records = [json.loads(ln) for ln in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["offloaded_layers"] for r in records] == [1, 1]
    said = [r.getMessage() for r in caplog.records if "layer inputs in host memory" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("step 1: memory.checkpoint_offload put 1 of the plan's 4"), said


def test_eval_every_logs_held_out_loss_beside_the_baselines(tmp_path, capsys):
    result = run_training(_cfg(tmp_path, train={"eval_every": 2}))
    records = [json.loads(ln) for ln in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    for r in evals:
        assert r["eval_bits_per_base"] == pytest.approx(r["eval_loss"] / np.log(2))
        assert r["eval_baseline"] == "kmer-k3" and 1.5 < r["eval_baseline_bits_per_base"] < 2.2
        assert r["eval_uniform_bits_per_base"] == 2.0 and r["eval_tokens"] > 0
    out = capsys.readouterr().out
    assert re.search(r"^eval step 2 \| held-out \d\.\d{4} bits per base \| (beats|does not beat) kmer-k3", out, re.M)
    assert "eval: window 1/" in out and "eval: window 2/2" in out  # its own progress
    assert (tmp_path / "r" / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert len(result.losses) == 4


def test_eval_every_equals_a_separate_evaluation(tmp_path):
    """The in-run held-out loss is the model's: the same number as evaluating the saved weights afterwards."""
    from megaseq.data import build_data
    from megaseq.eval.loss import per_token_loss_fn
    from megaseq.parallel.env import ParallelEnv
    from megaseq.train.convert import load_megaseq_checkpoint
    from megaseq.train.heldout import HeldoutProbe

    cfg = _cfg(tmp_path, train={"eval_every": 4})
    run_training(cfg)
    last = [json.loads(ln) for ln in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()][-1]
    model, spec, _ = load_megaseq_checkpoint(tmp_path / "r")
    data = build_data(cfg.data, cfg.eval, vocab_size=spec.vocab_size)
    fn = per_token_loss_fn(model.eval(), ParallelEnv(), None, 8192)
    probe = HeldoutProbe(cfg, data, ParallelEnv(), None, cfg.memory)
    nats, _ = probe._bits(fn)
    assert last["eval_loss"] == pytest.approx(nats, rel=1e-6)


@pytest.mark.parametrize("change, match", [
    ({"data": {"heldout_tail": 0.0}}, "train.eval_every needs held-out data"),
])
def test_eval_every_without_held_out_data_is_refused_first(tmp_path, change, match):
    with pytest.raises(ValueError, match=match):
        run_training(_cfg(tmp_path, train={"eval_every": 2}, **change))
    assert not (tmp_path / "r").exists()


def test_eval_every_must_not_be_negative():
    with pytest.raises(ValueError, match="train.eval_every must be >= 0"):
        build_config(None, ["train.eval_every=-1"])


def _two_rank_run(rank, cfg):
    from megaseq.train.trainer import run_training

    run_training(cfg)


def test_only_rank_0_prints(tmp_path, capfd):
    """Two gloo processes (data parallel): one line per step, not two."""
    from megaseq.parallel.launch import spawn_local

    cfg = _cfg(tmp_path, parallel={"dp": 2, "launcher": "torchrun", "backend": "gloo"},
               train={"steps": 2, "device": "cpu", "eval_every": 1})
    spawn_local(_two_rank_run, 2, args=(cfg,))
    captured = capfd.readouterr()
    out = captured.out.splitlines()
    assert [ln.split(" |")[0] for ln in out if ln.startswith("step ")] == ["step 1/2", "step 2/2"], out
    # held-out evaluation is one process's job: said once, and skipped
    assert captured.err.count("train.eval_every: held-out evaluation runs in one process") == 1
    assert not [ln for ln in out if ln.startswith("eval ")]


def test_recipe_paths_resolve_from_the_recipe(tmp_path, monkeypatch):
    """A recipe names its files relative to itself: it runs from any working directory."""
    (tmp_path / "recipes" / "data").mkdir(parents=True)
    _fasta(tmp_path / "recipes" / "data" / "a.fa", 300)
    recipe = tmp_path / "recipes" / "r.yaml"
    recipe.write_text("data:\n  train: [data/a.fa]\n  heldout: [data/*.fa]\nmodel:\n  name: glm5-flash-tiny\n")
    monkeypatch.chdir(tmp_path / "recipes" / "data")
    cfg = load_config(recipe, ["data.seq_len=64"])
    assert cfg.data.train == [str(tmp_path / "recipes" / "data" / "a.fa")]
    assert cfg.data.heldout == [str(tmp_path / "recipes" / "data" / "*.fa")]
    assert cfg.model.name == "glm5-flash-tiny"  # a preset name stays a name
    over = load_config(recipe, ["data.train=b.fa"])  # the command line is relative to the working directory
    assert over.data.train == ["b.fa"]


def test_every_shipped_recipe_names_files_that_exist_or_says_what_it_needs():
    """Each recipe in recipes/ loads from any directory; a file it names exists, or it is one of the shared
    genomes (shared/ beside the repository) and the recipe's header says what it needs."""
    root = Path(__file__).resolve().parents[2]
    shared = (root.parent / "shared" / "data" / "genomes").resolve()
    for recipe in sorted((root / "recipes").glob("*.yaml")):
        cfg = load_config(recipe)
        named = [Path(p) for p in list(cfg.data.train) + list(cfg.data.heldout)]
        if Path(cfg.model.name).suffix == ".json":
            assert Path(cfg.model.name).is_file(), f"{recipe.name}: model {cfg.model.name}"
        for path in named:
            assert path.is_absolute(), f"{recipe.name}: {path} not resolved from the recipe"
            if not path.exists():
                assert path.parent == shared, f"{recipe.name}: {path} does not exist"
                assert "shared/data/genomes" in recipe.read_text().split("\nmodel:")[0], recipe.name
        if shared.is_dir():
            assert all(p.exists() for p in named), f"{recipe.name}: {[p for p in named if not p.exists()]}"


def test_loss_curve_is_scaled_to_the_region_that_matters(tmp_path, monkeypatch):
    import megaseq.eval.report as report
    from megaseq.train.loss_curve import plot_loss_curve

    recs = [{"step": s, "loss": (4.0 if s < 3 else 2.0 - 0.001 * s) * np.log(2)} for s in range(1, 41)]
    recs += [{"step": 20, "eval_loss": 1.99 * np.log(2), "eval_bits_per_base": 1.99, "eval_baseline": "kmer-k6",
              "eval_baseline_bits_per_base": 1.97}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    seen = {}
    monkeypatch.setattr(report, "save_figure", lambda fig, path: seen.setdefault("fig", fig))
    plot_loss_curve(tmp_path, "base")
    ax = seen["fig"].axes[0]
    labels = [line.get_label() for line in ax.get_lines()]
    assert "kmer-k6 on held-out: 1.970" in labels and "uniform A/C/G/T: 2.000" in labels
    assert "held-out loss" in labels and "(the first steps are above the scale)" in labels
    lo, hi = ax.get_ylim()
    assert lo < 1.96 and 2.0 < hi < 2.2  # not stretched up to the first steps' 4 bits


def test_time_limit_stops_after_the_step_that_fits_and_resume_finishes_the_run(tmp_path, monkeypatch, capsys):
    """train.time_limit: with every step taking 10 s (a fake clock) and a limit of 25 s, the run stops after step
    2 (2 x 10 s spent + 10 s for the next > 25 s), saves a checkpoint there, exports and evaluates as a finished
    run; --train.resume true continues it to step 4 with the losses of an uninterrupted run."""
    from megaseq.train import loop

    clock = {"t": 0.0}

    class FakeTime:
        @staticmethod
        def perf_counter() -> float:
            clock["t"] += 5.0  # each step reads the clock twice (its start and end): 10 s a step
            return clock["t"]

    full = run_training(_cfg(tmp_path, train={"run_dir": str(tmp_path / "full")}))
    monkeypatch.setattr(loop, "time", FakeTime)
    cut = {"run_dir": str(tmp_path / "cut")}
    first = run_training(_cfg(tmp_path, train={**cut, "time_limit": "25s", "export_hf": True, "eval_after": True}))
    assert first.time_limited == (2, 4, "25s"), first.time_limited
    assert len(first.losses) == 2 and first.last_checkpoint.name == "step_000002"
    assert first.hf_export is not None and first.hf_export.is_dir()
    assert "after (step 2)" in (tmp_path / "cut" / "eval" / "eval_by_position.md").read_text()  # not train.steps
    assert "train.time_limit 25s reached after step 2 of 4" in capsys.readouterr().err
    monkeypatch.undo()
    rest = run_training(_cfg(tmp_path, train={**cut, "resume": True}))
    assert rest.time_limited is None
    np.testing.assert_allclose(first.losses + rest.losses, full.losses, rtol=0, atol=1e-12)


def test_time_limit_leaves_the_first_step_out_of_the_estimate_once_another_ran(monkeypatch):
    """A first step of 30 s (compiling) and warm steps of 10 s under a 65 s limit: the run takes 4 steps (60 s),
    not the 2 that the first step's 30 s as the estimate would allow; with one step run, it is the estimate."""
    from megaseq.train import loop

    clock = {"t": 0.0}
    monkeypatch.setattr(loop.time, "perf_counter", lambda: clock["t"])
    limit = loop.TimeLimit(65, None)
    stops = []
    for step_s in (30, 10, 10, 10, 10):
        clock["t"] += step_s
        stops.append(limit.spent(step_s))
    assert stops == [False, False, False, True, True]
    alone = loop.TimeLimit(55, None)
    clock["t"] += 30
    assert alone.spent(30)  # 30 s spent + 30 s for the next > 55 s


@pytest.mark.parametrize("bad", ["-5", "ten minutes", "5d", "nan"])
def test_time_limit_that_is_not_a_duration_is_refused(bad):
    with pytest.raises(ValueError, match="train.time_limit expects a duration"):
        build_config({"train": {"time_limit": bad}})


def test_time_limit_reads_seconds_minutes_and_hours():
    from megaseq.config import parse_duration

    assert [parse_duration(v) for v in (600, "90s", "20m", "1.5h", "")] == [600, 90, 1200, 5400, 0]

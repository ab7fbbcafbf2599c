"""LoRA under expert parallelism (``parallel.ep`` 2, with and without FSDP) started from saved weights, built by
the trainer's ``build_planned_model`` and stepped by its ``train_step``, over gloo processes, float64:
qwen3-moe-tiny with adapters on the attention and the routed experts (their factors split over the ep ranks)
and the post-attention norms trained. Two clipped AdamW steps equal the one-process steps on the whole batch:
the loss, every trained gradient and every parameter after the second step; the frozen base's fingerprint (what a
trainable-only checkpoint records, summed over FSDP's mesh and the experts' apart) is the one process's.

- ``lora.init_from`` (a PEFT adapter with random factors, B nonzero): each rank takes its experts' rows of the
  expert factors and the whole attention factors; ep 2, and ep 2 x dp 2 with the frozen base FSDP-sharded.
- ``model.init_from`` (a HF checkpoint), the adapters drawn on the loaded model: on ep 2 by ``apply_adapters``
  after the load, on ep 2 x dp 2 with FSDP by ``draw_adapters`` once the meta-built model is materialised (B is
  zero at the start: A shows in B's first gradient).
- ``megaseq train`` from ``model.init_from`` on ep 2 x dp 2 with FSDP (4 ranks): the one-process run's losses
  and gradient norms, the trained tensors of the step-1 and step-2 checkpoints, the PEFT adapter (the expert
  factors gathered) and the merged HF export.

Broken variants that must fail: every rank loading the first ``E / ep`` experts' rows of the saved expert
factors (not its own); one rank drawing the adapters from another point of the generator; the frozen base's
fingerprint summed over one mesh (the expert slices counted once per replica); the adapters' and norms'
gradients not summed over the ranks in the trainer's run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.tensor  # noqa: F401  assert_close imports it lazily: once here, not in each fork
from test_ep_fsdp import LLEP, S, max_rel_err
from test_fsdp_train_step import STEPS, run_steps

from conftest import torch_threads
from lora_helpers import randomize_adapters
from lora_parallel_checks import assert_steps_match
from megaseq.config import MemorySettings, build_config
from megaseq.models.common.lora import is_adapter
from megaseq.models.presets import get_preset
from megaseq.parallel.env import DistributedEnv, ParallelEnv
from megaseq.parallel.fsdp import is_sharded
from megaseq.parallel.launch import spawn_local

PRESET = "qwen3-moe-tiny"
TRAIN = "*.post_attention_layernorm.weight"


def _cfg(src: Path, start: str, dp: int = 1, ep: int = 1, fsdp: str = "off"):
    """The run's settings, started from ``src/adapter`` (``start`` "lora") or ``src/hf`` ("model")."""
    over = {"model.name": PRESET, "model.dtype": "fp64", "parallel.dp": dp, "parallel.ep": ep,
            "parallel.backend": "gloo", "parallel.fsdp": fsdp, "parallel.loss_parallel": "ring_dtp",
            "data.seq_len": S, "train.device": "cpu", "optim.grad_clip": 0.5, "lora.rank": 3, "lora.alpha": 5.0,
            "lora.targets": "attention,experts", "train.trainable": TRAIN, **(LLEP if ep > 1 else {})}
    if start == "lora":
        over["lora.init_from"] = str(src / "adapter")
    elif start == "model":
        over["model.init_from"] = str(src / "hf")
    return build_config(overrides=over)


def _build(cfg, env) -> torch.nn.Module:
    from megaseq.train.build import build_planned_model

    model, _, _, _ = build_planned_model(cfg, get_preset(PRESET), torch.device("cpu"), MemorySettings(), STEPS,
                                         cfg.model.init_from, env)
    return model


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    """``hf``: a HF checkpoint of the model drawn with seed 3 (not the runs' seed-0 base); ``adapter``: a PEFT
    adapter of random factors (B nonzero) on the attention and the experts."""
    from megaseq.models.build import build_model
    from megaseq.models.hf_io import export_hf_checkpoint
    from megaseq.models.peft_io import export_adapter

    out = tmp_path_factory.mktemp("lora_ep_start")
    spec = get_preset(PRESET)
    with torch_threads(1):
        export_hf_checkpoint(build_model(spec, dtype=torch.float64, seed=3), spec, out / "hf")
        cfg = _cfg(out, "")
        model = _build(cfg, ParallelEnv())
        randomize_adapters(model, seed=11)
        export_adapter(model, spec, cfg.lora, out / "adapter")
    return out


def reference(src: Path, start: str):
    """The one-process ``run_steps`` (losses, gradients, parameters after) and the frozen base's fingerprint."""
    from megaseq.train.checkpoint import base_fingerprint

    with torch_threads(1):
        cfg = _cfg(src, start)
        model = _build(cfg, ParallelEnv())
        return (*run_steps(model, ParallelEnv(), MemorySettings(), cfg), base_fingerprint(model))


@pytest.fixture(scope="module")
def lora_ref(src):
    return reference(src, "lora")


@pytest.fixture(scope="module")
def model_ref(src):
    return reference(src, "model")


def _break(env: DistributedEnv, broken: str) -> None:
    if broken == "first_rows":  # every rank loads the first E / ep experts' factors, whatever its experts
        import megaseq.models.peft_io as peft_io

        def first_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
            local = dst.to_local() if hasattr(dst, "to_local") else dst
            local.copy_(src[:local.shape[0]])

        peft_io.copy_whole = first_rows
    elif broken == "redrawn" and env.ep_rank == 1:  # this rank's factors from one draw further on
        import megaseq.models.common.lora as lora

        init = lora.init_factors

        def shifted(a, b, fan_in, settings, gen) -> None:
            torch.rand(1, generator=gen)
            init(a, b, fan_in, settings, gen)

        lora.init_factors = shifted


def _one_mesh_fingerprint(model: torch.nn.Module) -> list[float]:
    """The broken fingerprint: every DTensor's local sums added over one mesh (the last one met), as if FSDP's
    shards were the only DTensors; the expert slices are then counted once per dp replica."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    sums, mesh, placements = [0.0, 0.0], None, None
    for i, p in enumerate(p for p in model.parameters() if not p.requires_grad):
        local = p.detach()
        if isinstance(local, DTensor):
            mesh, placements = local.device_mesh, [Partial() if isinstance(q, Shard) else Replicate()
                                                   for q in local.placements]
            local = local.to_local()
        sums[0] += (i + 1) * float(local.sum(dtype=torch.float64))
        sums[1] += float(local.abs().sum(dtype=torch.float64))
    return DTensor.from_local(torch.tensor(sums, dtype=torch.float64), mesh, placements).full_tensor().tolist()


def _rank(rank: int, src: Path, start: str, dp: int, ep: int, fsdp: str, ref, broken: str = "") -> None:
    import numpy as np

    from megaseq.train.checkpoint import base_fingerprint

    if broken == "one_mesh":
        base_fingerprint = _one_mesh_fingerprint
    cfg = _cfg(src, start, dp, ep, fsdp)
    env = DistributedEnv(cfg, spec=get_preset(PRESET))
    _break(env, broken)
    model = _build(cfg, env)
    params = dict(model.named_parameters())
    trains = {n for n, p in params.items() if p.requires_grad}
    factors = {n for n in trains if ".experts.lora_" in n}
    assert factors and all(is_adapter(n) or n.endswith("post_attention_layernorm.weight") for n in trains)
    assert all(p.to_local().shape[0] * ep == p.shape[0] for n, p in params.items() if n in factors)
    assert not any(is_sharded(params[n]) for n in trains - factors)  # the other trained tensors are whole
    if fsdp != "off":
        assert all(is_sharded(p) for n, p in params.items() if n not in trains)  # the frozen base is sharded
    # what a checkpoint records of the frozen base (its shards over FSDP's and the experts' meshes, summed)
    np.testing.assert_allclose(base_fingerprint(model), ref[3], rtol=1e-12)
    _, grads, final = assert_steps_match(model, env, MemorySettings(), cfg, ref[:3], trains)
    if rank == 0:
        _, ref_grads, ref_params, _ = ref
        print(f"\n{start}.init_from ep {ep} dp {dp} fsdp {fsdp}: max rel err step-0 grads "
              f"{max_rel_err(grads[0], ref_grads[0]):.1e}, parameters after step {STEPS} "
              f"{max_rel_err(final, ref_params):.1e}")
    env.shutdown()


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("dp, fsdp", [(1, "off"), (2, "dp")])
def test_lora_init_from_under_ep_matches_one_process(src, lora_ref, dp, fsdp):
    spawn_local(_rank, dp * 2, args=(src, "lora", dp, 2, fsdp, lora_ref))


@pytest.mark.parametrize("dp, fsdp", [(1, "off"), pytest.param(2, "dp", marks=pytest.mark.slow)])
def test_adapters_drawn_on_model_init_from_under_ep_match_one_process(src, model_ref, dp, fsdp):
    spawn_local(_rank, dp * 2, args=(src, "model", dp, 2, fsdp, model_ref))


def test_expert_factors_loaded_from_the_wrong_rows_fail(src, lora_ref):
    with pytest.raises(Exception, match=r"AssertionError: \(0, "):  # step 0's loss differs
        spawn_local(_rank, 2, args=(src, "lora", 1, 2, "off", lora_ref, "first_rows"))


@pytest.mark.parametrize("dp, fsdp", [(1, "off"), pytest.param(2, "dp", marks=pytest.mark.slow)])
def test_adapters_drawn_differently_on_one_rank_fail(src, model_ref, dp, fsdp):
    """B is zero at the start (step 0's loss is right); A, drawn differently, shows in B's first gradient."""
    with pytest.raises(Exception, match=r"step 0 grad .*lora_B"):
        spawn_local(_rank, dp * 2, args=(src, "model", dp, 2, fsdp, model_ref, "redrawn"))


# ---- through the trainer: ``megaseq train`` on ep 2 x dp 2 with FSDP, from model.init_from ----------------------
def _run_overrides(src: Path, run: str, ep: int, batch: int, steps: int = STEPS) -> dict:
    from lora_parallel_checks import lora_run_overrides

    mesh = {"parallel.ep": 2, "parallel.dp": 2, "parallel.fsdp": "dp", **LLEP} if ep > 1 else {}
    return lora_run_overrides(src, run, 1, batch, **{**mesh, "model.init_from": str(src / "hf"), "train.steps": steps,
                                                     "train.save_every": 1, "optim.grad_clip": 0.05})


def _train_rank(rank: int, overrides: dict, broken: str = "") -> None:
    from lora_parallel_checks import train_rank

    if broken == "unreduced":  # the replicated gradients (attention factors, norms) and the experts' not summed
        DistributedEnv.reduce_gradients = lambda self, model: None
    train_rank(rank, overrides)


def _assert_runs_match(got: Path, want: Path, steps: int) -> None:
    """Each step's loss and gradient norm (1e-10), every tensor of each step's checkpoint (the trained ones; the
    base made again from model.init_from), the PEFT adapter and the merged HF export."""
    import json

    from test_ep_train import _assert_same, _weights

    from lora_parallel_checks import assert_exports_match
    from megaseq.train import checkpoint as ckpt

    def records(run: Path) -> list[dict]:
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    assert len(records(got)) == len(records(want)) == steps
    for g, w in zip(records(got), records(want)):
        assert w["grad_norm"] > 0.1  # clipped at 0.05
        for key in ("loss", "grad_norm"):
            assert abs(g[key] - w[key]) <= 1e-10 * abs(w[key]), (f"step {w['step']} {key}", g[key], w[key])
    for step in range(1, steps + 1):
        d = f"{ckpt.CKPT_DIR}/step_{step:06d}"
        _assert_same(_weights(got / d), _weights(want / d))
    assert_exports_match(got, want)


@pytest.fixture(scope="module")
def one_run(src) -> Path:
    from test_ep_train import _fasta

    from lora_parallel_checks import train_rank

    _fasta(src / "g.fa")
    train_rank(0, _run_overrides(src, "one", 1, 4))  # the 4 ranks' sequences in one batch
    return src / "one"


@pytest.mark.slow  # make test-all; test_lora_ep.py's trainer run on ep 2 stays in make test
def test_lora_ep_fsdp_run_from_model_init_from_matches_one_process(src, one_run):
    spawn_local(_train_rank, 4, args=(_run_overrides(src, "epf", 2, 1),))
    _assert_runs_match(src / "epf", one_run, STEPS)


@pytest.mark.slow  # make test-all; test_lora_ep.py's trainer run on ep 2 stays in make test
def test_lora_ep_fsdp_run_without_the_gradient_reduction_fails(src, one_run):
    spawn_local(_train_rank, 4, args=(_run_overrides(src, "unreduced", 2, 1), "unreduced"))
    with pytest.raises(AssertionError, match="step 1 grad_norm"):  # each rank's own gradients
        _assert_runs_match(src / "unreduced", one_run, STEPS)


def test_fingerprint_summed_over_one_mesh_fails(src, lora_ref):
    """ep 2 x dp 2 with FSDP: the experts' slices summed over FSDP's mesh (every rank) count each twice."""
    with pytest.raises(Exception, match="Not equal to tolerance"):
        spawn_local(_rank, 4, args=(src, "lora", 2, 2, "dp", lora_ref, "one_mesh"))

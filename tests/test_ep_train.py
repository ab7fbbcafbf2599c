"""Expert parallelism through the trainer (``megaseq train --parallel.ep 2`` in gloo processes, float64):
qwen3-moe-tiny (8 experts, top 2) on 2 ranks, each holding 4 experts (DTensors ``Shard(0)`` over the ep
axis) and reading its own sequence, against one process reading both sequences per step (batch 2).

- two clipped AdamW steps (the norm well above ``optim.grad_clip``, so every step is clipped) give the
  one-process losses, gradient norms and every parameter (gathered from the sharded checkpoint), 1e-10;
- the step-1 checkpoint holds every expert once, as two ``[4, ...]`` shards of the ``[8, ...]`` tensor (the
  weights and AdamW's moments); resumed on ep 2 it continues exactly as the uninterrupted run, and resumed
  on one process (DCP reshards the experts) it continues as the one-process run;
- the HF export gathers the experts whole: it equals the one-process run's export and gives transformers'
  logits of the final weights.

Broken variants that must fail: experts left as plain per-rank tensors (the code before the DTensors: the
checkpoint then holds one rank's 4 experts under the name of all 8), and clipping with the norm of each
rank's own gradients (the other rank's experts unseen)."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import torch_threads
from megaseq.config import build_config
from megaseq.parallel.launch import spawn_local
from megaseq.train import checkpoint as ckpt

STEPS = 2
CLIP = 0.05
TOL = dict(rtol=1e-10, atol=1e-12)
E = 8  # qwen3-moe-tiny's experts
EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


def _fasta(path: Path) -> Path:
    rng = np.random.default_rng(16)
    path.write_text(">rec\n" + "".join(rng.choice(list("ACGT"), 4000)) + "\n")
    return path


def _overrides(tmp: Path, run: str, ep: int, batch: int, steps: int = STEPS, **extra) -> dict:
    # ep 2: LLEP in chunks of 8 tokens, so experts' weights travel between the ranks
    llep = {"parallel.ep_chunk_tokens": 8, "parallel.ep_max_chunks": 4, "parallel.llep_min_tokens": 2}
    return {"model.name": "qwen3-moe-tiny", "model.dtype": "fp64", "data.train": [str(tmp / "g.fa")],
            "data.seq_len": 32, "data.heldout_tail": 0, "train.steps": steps, "train.batch_size": batch,
            "train.save_every": 1, "train.keep_checkpoints": 10, "train.run_dir": str(tmp / run),
            "train.eval_after": False, "train.export_hf": False, "train.device": "cpu",
            "optim.lr": 3e-3, "optim.warmup_steps": 0, "optim.grad_clip": CLIP, "log.progress": False,
            "log.tensorboard": False, "parallel.ep": ep, "parallel.backend": "gloo",
            **(llep if ep > 1 else {}), **extra}


def _train_rank(rank: int, overrides: dict, broken: str | None = None) -> None:
    from megaseq.train.trainer import run_training

    torch.set_num_threads(1)
    if broken == "plain_experts":  # the code before: each rank's experts a plain tensor under the full name
        import megaseq.parallel.expert as expert

        expert._as_ep_dtensor = lambda part, *args: part
    elif broken == "local_norm":  # each rank clips with the norm of its own gradients
        import megaseq.memory.master_adam as master_adam

        master_adam._shard_groups = lambda t: []
    run_training(build_config(overrides=overrides))


def _one_process(overrides: dict) -> None:
    with torch_threads(1):
        _train_rank(0, overrides)


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    """Every parameter of a checkpoint (a run's newest, or a step directory), read into one process."""
    from megaseq.train.convert import load_megaseq_checkpoint

    with torch_threads(1):
        model, _, _ = load_megaseq_checkpoint(path, dtype=torch.float64)
    return {n: t.detach() for n, t in model.state_dict().items()}


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, **TOL, msg=lambda m, name=name: f"{name}: {m}")


def _stored(step_dir: Path) -> dict[str, object]:
    """DCP's metadata of a checkpoint: every saved tensor's global size and its chunks."""
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata


def assert_every_expert_saved_once(step_dir: Path) -> None:
    """Each expert tensor (weights and AdamW moments) is stored at its full ``[E, ...]`` size, as the two ranks'
    ``[E / 2, ...]`` shards, which tile it."""
    stored = _stored(step_dir)
    names = [k for k in stored if k.endswith(EXPERTS) or k.endswith(tuple(f"{e}.{m}" for e in EXPERTS
                                                                           for m in ("exp_avg", "exp_avg_sq")))]
    assert len(names) == 3 * 2 * 4, names  # (weight, exp_avg, exp_avg_sq) x 2 tensors x 4 layers
    for key in names:
        md = stored[key]
        assert md.size[0] == E, f"{key}: stored as {list(md.size)}, not the {E} experts"
        rows = sorted((c.offsets[0], c.sizes[0]) for c in md.chunks)
        assert rows == [(0, E // 2), (E // 2, E // 2)], f"{key}: chunks {rows}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ep_train")
    _fasta(tmp / "g.fa")
    spawn_local(_train_rank, 2, args=(_overrides(tmp, "ep2", 2, 1, **{"train.export_hf": True}),))
    _one_process(_overrides(tmp, "one", 1, 2, **{"train.export_hf": True}))
    return tmp


pytestmark = pytest.mark.usefixtures("one_thread")


def test_two_clipped_steps_equal_one_process(runs):
    got, want = _records(runs / "ep2"), _records(runs / "one")
    assert len(got) == len(want) == STEPS
    for g, w in zip(got, want):
        assert w["grad_norm"] > 2 * CLIP  # the step was clipped
        assert abs(g["loss"] - w["loss"]) <= 1e-10 * abs(w["loss"]), (g["loss"], w["loss"])
        assert abs(g["grad_norm"] - w["grad_norm"]) <= 1e-10 * w["grad_norm"], (g["grad_norm"], w["grad_norm"])
    for step in (1, 2):  # every parameter, the experts gathered from both ranks' shards
        d = f"{ckpt.CKPT_DIR}/step_{step:06d}"
        _assert_same(_weights(runs / "ep2" / d), _weights(runs / "one" / d))


def test_checkpoint_holds_every_expert_once(runs):
    step1 = runs / "ep2" / ckpt.CKPT_DIR / "step_000001"
    assert len(list(step1.glob("*.distcp"))) == 2  # each rank wrote its shards
    assert_every_expert_saved_once(step1)


def test_plain_expert_tensors_lose_the_other_ranks_experts(runs):
    """The broken variant: experts left as plain tensors, the checkpoint holds one rank's 4 under the name
    of all 8 (and the weights read back are not the run's)."""
    spawn_local(_train_rank, 2, args=(_overrides(runs, "plain", 2, 1, steps=1), "plain_experts"))
    step1 = runs / "plain" / ckpt.CKPT_DIR / "step_000001"
    with pytest.raises(AssertionError, match="not the 8 experts"):
        assert_every_expert_saved_once(step1)


def test_local_clipping_norm_differs_from_one_process(runs):
    """The broken variant: each rank clips with its own gradients' norm (the other rank's experts unseen)."""
    spawn_local(_train_rank, 2, args=(_overrides(runs, "local_norm", 2, 1, steps=1), "local_norm"))
    got, want = _records(runs / "local_norm")[0], _records(runs / "one")[0]
    assert abs(got["grad_norm"] - want["grad_norm"]) > 1e-6 * want["grad_norm"]
    with pytest.raises(AssertionError):
        _assert_same(_weights(runs / "local_norm"), _weights(runs / "one" / ckpt.CKPT_DIR / "step_000001"))


def test_offloaded_optimizer_equals_one_process(runs):
    """OffloadStreamAdamW (``memory.optimizer_offload``) on ep 2: its norm sums the experts' squares over the
    ep group, so the two clipped steps are the one-process run's."""
    memory = {"memory.auto": False, "memory.optimizer_offload": True}
    spawn_local(_train_rank, 2, args=(_overrides(runs, "offload", 2, 1, **memory),))
    got, want = _records(runs / "offload"), _records(runs / "one")
    for g, w in zip(got, want):
        assert abs(g["loss"] - w["loss"]) <= 1e-10 * abs(w["loss"]), (g["loss"], w["loss"])
        assert abs(g["grad_norm"] - w["grad_norm"]) <= 1e-10 * w["grad_norm"], (g["grad_norm"], w["grad_norm"])
    _assert_same(_weights(runs / "offload"), _weights(runs / "one"))
    assert_every_expert_saved_once(runs / "offload" / ckpt.CKPT_DIR / "step_000002")


def _resume_from_step_1(tmp: Path, name: str) -> Path:
    """A copy of the ep-2 run with its step-2 checkpoint, its export and the metrics after step 1 removed."""
    run = tmp / name
    shutil.copytree(tmp / "ep2", run)
    shutil.rmtree(run / ckpt.CKPT_DIR / "step_000002")
    shutil.rmtree(run / "hf")
    lines = (run / "metrics.jsonl").read_text().splitlines()[:1]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run


@pytest.mark.parametrize("ep", [2, 1])
def test_resume_continues_the_run(runs, ep):
    """Step 1's checkpoint resumed on ep 2 equals the uninterrupted run; on one process (the experts
    resharded whole) it equals the one-process run, which read the same two sequences per step."""
    run = _resume_from_step_1(runs, f"resumed_ep{ep}")
    overrides = _overrides(runs, run.name, ep, 3 - ep, **{"train.resume": True})
    if ep == 2:
        spawn_local(_train_rank, 2, args=(overrides,))
    else:
        _one_process(overrides)
    got, want = _records(run), _records(runs / "ep2")
    assert [r["step"] for r in got] == [1, 2]
    assert abs(got[1]["loss"] - want[1]["loss"]) <= 1e-10 * abs(want[1]["loss"]), (got[1]["loss"], want[1]["loss"])
    _assert_same(_weights(run), _weights(runs / "ep2"))


def test_hf_export_gathers_the_experts(runs):
    """The ep-2 export equals the one-process export tensor by tensor and gives transformers' logits."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from test_moe import promote_hf_routers_

    def tensors(d: Path) -> dict[str, torch.Tensor]:
        return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}

    got, want = tensors(runs / "ep2" / "hf"), tensors(runs / "one" / "hf")
    assert got.keys() == want.keys() and any(".experts." in k for k in got)
    _assert_same(got, want)
    from megaseq.train.convert import load_megaseq_checkpoint

    ours, _, _ = load_megaseq_checkpoint(runs / "ep2", dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_pretrained(runs / "ep2" / "hf", dtype=torch.float64)
    hf.config._experts_implementation = "eager"
    hf.config._attn_implementation = "eager"
    promote_hf_routers_(hf)
    ids = torch.randint(1, 5, (1, 29), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(ours.logits(ours(ids)), hf.eval()(input_ids=ids).logits, rtol=1e-10, atol=1e-12)

"""Expert parallelism through the trainer (``megaseq train --parallel.ep 2`` in gloo processes, float64):
qwen3-moe-tiny (8 experts, top 2) on 2 ranks, each holding 4 experts (DTensors ``Shard(0)`` over the ep
axis) and reading its own sequence, against one process reading both sequences per step (batch 2).

- two clipped AdamW steps (the norm well above ``optim.grad_clip``, so every step is clipped) give the
  one-process losses, gradient norms and every parameter (gathered from the sharded checkpoint), 1e-10;
- the step-1 checkpoint holds every expert once, as two ``[4, ...]`` shards of the ``[8, ...]`` tensor (the
  weights and AdamW's moments); resumed on ep 2 it continues exactly as the uninterrupted run, and resumed
  on one process (DCP reshards the experts) it continues as the one-process run;
- the HF export gathers the experts whole: it equals the one-process run's export and gives transformers'
  logits of the final weights;
- OffloadStreamAdamW on ep 2 and a dp 2 x ep 2 run (each slice on two ranks, written once) likewise;
- the trainer's ``train_step`` with MasterAdamW (fp64 masters) accumulating two micro-batches on dp 2 x ep 2,
  and ``make_optimizer``'s AdamW foreach and fused over the experts and the whole parameters.

Broken variants that must fail: experts left as plain per-rank tensors (the code before the DTensors: the
checkpoint then holds one rank's 4 experts under the name of all 8), clipping with the norm of each rank's
own gradients (the other rank's experts unseen), MasterAdamW folding the experts' gradients in the backward
(before their dp reduction), torch's foreach AdamW over groups mixing DTensors and tensors."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import run_as_of_step, torch_threads
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


def test_dp_and_ep_step_and_checkpoint_equal_one_process(runs):
    """dp 2 x ep 2 (4 ranks, each expert slice on 2 of them): one clipped step equals one process reading the
    4 sequences; the checkpoint still holds each expert slice once (DCP writes a replicated shard once)."""
    spawn_local(_train_rank, 4, args=(_overrides(runs, "dp2ep2", 2, 1, steps=1, **{"parallel.dp": 2}),))
    _one_process(_overrides(runs, "one4", 1, 4, steps=1))
    got, want = _records(runs / "dp2ep2")[0], _records(runs / "one4")[0]
    assert want["grad_norm"] > 2 * CLIP
    assert abs(got["loss"] - want["loss"]) <= 1e-10 * abs(want["loss"]), (got["loss"], want["loss"])
    assert abs(got["grad_norm"] - want["grad_norm"]) <= 1e-10 * want["grad_norm"], (got["grad_norm"], want["grad_norm"])
    _assert_same(_weights(runs / "dp2ep2"), _weights(runs / "one4"))
    assert_every_expert_saved_once(runs / "dp2ep2" / ckpt.CKPT_DIR / "step_000001")


# ---- MasterAdamW (model.weights bf16's optimizer) on dp 2 x ep 2, accumulating two micro-batches ------------
def _sequences(n: int) -> torch.Tensor:
    return torch.randint(0, 16, (n, 32), generator=torch.Generator().manual_seed(7))


def _master_reference() -> tuple[float, dict[str, torch.Tensor]]:
    """One process, all 8 sequences at once: the clipped AdamW step's gradient norm and parameters."""
    from megaseq.models.build import build_model
    from megaseq.models.presets import get_preset
    from megaseq.ops.vocab_loss.reference import plain_linear_cross_entropy
    from megaseq.parallel.mesh import complete_batch

    model = build_model(get_preset("qwen3-moe-tiny"), dtype=torch.float64, seed=0)
    batch = complete_batch({"input_ids": _sequences(8)})
    hidden = model(batch["input_ids"])
    labels = batch["labels"].reshape(-1)
    loss = plain_linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), model.lm_head.weight, labels,
                                      reduction="sum") / int((labels != -100).sum())
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(list(model.parameters()), CLIP))
    torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0, foreach=False).step()
    return norm, {n: p.detach().clone() for n, p in model.named_parameters()}


def _master_rank(rank: int, ref: tuple, broken: bool) -> None:
    """dp 2 x ep 2: data rank ``rank`` reads sequences ``rank`` and ``rank + 4`` as two micro-batches, the
    trainer's ``train_step`` with MasterAdamW (fp64 weights: fp64 masters, so exact) accumulating them."""
    from megaseq.config import MemorySettings
    from megaseq.memory.master_adam import MasterAdamW, complete_in_backward, is_dtensor
    from megaseq.models.build import build_model
    from megaseq.models.presets import get_preset
    from megaseq.models.registry import parallelize
    from megaseq.parallel.env import DistributedEnv
    from megaseq.train.step import StepState, train_step

    torch.set_num_threads(1)
    cfg = build_config(overrides={"model.name": "qwen3-moe-tiny", "parallel.dp": 2, "parallel.ep": 2,
                                  "parallel.backend": "gloo", "data.seq_len": 32, "train.device": "cpu",
                                  "optim.grad_clip": CLIP, "train.grad_accum": 2})
    env = DistributedEnv(cfg)
    model = build_model(get_preset("qwen3-moe-tiny"), dtype=torch.float64, seed=0)
    parallelize(model, MemorySettings(), env)
    # the broken variant: every DTensor folded in the backward (as FSDP's shards), before the experts'
    # gradients are summed over the dp ranks holding them
    opt = MasterAdamW(model.parameters(), lr=3e-3, weight_decay=0.0, foreach=False, accumulate=True,
                      foldable=is_dtensor if broken else complete_in_backward)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ids = _sequences(8)
    micro = [env.shard_batch({"input_ids": ids[i:i + 1]}) for i in (env.dp_rank, env.dp_rank + 4)]
    _, norm = train_step(StepState.of(cfg, model, opt, sched, env, MemorySettings()), micro)
    ref_norm, ref_params = ref
    assert abs(norm - ref_norm) <= 1e-10 * ref_norm, (norm, ref_norm)
    for n, p in model.named_parameters():
        got = p.detach().full_tensor() if is_dtensor(p) else p.detach()
        torch.testing.assert_close(got, ref_params[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")
    env.shutdown()


@pytest.fixture(scope="module")
def master_reference():
    return _master_reference()


def test_master_adamw_accumulating_on_dp_and_ep_equals_one_process(master_reference):
    spawn_local(_master_rank, 4, args=(master_reference, False))


def test_master_adamw_folding_experts_in_the_backward_fails(master_reference):
    """The broken variant: the experts' gradients taken by the fold hook before the dp reduction."""
    with pytest.raises(Exception, match=r"AssertionError: \([\d.]+, [\d.]+\)"):  # the gradient norm differs
        spawn_local(_master_rank, 4, args=(master_reference, True))


# ---- torch's AdamW, foreach and fused, over experts (DTensors) and whole parameters -----------------------
def _adamw_rank(rank: int) -> None:
    """ep 2, one backward: ``make_optimizer``'s AdamW (``SplitAdamW``: the groups mix DTensors and whole
    tensors) foreach and fused give the single-tensor step's parameters; torch's AdamW refuses the mix."""
    from megaseq.config import MemorySettings
    from megaseq.memory.apply import make_optimizer
    from megaseq.memory.master_adam import SplitAdamW, is_dtensor
    from megaseq.models.build import build_model
    from megaseq.models.presets import get_preset
    from megaseq.models.registry import parallelize
    from megaseq.parallel.env import DistributedEnv
    from megaseq.train.optim import param_groups

    torch.set_num_threads(1)
    cfg = build_config(overrides={"model.name": "qwen3-moe-tiny", "parallel.ep": 2, "parallel.backend": "gloo",
                                  "data.seq_len": 32, "train.device": "cpu"})
    env = DistributedEnv(cfg)
    after = {}
    for kind in ("single", "foreach", "fused", "torch_foreach"):
        model = build_model(get_preset("qwen3-moe-tiny"), dtype=torch.float64, seed=0)
        parallelize(model, MemorySettings(), env)
        groups = param_groups(model, 0.1)
        if kind == "single":
            opt = make_optimizer(groups, MemorySettings(), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
            assert isinstance(opt, SplitAdamW)
        elif kind == "torch_foreach":
            opt = torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
        else:
            opt = SplitAdamW(groups, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, **{kind: True})
        batch = env.shard_batch({"input_ids": _sequences(2)[env.dp_rank:env.dp_rank + 1]})
        model(batch["input_ids"]).square().mean().backward()
        env.reduce_gradients(model)
        if kind == "torch_foreach":
            with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
                opt.step()
            continue
        opt.step()
        after[kind] = {n: (p.to_local() if is_dtensor(p) else p).detach().clone() for n, p in model.named_parameters()}
        assert len(opt.state_dict()["param_groups"]) == 2  # the groups as built (decay, no decay)
    for kind in ("foreach", "fused"):
        _assert_same(after[kind], after["single"])
    env.shutdown()


def test_torch_adamw_foreach_and_fused_over_experts_and_whole_parameters():
    spawn_local(_adamw_rank, 2)


def _resume_from_step_1(tmp: Path, name: str) -> Path:
    """A copy of the ep-2 run with its step-2 checkpoint, its export and the metrics after step 1 removed."""
    return run_as_of_step(tmp / "ep2", tmp / name, 1)


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

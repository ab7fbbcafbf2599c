"""FSDP2 (``parallel.fsdp``) over gloo processes, float64: two clipped AdamW steps of glm5-flash-tiny (KDA +
DSA + mHC + MoE) equal the one-process steps on the whole batch: the loss, every gradient (gathered from
the shards) and every parameter after the second step: the first step's gradients to 1e-12 (+ 1e-10 relative),
the second's and the parameters to 1e-9 (``LATER_TOL``: what near-ties make of the first update's rounding).
Meshes: dp (FSDP over dp), dp x cp with FSDP over dp (the shards replicated over cp: HSDP) and fully sharded
(FSDP over dp x cp), on 2, 4 and 8 ranks, with and without sequence segments. The trainer's own step runs
(``train.step.train_step``): Ulysses + gather-KV CP, Ring-DTP, the global token count, the gradient
reduction, the clip.

Broken variants that must fail: one block's gradient not reduce-scattered
(``set_requires_gradient_sync(False)``), and a forward prefetch of the wrong block (the all-gather of block
i + 2 issued where i + 1's should be), caught by the trace of gathers against the blocks' compute.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.tensor  # noqa: F401  assert_close imports it lazily: once here, not in each fork

from conftest import torch_threads
from megaseq.config import MemorySettings, build_config
from megaseq.models.build import build_model
from megaseq.models.presets import get_preset
from megaseq.models.registry import parallelize
from megaseq.parallel.env import DistributedEnv, ParallelEnv
from megaseq.parallel.launch import spawn_local
from megaseq.parallel.mesh import complete_batch

S, NUM_SEQS, STEPS = 32, 8, 2
TOL = dict(atol=1e-12, rtol=1e-10)
# after the first update: the two runs' parameters differ by the first step's float64 rounding (1e-17), and
# (most likely) discrete choices at near-ties (the indexer's top-k, the MoE's routing) amplify that in a few elements
# (on one 2-core Xeon: one embedding element off by 1.6e-11 at step 1, every step-0 gradient within 5e-17). A
# wrong reduction or clip is off by far more at step 0, which TOL checks.
LATER_TOL = dict(atol=1e-9, rtol=1e-7)
LR, CLIP = 3e-3, 0.5


def global_batch(step: int) -> dict[str, torch.Tensor]:
    """Packed documents across shard boundaries, ignored labels in one shard: ranks hold unequal counts."""
    g = torch.Generator().manual_seed(7 + step)
    ids = torch.randint(1, 16, (NUM_SEQS, S), generator=g)
    doc = torch.zeros(NUM_SEQS, S, dtype=torch.long)
    for b in range(NUM_SEQS):
        for cut in torch.randint(3, S - 3, (2,), generator=g).tolist():
            doc[b, cut:] += 1
    batch = complete_batch({"input_ids": ids, "doc_ids": doc})
    batch["labels"][:, 1:5] = -100
    return batch


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class RecordingAdamW(torch.optim.AdamW):
    """torch's AdamW (float64, foreach off) that keeps every gradient (gathered) before it is clipped."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.names = {p: n for n, p in model.named_parameters()}
        super().__init__(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
        self.grads: list[dict[str, torch.Tensor]] = []

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        from megaseq.memory.master_adam import clip_grad_norm_

        params = [p for g in self.param_groups for p in g["params"]]
        self.grads.append({self.names[p]: _full(p.grad).clone() for p in params if p.grad is not None})
        return clip_grad_norm_(params, max_norm)


def run_steps(model, env, memory: MemorySettings, cfg, steps: int = STEPS) -> tuple[list[float], list[dict], dict]:
    from megaseq.train.step import StepState, train_step

    opt = RecordingAdamW(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    losses = []
    for step in range(steps):
        full, per_dp = global_batch(step), NUM_SEQS // env.dp_size
        mine = {k: v[env.dp_rank * per_dp:(env.dp_rank + 1) * per_dp] for k, v in full.items()}
        batch = env.shard_batch(mine if env.reads_data else None, memory.model_segment_tokens)
        loss, _ = train_step(StepState.of(cfg, model, opt, sched, env, memory), [batch])
        losses.append(loss)
    params = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
    return losses, opt.grads, params


def _cfg(dp: int = 1, cp: int = 1, fsdp: str = "off", segment: int = 0):
    return build_config(overrides={"parallel.dp": dp, "parallel.cp": cp, "parallel.backend": "gloo",
                                   "parallel.fsdp": fsdp, "parallel.loss_parallel": "ring_dtp",
                                   "data.seq_len": S, "train.device": "cpu", "optim.grad_clip": CLIP})


def _collect_without_cache_grads(collect):
    def broken(self) -> None:
        self.leaves = [leaf for leaf in self.leaves if leaf[0] != "cache"]
        collect(self)
    return broken


def _count_segmented_runs() -> list[int]:
    """Counts ``segmented_loss_backward`` calls from now on in this process (a fork: no restore needed)."""
    from megaseq.memory import model_segments

    runs, orig = [], model_segments.segmented_loss_backward

    def counted(*args, **kw):
        runs.append(1)
        return orig(*args, **kw)

    model_segments.segmented_loss_backward = counted
    return runs


def reference(preset: str = "glm5-flash-tiny") -> tuple[list[float], list[dict], dict]:
    cfg = _cfg()
    model = build_model(get_preset(preset), dtype=torch.float64, seed=0)
    return run_steps(model, ParallelEnv(), MemorySettings(), cfg)


def _rank(rank: int, dp: int, cp: int, fsdp: str, segment: int, broken: str, ref,
          preset: str = "glm5-flash-tiny") -> None:
    cfg = _cfg(dp, cp, fsdp, segment)
    env = DistributedEnv(cfg)
    model = build_model(get_preset(preset), dtype=torch.float64, seed=0)
    memory = MemorySettings(model_segment_tokens=segment)
    applied = parallelize(model, memory, env)
    assert applied.sharded is not None and len(applied.sharded.blocks) == 1 + len(model.layers)  # + embedding
    if broken == "unreduced":
        applied.sharded.blocks[3].set_requires_gradient_sync(False)
    if broken == "partial_latents":  # the earlier segments' latents never get their gradient
        from megaseq.memory import model_segments

        model_segments.SegmentContext.collect = _collect_without_cache_grads(model_segments.SegmentContext.collect)
    runs = _count_segmented_runs()
    steps = 1 if broken else STEPS  # a broken variant must already fail on the first step's gradients
    losses, grads, params = run_steps(model, env, memory, cfg, steps)
    assert len(runs) == (steps if segment else 0)  # the micro-batch really ran in segments
    ref_losses, ref_grads, ref_params = ref
    for k in range(steps):
        assert abs(losses[k] - ref_losses[k]) < 1e-12 * abs(ref_losses[k]), (k, losses[k], ref_losses[k])
        assert grads[k].keys() == ref_grads[k].keys()
        for n, g in grads[k].items():
            torch.testing.assert_close(g, ref_grads[k][n], **(LATER_TOL if k else TOL),
                                       msg=lambda m, n=n, k=k: f"step {k} grad {n}: {m}")
    assert steps == STEPS, "the broken variant was not caught"
    for n, p in params.items():
        torch.testing.assert_close(p, ref_params[n], **LATER_TOL, msg=lambda m, n=n: f"{n}: {m}")
    env.shutdown()


@pytest.fixture(scope="module")
def ref():
    with torch_threads(1):
        yield reference()


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("dp, cp, fsdp, segment", [
    (2, 1, "dp", 12),  # 2 ranks, segments of 12, 12 and 8 tokens
    (1, 2, "dp_cp", 8),
    (2, 2, "dp", 0),  # 4 ranks: HSDP (sharded over dp, replicated over cp)
    # the rest under `make test-all` (-m slow), 2 to 8 ranks on a 2-core CI machine. The default run keeps
    # the plain step sharded over dp in HSDP (above: 4 ranks, FSDP over dp), cp 4 without FSDP
    # (test_parallel_train_step, test_parallel_dsa), fully sharded dp x cp over 4 ranks with qwen3-moe-tiny
    # (below) and fully sharded with segments under cp with cp 2 (above)
    pytest.param(2, 1, "dp", 0, marks=pytest.mark.slow),
    pytest.param(1, 4, "dp_cp", 16, marks=pytest.mark.slow),
    pytest.param(2, 2, "dp", 8, marks=pytest.mark.slow),
    pytest.param(8, 1, "dp", 8, marks=pytest.mark.slow),  # 8 ranks
    pytest.param(4, 2, "dp", 0, marks=pytest.mark.slow),
    pytest.param(2, 4, "dp_cp", 8, marks=pytest.mark.slow),
])
def test_fsdp_steps_match_one_process(dp, cp, fsdp, segment, ref):
    spawn_local(_rank, dp * cp, args=(dp, cp, fsdp, segment, "", ref))


def test_qwen3_moe_under_fsdp_matches_one_process():
    """The second family (softmax attention with GQA under Ulysses, its own parallelize): fully sharded."""
    with torch_threads(1):
        ref = reference("qwen3-moe-tiny")
    spawn_local(_rank, 4, args=(2, 2, "dp_cp", 0, "", ref, "qwen3-moe-tiny"))


def test_a_block_whose_gradient_is_not_reduced_fails(ref):
    with pytest.raises(Exception, match=r"layers\.2\."):  # blocks[3]: the embedding is blocks[0]
        spawn_local(_rank, 2, args=(2, 1, "dp", 0, "unreduced", ref))


def test_segments_under_cp_that_drop_the_latent_gradient_of_earlier_segments_fail(ref):
    """The DSA latents of earlier segments get their gradient from later segments' queries; dropping it (the
    cache gradient never reaching the gathered segment's reduce-scatter) must fail."""
    with pytest.raises(Exception, match="step 0 grad"):
        spawn_local(_rank, 2, args=(1, 2, "dp_cp", 8, "partial_latents", ref))


# ---- the prefetch: which blocks are gathered while each block computes ---------------------------------
class GatherTrace:
    """Records FSDP's all-gathers and frees (by module name) and each block's compute, forward and backward,
    in the order they happen; ``check`` asserts the planner's picture: while block i runs, block i + 1
    (forward; i - 1 in backward) is already gathered, and no other block is."""

    def __init__(self, model: torch.nn.Module, blocks: list[torch.nn.Module], monkeypatch_target) -> None:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        self.events: list[tuple[str, int]] = []
        self.index = {id(b): i for i, b in enumerate(blocks)}
        trace, orig_unshard, orig_reshard = self, FSDPParamGroup.unshard, FSDPParamGroup.reshard

        def unshard(group, async_op=False):
            if group._all_gather_result is None and not group.is_unsharded:
                trace._log("gather", group)
            return orig_unshard(group, async_op)

        def reshard(group):
            was = group.is_unsharded
            orig_reshard(group)
            if was and not group.is_unsharded:
                trace._log("free", group)

        monkeypatch_target(FSDPParamGroup, unshard, reshard)
        for i, b in enumerate(blocks):
            b.register_forward_pre_hook(lambda m, a, i=i: self.events.append(("forward", i)))
            b.register_forward_hook(self._on_output(i))

    def _on_output(self, i: int):
        def hook(module, args, out) -> None:
            if out.requires_grad:  # runs after FSDP's pre-backward hook on the same tensor
                out.register_hook(lambda g: self.events.append(("backward", i)))
        return hook

    def _log(self, kind: str, group) -> None:
        i = next((self.index[id(m)] for m in group.modules if id(m) in self.index), None)
        if i is not None:
            self.events.append((kind, i))

    def check(self, num_blocks: int) -> None:
        gathered: set[int] = set()
        for kind, i in self.events:
            if kind == "gather":
                gathered.add(i)
            elif kind == "free":
                gathered.discard(i)
            else:
                nxt = i + 1 if kind == "forward" else i - 1
                want = {i} | ({nxt} if 0 <= nxt < num_blocks else set())
                assert gathered == want, f"{kind} of block {i}: gathered {sorted(gathered)}, want {sorted(want)}"


def _trace_rank(rank: int, broken: bool, segment: int = 0) -> None:
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    from megaseq.plan.flops import fsdp_passes
    from megaseq.train.step import StepState, train_step

    cfg = _cfg(2, 1, "dp")
    env = DistributedEnv(cfg)
    model = build_model(get_preset("glm5-flash-tiny"), dtype=torch.float64, seed=0)
    memory = MemorySettings(model_segment_tokens=segment)
    applied = parallelize(model, memory, env)
    blocks = applied.sharded.blocks
    if broken:  # block 2 prefetches block 4 instead of block 3
        blocks[2].set_modules_to_forward_prefetch([blocks[4]])

    def patch(cls, unshard, reshard):
        cls.unshard, cls.reshard = unshard, reshard

    trace = GatherTrace(model, blocks, patch)
    scatters: dict[int, int] = {}
    real_reduce = _fsdp_param_group.foreach_reduce

    def counted_reduce(fsdp_params, *a, **kw):  # one call per reduce-scatter of a group's gradients
        for i, b in enumerate(blocks):
            if any(fp in b._get_fsdp_state()._fsdp_param_group.fsdp_params for fp in fsdp_params[:1]):
                scatters[i] = scatters.get(i, 0) + 1
        return real_reduce(fsdp_params, *a, **kw)

    _fsdp_param_group.foreach_reduce = counted_reduce
    opt = RecordingAdamW(model)
    batch = env.shard_batch({k: v[rank:rank + 1] for k, v in global_batch(0).items()})
    train_step(StepState.of(cfg, model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), env, memory),
               [batch])
    if segment:  # what plan.flops.fsdp_passes counts: 3 gathers and 1 reduce-scatter of every block a segment
        gathers, want_scatters = fsdp_passes(-(-S // segment))
        for i in range(len(blocks)):
            assert sum(1 for k, j in trace.events if k == "gather" and j == i) == gathers, (i, trace.events)
            assert scatters.get(i) == want_scatters, (i, scatters)
        env.shutdown()
        return
    assert [scatters.get(i) for i in range(len(blocks))] == [1] * len(blocks)
    assert sum(k == "forward" for k, _ in trace.events) == len(blocks)
    assert sum(k == "backward" for k, _ in trace.events) == len(blocks)
    trace.check(len(blocks))
    env.shutdown()


def test_each_block_prefetches_the_next_ones_gather():
    spawn_local(_trace_rank, 2, args=(False,))


def test_a_segmented_step_gathers_and_reduces_each_block_as_the_plan_counts():
    """Each segment gathers every block 3 times (its no-grad forward, the rerun, the backward) and
    reduce-scatters it once: the per-segment cost the plan reports (``plan.flops.fsdp_passes``)."""
    spawn_local(_trace_rank, 2, args=(False, 12))


def test_a_prefetch_of_the_wrong_block_is_caught():
    with pytest.raises(Exception, match="forward of block 2: gathered"):
        spawn_local(_trace_rank, 2, args=(True,))

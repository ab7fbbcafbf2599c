"""A whole training step of glm5-flash-tiny (KDA + DSA + mHC + MoE; its first 4 layers, every kind once:
``conftest.glm5_tiny4``) with expert parallelism, float64, gloo: loss, every gradient and every parameter
after one clipped AdamW step equal the one-process step on the whole global batch, for ep 2 and 4, ep x cp
and ep with dp.

The experts are sharded and the dispatch installed by the family's ``parallelize`` (``env.shard_moe``);
each of the dp x ep ranks reads its own window of the lambda phage genome (shipped with megaseq), so the
routing is a real router's on real DNA. A second routing pushes every MoE layer's choice towards expert
0 (its ``e_score_correction_bias``, which moves the choice, not the weights): most rows then go to ep
rank 0's experts, and LLEP spills them (their weights travel, their gradients come back). Gradients are
reduced by the environment: replicated parameters over the world, experts over the ranks holding them;
the clipping norm adds the experts' squares over the ep group.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.tensor  # noqa: F401  assert_close imports it lazily: once here, not in each fork
from torch.distributed.tensor import DTensor

from conftest import glm5_tiny4, torch_threads
from megaseq.config import MemorySettings, OptimConfig, build_config
from megaseq.data.fasta import default_genome_path, read_fasta
from megaseq.models.build import build_model
from megaseq.models.registry import parallelize
from megaseq.parallel.env import DistributedEnv
from megaseq.parallel.launch import spawn_local
from megaseq.parallel.mesh import complete_batch

S = 32
OPTIM = OptimConfig(lr=3e-3, warmup_steps=0, weight_decay=0.1, grad_clip=0.5)
TOL = dict(atol=1e-12, rtol=1e-10)
EP_FLAGS = {"parallel.ep_chunk_tokens": 8, "parallel.ep_max_chunks": 4, "parallel.llep_min_tokens": 2}


def global_batch(num_seqs: int) -> dict[str, torch.Tensor]:
    """``num_seqs`` windows of the lambda phage genome, one per data rank, with ignored labels."""
    bases = torch.from_numpy(read_fasta(default_genome_path())[0].tokens.astype("int64"))
    ids = torch.stack([bases[5000 + 3001 * i: 5000 + 3001 * i + S] for i in range(num_seqs)])
    batch = complete_batch({"input_ids": ids})
    batch["labels"][:, 1:5] = -100  # ranks hold unequal numbers of labelled tokens
    return batch


def make_model(skew: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(glm5_tiny4(), dtype=torch.float64, seed=0)
    if skew:
        for layer, kind in zip(model.layers, model.spec.mlp_types):
            if kind == "moe":
                layer.mlp.gate.e_score_correction_bias[0] = 0.3
    return model


def adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=OPTIM.lr, betas=tuple(OPTIM.betas), eps=OPTIM.eps,
                             weight_decay=OPTIM.weight_decay, foreach=False)


def reference_step(num_seqs: int, skew: bool) -> tuple[float, float, dict, dict, float]:
    """One process, every sequence: loss, grad norm, gradients, parameters after the step, and the share
    of routed rows that went to experts 0..E/2-1 (what ep 2's rank 0 holds)."""
    from megaseq.ops.vocab_loss.reference import plain_linear_cross_entropy

    model = make_model(skew)
    opt = adamw(model)
    batch = global_batch(num_seqs)
    hidden = model(batch["input_ids"])
    loss = plain_linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), model.lm_head.weight,
                                      batch["labels"].reshape(-1))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    gnorm = float(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None],
                                                 OPTIM.grad_clip))
    opt.step()
    loads = sum(m.last_tokens_per_expert for m in model.modules() if hasattr(m, "last_tokens_per_expert"))
    low = float(loads[: len(loads) // 2].sum() / loads.sum())
    return float(loss.detach()), gnorm, grads, {n: p.detach().clone() for n, p in model.named_parameters()}, low


def _rank(rank: int, cases: list[tuple], refs: dict) -> None:
    """Every case ``(dp, ep, cp, mode, skew, memory)`` of this world size, one after the other in one process
    group (each case builds its own mesh groups over it)."""
    env = None
    for dp, ep, cp, mode, skew, memory in cases:
        try:
            env = _case(dp, ep, cp, mode, skew, memory, refs[(dp * ep, skew)])
        except AssertionError as e:
            raise AssertionError(f"dp {dp} x ep {ep} x cp {cp}, {mode}, skew={skew}, memory {memory}: {e}") from e
    env.shutdown()


def _case(dp: int, ep: int, cp: int, mode: str, skew: bool, memory: dict, ref: tuple) -> DistributedEnv:
    ref_loss, ref_norm, ref_grads, ref_params, _ = ref
    cfg = build_config(overrides={"parallel.dp": dp, "parallel.ep": ep, "parallel.cp": cp, "parallel.backend": "gloo",
                                  "parallel.loss_parallel": "ring_dtp", "parallel.ep_dispatch": mode,
                                  "data.seq_len": S, "train.device": "cpu", **EP_FLAGS})
    env = DistributedEnv(cfg, spec=glm5_tiny4())
    model = make_model(skew)
    settings = MemorySettings(**memory)
    parallelize(model, settings, env)
    opt = adamw(model)
    full = global_batch(dp * ep)
    mine = {k: v[env.dp_rank:env.dp_rank + 1] for k, v in full.items()}
    batch = env.shard_batch(mine if env.reads_data else None)
    total = env.all_reduce_count(int((batch["labels"] != -100).sum()))
    if settings.model_segment_tokens:  # the trainer's step over sequence segments
        from megaseq.train.step import _segmented_step

        loss_sum = _segmented_step(model, batch, env, None, None, settings.model_segment_tokens, total)
    else:
        hidden = model(batch["input_ids"], ctx=env.context(batch))
        loss_sum = env.loss_sum(hidden, model.lm_head.weight, batch["labels"])
        (loss_sum / total).backward()
    env.reduce_gradients(model)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    gnorm = float(env.clip_grad_norm([p for p in model.parameters() if p.grad is not None], OPTIM.grad_clip))
    opt.step()
    loss = env.all_reduce_sum(float(loss_sum.detach())) / total
    assert abs(loss - ref_loss) < 1e-12 * abs(ref_loss), (loss, ref_loss)
    assert abs(gnorm - ref_norm) < 1e-10 * ref_norm, (gnorm, ref_norm)
    assert grads.keys() == ref_grads.keys()
    for n, p in model.named_parameters():
        held = _held(model, n)
        assert held == slice(None) or isinstance(p, DTensor), n  # the experts are DTensors over the ep axis
        if n in grads:
            torch.testing.assert_close(_local(grads[n]), ref_grads[n][held], **TOL,
                                       msg=lambda m, n=n: f"grad {n}: {m}")
            if isinstance(grads[n], DTensor):  # and gathered: every rank's experts
                torch.testing.assert_close(grads[n].full_tensor(), ref_grads[n], **TOL)
        torch.testing.assert_close(_local(p.detach()), ref_params[n][held], **TOL, msg=lambda m, n=n: f"{n}: {m}")
    spilled = sum(layer.mlp.expert_dispatch.last["foreign_experts"] for layer, kind in
                  zip(model.layers, model.spec.mlp_types) if kind == "moe")
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, spilled)
    if mode == "plain":
        assert sum(out) == 0, out
    elif skew:
        assert sum(out) > 0, out  # the skewed routing makes LLEP move experts
    return env


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _held(model: torch.nn.Module, name: str) -> slice:
    """The rows of the reference tensor this rank holds (its experts, or all of it)."""
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        experts = model.get_submodule(name.rsplit(".", 1)[0])
        return slice(experts.held.start, experts.held.stop)
    return slice(None)


@pytest.fixture(scope="module")
def references():
    with torch_threads(1):
        yield {(n, skew): reference_step(n, skew) for n in (2, 4) for skew in (False, True)}


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


SCHEMES = {"tiled_mlp": True, "mlp_tile_tokens": 12, "recompute": True}  # tiles of 12 tokens: uneven chunks inside
CASES = {  # (dp, ep, cp, dispatch mode, skewed routing, memory settings), by world size
    2: [(1, 2, 1, "pipelined_llep", False, {}),
        (1, 2, 1, "pipelined_llep", True, SCHEMES),  # with the memory schemes: tiles inside recomputed layers
        (1, 2, 1, "pipelined_llep", True, {"model_segment_tokens": 16})],  # and sequence segments
    4: [(1, 4, 1, "pipelined_llep", True, {}),
        (1, 2, 2, "pipelined_llep", True, {}),  # ep x cp
        (2, 2, 1, "llep", True, {}),  # ep with dp
        (1, 2, 2, "plain", False, {})],
}


@pytest.mark.parametrize("world", sorted(CASES))
def test_step_matches_one_process(world, references):
    for dp, ep, _, _, skew, _ in CASES[world]:
        if skew:
            low = references[(dp * ep, skew)][4]
            assert low > 0.6, f"the skewed routing should favour the low experts, got {low:.2f}"
    spawn_local(_rank, world, args=(CASES[world], references))

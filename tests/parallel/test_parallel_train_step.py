"""A whole training step of glm5-flash-tiny (KDA + DSA + mHC + MoE; its first 4 layers, every kind once:
``conftest.glm5_tiny4``) over dp x cp gloo processes:
loss, and every parameter after one clipped AdamW step, equal the one-process step on the whole batch.

The reference is computed once in the parent (float64) and handed to the forked ranks. The global
batch has packed documents straddling the shard boundaries and ignored labels, so ranks hold
different numbers of labelled tokens: a loss divided by a local count would fail here.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.tensor  # noqa: F401  assert_close imports it lazily: once here, not in each fork

from conftest import glm5_tiny4, torch_threads
from megaseq.config import OptimConfig, build_config
from megaseq.models.build import build_model
from megaseq.parallel.env import DistributedEnv
from megaseq.parallel.launch import spawn_local
from megaseq.parallel.mesh import complete_batch

S, NUM_SEQS = 32, 2  # the global batch: 2 sequences, split over dp
OPTIM = OptimConfig(lr=3e-3, warmup_steps=0, weight_decay=0.1, grad_clip=0.5)
TOL = dict(atol=1e-12, rtol=1e-10)
# The sigmoid router computes its logits in float32 even in a float64 model (as HF does), so its
# weight gradient is a float32 sum whose order differs between one process and the shards (~1e-7 of
# its largest entry). AdamW's first step is g / (|g| + eps): an entry with |g| near eps turns that into
# up to ~1% of lr. Router gradients are compared at float32 precision, router weights after the step
# to 1% of lr; everything else is float64 end to end and compared tightly.
FP32_ROUTER = "mlp.gate.weight"
ROUTER_GRAD_RTOL = 1e-5  # of the gradient's largest entry
ROUTER_PARAM_TOL = dict(atol=1e-2 * OPTIM.lr, rtol=0.0)


def global_batch(num_seqs: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, 16, (num_seqs, S), generator=g)
    doc = torch.zeros(num_seqs, S, dtype=torch.long)
    for b in range(num_seqs):  # document ends at different places in each row, across shard boundaries
        for cut in torch.randint(3, S - 3, (2,), generator=g).tolist():
            doc[b, cut:] += 1
    batch = complete_batch({"input_ids": ids, "doc_ids": doc})
    batch["labels"][:, 1:5] = -100  # ignored tokens, all in the first shard: ranks hold unequal counts
    return batch


def adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=OPTIM.lr, betas=tuple(OPTIM.betas), eps=OPTIM.eps,
                             weight_decay=OPTIM.weight_decay, foreach=False)


def train_step(model, batch, env, optimizer) -> tuple[float, dict[str, torch.Tensor]]:
    """The trainer's step, small: global token count first, Ring-DTP / local loss, summed gradients."""
    total = env.all_reduce_count(int((batch["labels"] != -100).sum()))
    hidden = model(batch["input_ids"], ctx=env.context(batch))
    loss_sum = env.loss_sum(hidden, model.lm_head.weight, batch["labels"])
    (loss_sum / total).backward()
    env.reduce_gradients(model)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], OPTIM.grad_clip)
    optimizer.step()
    return env.all_reduce_sum(float(loss_sum.detach())) / total, grads


def reference_step(num_seqs: int) -> tuple[float, dict, dict]:
    """One process, the whole global batch: loss, gradients, and parameters after the step."""
    from megaseq.ops.vocab_loss.reference import plain_linear_cross_entropy

    torch.manual_seed(0)
    model = build_model(glm5_tiny4(), dtype=torch.float64, seed=0)
    opt = adamw(model)
    batch = global_batch(num_seqs)
    hidden = model(batch["input_ids"], doc_ids=batch["doc_ids"])
    loss = plain_linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), model.lm_head.weight,
                                      batch["labels"].reshape(-1))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], OPTIM.grad_clip)
    opt.step()
    return float(loss.detach()), grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _rank_step(rank: int, dp: int, cp: int, loss_parallel: str, ref_loss: float, ref_grads: dict,
               ref_params: dict) -> None:
    cfg = build_config(overrides={"parallel.dp": dp, "parallel.cp": cp, "parallel.backend": "gloo",
                                  "parallel.loss_parallel": loss_parallel, "data.seq_len": S,
                                  "train.device": "cpu"})
    env = DistributedEnv(cfg, spec=glm5_tiny4())
    assert env.uses_ring_dtp() == (cp > 1 and loss_parallel == "ring_dtp")
    torch.manual_seed(0)
    model = build_model(glm5_tiny4(), dtype=torch.float64, seed=0)
    opt = adamw(model)
    full, per_dp = global_batch(NUM_SEQS), NUM_SEQS // dp
    mine = {k: v[env.dp_rank * per_dp:(env.dp_rank + 1) * per_dp] for k, v in full.items()}
    batch = env.shard_batch(mine if env.reads_data else None)
    loss, grads = train_step(model, batch, env, opt)
    assert abs(loss - ref_loss) < 1e-12 * abs(ref_loss), (loss, ref_loss)
    assert grads.keys() == ref_grads.keys()  # the same parameters got a gradient (the indexer: none)
    for n, g in grads.items():
        router = dict(atol=ROUTER_GRAD_RTOL * float(ref_grads[n].abs().max()), rtol=0.0)
        tol = router if n.endswith(FP32_ROUTER) else TOL
        torch.testing.assert_close(g, ref_grads[n], **tol, msg=lambda m, n=n: f"grad {n}: {m}")
    for n, p in model.named_parameters():
        tol = ROUTER_PARAM_TOL if n.endswith(FP32_ROUTER) else TOL
        torch.testing.assert_close(p.detach(), ref_params[n], **tol, msg=lambda m, n=n: f"{n}: {m}")
    env.shutdown()


@pytest.fixture(scope="module")
def reference():
    with torch_threads(1):
        yield reference_step(NUM_SEQS)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.mark.parametrize("dp, cp, loss_parallel", [
    (1, 2, "ring_dtp"),
    (2, 2, "ring_dtp"),
    (1, 4, "local"),
])
def test_train_step_matches_one_process(dp, cp, loss_parallel, reference):
    spawn_local(_rank_step, dp * cp, args=(dp, cp, loss_parallel, *reference))

"""The planner's side of a frozen base streamed from pinned host memory (``memory.stream_base``,
``memory/stream_base.py``): its bytes on the host and on the GPU, and its copy time against the compute.

Pure Python. With a frozen base (LoRA, ``train.trainable``) the decoder layers' frozen weights leave the GPU:

- host, per GPU: every layer's frozen bytes (``W_i``), pinned; under FSDP this rank's shards (``W_i / shard``);
  one process streams each layer's fp32-kept frozen tensors (router, KDA conv and decay) too, FSDP keeps them
  whole on the GPU (they are not in its groups): the plan counts them on the GPU in both cases (an upper bound
  of a few MB per layer in one process);
- GPU: the parameters less those bytes, plus two layers in flight (the one running and the one prefetched):
  ``2 max_i W_i`` in one process; under FSDP the gathered layers are FSDP's buffers already
  (``components.fsdp_buffers``), and two shards' copies feed the all-gathers (``2 max_i W_i / shard``);
- time: each pass over the layers copies the whole streamed base at ``STREAM_BYTES_PER_S``, layer i + 1's
  copy while layer i computes; a layer whose copy takes longer than its compute delays the pass by the
  difference (``excess_seconds``). A plain or recomputed step passes twice (forward; backward, where a
  recomputed layer's rerun and its backward share one copy); under sequence segments every segment passes
  three times (the forward pass, its rerun with a graph, its backward), each with a segment's compute.

The plan picks the scheme only where no set of fixes without it fits (``plan.fixes.LAST_RESORT``).
"""

from __future__ import annotations

from typing import Any

from megaseq.plan import components as C

# host to device from pinned memory on an H200 (PCIe 5 x16): the planner takes 55 GB/s for one large copy
# (flops.PINNED_BYTES_PER_S); per-layer copies of 0.1-3 GB beside the compute's own traffic are taken at 50 GB/s
# (an assumption, not measured)
STREAM_BYTES_PER_S = 50e9
IN_FLIGHT = 2  # layers whose streamed weights are on the GPU at once


def streamed_layer_bytes(run: Any) -> list[int]:
    """Per decoder layer: the bytes of its frozen weights held in host memory by one GPU's process (its shard
    under FSDP), those the GPU no longer keeps; all zeros without ``memory.stream_base`` or a frozen base."""
    counts, mesh, prec = run.counts, run.mesh, run.prec
    if not run.memory.stream_base or counts.trained is None:
        return [0] * len(counts.layers)
    fb = C.frozen_bytes(prec)
    return [C.gathered_params(counts, i, mesh, prec) * fb // mesh.shard for i in range(len(counts.layers))]


def gpu_terms(run: Any, parameters: int) -> dict[str, int]:
    """The state's GPU terms with the base streamed: ``parameters`` (``components.param_bytes``) less the
    streamed bytes, and the layers in flight; ``{}`` when nothing streams."""
    per_layer = streamed_layer_bytes(run)
    if not any(per_layer):
        return {}
    return {"parameters": parameters - sum(per_layer),
            "streamed base (2 layers in flight)": IN_FLIGHT * max(per_layer)}


def host_terms(run: Any) -> dict[str, int]:
    """Host bytes per GPU: the streamed base, pinned (``{}`` when nothing streams)."""
    total = sum(streamed_layer_bytes(run))
    return {"streamed frozen base (pinned)": total} if total else {}


def layer_seconds(run: Any) -> list[float]:
    """Per layer: its forward compute seconds over the whole sequence on one GPU (``flops.layer_flops`` at the
    planner's rate, ``flops.step_seconds``'s)."""
    from megaseq.plan.flops import ACHIEVED_FRACTION, H200_BF16_MEASURED, layer_flops

    rate = ACHIEVED_FRACTION * H200_BF16_MEASURED * run.mesh.cp / run.batch
    out = []
    for i in range(run.spec.num_layers):
        f = layer_flops(run.spec, run.seq_len, i)
        out.append((f.mixer + f.indexer + f.mlp + f.hc) / rate)
    return out


def excess_seconds(run: Any, num_segments: int) -> float:
    """What the copies add to a step: layer by layer, the copy of the next layer runs while this one computes,
    so each pass adds ``sum_i max(0, copy_i - compute_i)``. A pass of one segment computes ``1 / n`` of a
    layer's work (the average: later segments attend over more keys), a backward twice a forward's (once more
    with recompute's rerun). Passes: a plain or recomputed step one forward and one backward per micro-batch;
    under ``n`` sequence segments per segment the forward pass, the rerun with a graph and the backward."""
    per_layer = streamed_layer_bytes(run)
    n = max(1, num_segments)
    compute = [t / n for t in layer_seconds(run)]
    copy = [b / STREAM_BYTES_PER_S for b in per_layer]
    bwd_factor = 3 if run.memory.recompute and n == 1 else 2

    def one_pass(factor: float) -> float:
        return sum(max(0.0, c - factor * t) for c, t in zip(copy, compute, strict=True))

    forward_passes = 2 * n if n > 1 else 1
    return run.grad_accum * (forward_passes * one_pass(1) + n * one_pass(bwd_factor))

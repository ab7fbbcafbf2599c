"""A frozen base streamed from host memory (``memory.stream_base``), float64 on the CPU: LoRA on qwen3-moe-tiny
and kimi-linear-tiny (and glm5-flash-tiny), the streamed model against the resident one, BITWISE equal loss and
every trained gradient over two steps: plain, with recompute, with sequence segments (and tiling inside them),
with recompute + SCO + tiling, with segmented KDA + tiling; a ``megaseq train`` run and its merged export; and
under FSDP2 over 2 gloo ranks (torch's ``CPUOffloadPolicy`` on the blocks). The "device" is the CPU here: the
mechanism runs all the same (a copy into a fresh device buffer a layer ahead, the buffer freed on eviction, the
weights fetched again for the backward), and its own bookkeeping says at most two layers were resident at once.

Broken variants that must fail: a stale copy (the previous layer's weights), the backward not fetching again
(must raise), autograd keeping the device weights instead of handles (freed before the backward used them:
must raise).
"""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from lora_helpers import adapted_model, randomize_adapters, settings, trained
from megaseq.config import MemorySettings
from megaseq.memory import stream_base as sb
from megaseq.memory.vocab_loss import linear_cross_entropy
from megaseq.models.presets import get_preset
from megaseq.ops import dispatch

PRESETS = ["qwen3-moe-tiny", "kimi-linear-tiny"]
B, S = 2, 37

pytestmark = pytest.mark.usefixtures("one_thread", "exact_attention")


def _batch(spec, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    ids, labels = (torch.randint(1, spec.vocab_size, (B, S), generator=g) for _ in range(2))
    labels[0, 4] = -100
    return ids, labels


def _loss_fn(model):
    def fn(hidden, labels):
        return linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), model.lm_head.weight, labels.reshape(-1),
                                    reduction="sum")
    return fn


def step(preset: str, memory: MemorySettings, steps: int = 1):
    """(model, what was applied, [(loss, {trained name: gradient})] per step): LoRA on every projection and the
    routed experts, the adapters random; ``steps`` forward + backward passes (the second after the first's
    residency is left as a step leaves it)."""
    from megaseq.memory.model_segments import segmented_loss_backward

    spec = get_preset(preset)
    model, done = adapted_model(spec, settings("all"), memory)
    ids, labels = _batch(spec)
    out = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        if memory.model_segment_tokens:
            loss = segmented_loss_backward(model, ids, labels, _loss_fn(model), 1 / S, memory.model_segment_tokens)
        else:
            loss = _loss_fn(model)(model(ids), labels)
            (loss / S).backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in trained(model).items()}))
    return model, done, out


def assert_bitwise(got, want) -> None:
    for (l1, g1), (l0, g0) in zip(got, want, strict=True):
        assert torch.equal(l1, l0), (l1.item(), l0.item())
        assert g1.keys() == g0.keys() and g0 and all("lora_" in n for n in g0)
        unequal = [n for n in g0 if not torch.equal(g1[n], g0[n])]
        assert not unequal, unequal[:3]


MEMORY = {"plain": {}, "recompute": {"recompute": True}, "segments": {"model_segment_tokens": 9},
          "segments_tiled": {"model_segment_tokens": 16, "tiled_mlp": True, "mlp_tile_tokens": 5}}


MEMORY |= {"sco_tiled": {"recompute": True, "checkpoint_offload": True, "offload_host_budget": 1 << 20,
                         "tiled_mlp": True, "mlp_tile_tokens": 7},
           "kda_tiled": {"kda_segment_tokens": 8, "tiled_mlp": True, "mlp_tile_tokens": 7}}
SLOW_CASES = {("kimi-linear-tiny", "segments_tiled"), ("glm5-flash-tiny", "segments")}  # `make test-all`
CASES = [pytest.param(p, m, marks=pytest.mark.slow) if (p, m) in SLOW_CASES else (p, m)
         for p, m in ([(p, m) for p in PRESETS for m in ("plain", "recompute", "segments", "segments_tiled")]
                      + [("qwen3-moe-tiny", "sco_tiled"), ("kimi-linear-tiny", "kda_tiled"),
                         ("glm5-flash-tiny", "plain"), ("glm5-flash-tiny", "segments")])]


@pytest.mark.parametrize(("preset", "schemes"), CASES)
def test_streamed_base_equals_resident_bitwise(preset, schemes):
    """Two steps (the second starts from the residency the first left): loss and every adapter gradient
    bitwise the resident model's; at most 2 layers resident; every layer fetched again for its backward; each
    frozen weight of a layer not resident is its host view."""
    resident = step(preset, MemorySettings(**MEMORY[schemes]), steps=2)[2]
    model, done, streamed = step(preset, MemorySettings(stream_base=True, **MEMORY[schemes]), steps=2)
    assert_bitwise(streamed, resident)
    streamer, L = done.streamer, len(model.layers)
    assert done.streamed == "layers" and streamer is not None and len(streamer.layers) == L
    assert streamer.peak_resident == 2  # the layer running and the one prefetched
    passes = 2 * 3 * -(-S // MEMORY[schemes]["model_segment_tokens"]) if "segments" in schemes else 2 * 2
    assert streamer.fetches >= passes * L - 2 * passes  # forward and backward each fetch (almost) every layer
    for i, rec in enumerate(streamer.layers):
        assert rec.params and all(not p.requires_grad for p in rec.params)
        if i not in streamer.resident:
            assert all(p.data_ptr() == v.data_ptr() for p, v in zip(rec.params, rec.host_views))
    assert all(p.requires_grad for p in trained(model).values())


def test_a_stale_copy_fails(monkeypatch):
    """The device buffer filled from the previous layer's host weights (the layers have the same shapes):
    the loss differs."""
    want = step("qwen3-moe-tiny", MemorySettings())[2]
    orig = sb.BaseStreamer._copy_in

    def stale(self, i):
        orig(self, i)
        prev = self.layers[max(i - 1, 0)]
        self.layers[i].device_buf.copy_(prev.host.base[:self.layers[i].nbytes])

    monkeypatch.setattr(sb.BaseStreamer, "_copy_in", stale)
    got = step("qwen3-moe-tiny", MemorySettings(stream_base=True))[2]
    assert not torch.equal(got[0][0], want[0][0])


def test_backward_not_fetching_again_fails(monkeypatch):
    """The backward's ``use`` a no-op (the layer left in forward is not copied back): it raises."""
    orig = sb.BaseStreamer.use

    def forward_only(self, i, backward):
        if not backward:
            orig(self, i, backward)

    monkeypatch.setattr(sb.BaseStreamer, "use", forward_only)
    with pytest.raises((AttributeError, RuntimeError)):
        step("qwen3-moe-tiny", MemorySettings(stream_base=True))


def test_weights_kept_by_autograd_are_freed_before_backward(monkeypatch):
    """No saved-tensor hooks: autograd keeps views of the device buffers, which eviction frees; the backward
    that reads them raises (the hooks are what lets a layer's weights leave the GPU after its forward)."""
    import contextlib

    monkeypatch.setattr(sb.BaseStreamer, "hooks", lambda self, i: contextlib.nullcontext())
    with pytest.raises(RuntimeError):
        step("qwen3-moe-tiny", MemorySettings(stream_base=True))


def test_applying_again_puts_the_weights_back():
    """Applying the schemes again without the setting: every weight a tensor of its own, the forward unwrapped,
    the loss unchanged."""
    from megaseq.models.registry import parallelize

    model, done, (first,) = step("qwen3-moe-tiny", MemorySettings(stream_base=True))
    host = {p.data_ptr() for rec in done.streamer.layers for p in rec.params}
    parallelize(model, MemorySettings(), None, settings("all"))
    assert not any(isinstance(layer.__dict__.get("forward"), sb._StreamedForward) for layer in model.layers)
    assert not host & {p.data_ptr() for p in model.parameters()}
    ids, labels = _batch(model.spec)
    assert torch.equal(_loss_fn(model)(model(ids), labels), first[0])


@pytest.mark.parametrize("schemes", ["recompute", "sco_tiled"])
def test_only_what_is_not_streamed_moves_to_the_device(monkeypatch, schemes):
    """With the wrappers installed after the streamed forward (recompute, SCO, tiling), ``to_device_resident``
    (the trainer's call once the schemes are applied) moves every parameter and buffer but the streamed weights,
    which stay their host views (each tensor it moves is recorded: on the CPU the move is no copy)."""
    memory = MemorySettings(stream_base=True, **MEMORY[schemes])
    model, done = adapted_model(get_preset("qwen3-moe-tiny"), settings("all"), memory)
    streamed = {id(p) for rec in done.streamer.layers for p in rec.params}
    assert {id(p) for p in sb.streamed_parameters(model)} == streamed
    moved, to = [], torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: moved.append(self.data_ptr()) or to(self, *a, **k))
    sb.to_device_resident(model, "cpu")
    monkeypatch.undo()
    others = [p for p in model.parameters() if id(p) not in streamed] + list(model.buffers())
    assert others and sorted(moved) == sorted(t.data_ptr() for t in others)
    for rec in done.streamer.layers:
        assert all(p.data_ptr() == v.data_ptr() for p, v in zip(rec.params, rec.host_views))


def test_unstreaming_under_a_wrapper_keeps_the_wrapper():
    """``unstream_layers`` on layers whose streamed forward sits under SCO's recompute wrapper: the weights are
    tensors of their own again, the wrapper stays and calls the layer's own forward, the loss is unchanged."""
    model, done, (first,) = step("qwen3-moe-tiny", MemorySettings(stream_base=True, **MEMORY["sco_tiled"]))
    # the streamer's host copies (alive with it; a layer's resident copy is freed when it is evicted, and its
    # address may then go to a weight copied back)
    host = {v.data_ptr() for rec in done.streamer.layers for v in rec.host_views}
    wrappers = [layer.__dict__["forward"] for layer in model.layers]
    sb.unstream_layers(list(model.layers))
    assert all(sb.streamed_forward(layer) is None for layer in model.layers)
    assert [layer.__dict__["forward"] for layer in model.layers] == wrappers
    assert not host & {p.data_ptr() for p in model.parameters()}
    ids, labels = _batch(model.spec)
    assert torch.equal(_loss_fn(model)(model(ids), labels), first[0])


def test_a_base_that_trains_is_refused():
    from megaseq.models.build import build_model
    from megaseq.models.registry import parallelize

    model = build_model(get_preset("qwen3-moe-tiny"), dtype=torch.float64, seed=0)
    with pytest.raises(ValueError, match="memory.stream_base .*--lora.rank"):
        parallelize(model, MemorySettings(stream_base=True))


def test_a_training_run_streams_and_exports_as_the_resident_run(tmp_path):
    """``megaseq train`` (one process, LoRA + a trained norm, the settings forced): with the base streamed the
    losses and the merged HF export equal the resident run's bitwise."""
    import numpy as np

    from lora_parallel_checks import lora_run_overrides, run_losses, safetensors_in, train_rank

    rng = np.random.default_rng(4)
    (tmp_path / "g.fa").write_text(">rec\n" + "".join(rng.choice(list("ACGT"), 4000)) + "\n")
    for name, stream in (("resident", False), ("streamed", True)):
        over = lora_run_overrides(tmp_path, name, 1, 2, **{"memory.auto": False, "memory.stream_base": stream,
                                                            "train.steps": 2, "train.save_every": 0})
        train_rank(0, over)
    import json

    assert json.loads((tmp_path / "streamed" / "plan.json").read_text())["memory"]["stream_base"]
    assert run_losses(tmp_path / "streamed") == run_losses(tmp_path / "resident")
    want, got = safetensors_in(tmp_path / "resident" / "hf"), safetensors_in(tmp_path / "streamed" / "hf")
    assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want)


# ---- FSDP2 over gloo: each rank's shards in host memory (CPUOffloadPolicy) ---------------------------------------
def _rank(rank: int) -> None:
    from test_fsdp_train_step import _cfg, run_steps
    from test_lora_fsdp import TARGETS, TRAIN

    from megaseq.models.build import build_model
    from megaseq.models.registry import parallelize
    from megaseq.parallel.env import DistributedEnv

    dispatch.configure(preferred={"attention": ["torch_exact"]})
    cfg = _cfg(2, 1, "dp")
    env = DistributedEnv(cfg, spec=get_preset("qwen3-moe-tiny"))
    runs = []
    for stream in (False, True):
        memory = MemorySettings(stream_base=stream, recompute=stream)  # recompute: the rerun gathers again
        model = build_model(get_preset("qwen3-moe-tiny"), dtype=torch.float64, seed=0)
        done = parallelize(model, memory, env, settings(targets=TARGETS["qwen3-moe-tiny"], trainable=TRAIN))
        randomize_adapters(model)
        offloaded = [fp.offload_to_cpu for b in done.sharded.blocks[1:] for g in b._get_fsdp_state()._fsdp_param_groups
                     for fp in g.fsdp_params]
        assert offloaded and all(offloaded) == stream and done.streamed == ("fsdp" if stream else "")
        runs.append(run_steps(model, env, memory, cfg))
    (l0, g0, p0), (l1, g1, p1) = runs
    assert l1 == l0, (l1, l0)
    for k in range(len(g0)):
        assert g1[k].keys() == g0[k].keys() and g0[k]
        assert all(torch.equal(g1[k][n], g0[k][n]) for n in g0[k]), k
    assert all(torch.equal(p1[n], p0[n]) for n in p0)
    env.shutdown()


def test_fsdp_streams_each_ranks_shards_bitwise():
    """2 gloo ranks, FSDP over dp, LoRA + a trained norm: the blocks' frozen shards offloaded (torch's
    CPUOffloadPolicy) with recompute give the resident run's losses, gradients and parameters bitwise
    (the offload only moves the shards; recompute is exact and changes no sum here)."""
    from megaseq.parallel.launch import spawn_local

    spawn_local(_rank, 2)


# ---- on a GPU --------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("preset", PRESETS)
def test_streamed_on_gpu_equals_resident_with_less_memory(preset):
    """bf16 autocast on a GPU, the base stored bf16 and streamed from pinned memory on the side stream: the loss
    and the adapters' gradients equal the resident model's (the same kernels on the same values; to the GPU's
    run-to-run noise where the MoE's atomics sum in another order), the peak allocated memory is lower (the
    experts widened so that the base's bytes set the peak), and the host buffers are pinned. The routers balance
    as the trainer has them (``train.balance.Balancer``: Qwen3's auxiliary loss, whose gradient the balancer sets
    beside the router's weight, in host memory when streamed)."""
    from megaseq.config import MoEConfig
    from megaseq.models.build import build_model
    from megaseq.models.registry import parallelize
    from megaseq.parallel.env import ParallelEnv
    from megaseq.train.balance import Balancer, resolve_balance

    # experts wide enough that the base's bytes, not the allocator's and the kernels' small buffers, set the peak
    spec = dataclasses.replace(get_preset(preset), moe_intermediate_size=512)
    ids, labels = (t.cuda() for t in _batch(spec))
    runs = []
    for stream in (False, True):
        model = build_model(spec, dtype=torch.float32, seed=0, device="cuda")
        done = parallelize(model, MemorySettings(stream_base=stream), None, settings("all", frozen_dtype="bf16"))
        randomize_adapters(model)
        balancer = Balancer(model, resolve_balance(MoEConfig(), spec), ParallelEnv())
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with dispatch.configured(), torch.autocast("cuda", dtype=torch.bfloat16):
            loss = _loss_fn(model)(model(ids), labels)
        balancer.after_forward()
        (loss / S).backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        runs.append((loss.detach(), {n: p.grad.clone() for n, p in trained(model).items()},
                     torch.cuda.max_memory_allocated(), peak))
        if stream:
            assert all(rec.host.pinned for rec in done.streamer.layers)
            assert done.streamer.peak_resident == 2
        del model, done, balancer, loss  # the balancer holds the model: the next run measures from an empty GPU
        gc.collect()
        torch.cuda.empty_cache()
    (l0, g0, top0, _), (l1, g1, top1, _) = runs
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=0)
    assert g0.keys() == g1.keys() and g0
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-2, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
    print(f"\n{preset}: peak allocated resident {top0 / 2**20:.1f} MiB, streamed {top1 / 2**20:.1f} MiB")
    assert top1 < top0

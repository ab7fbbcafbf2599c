"""OffloadStreamAdamW: AdamW whose fp32 state lives in host memory and streams through the GPU.

Shapes: P parameters in all, n elements of one bucket, n_max the largest bucket.

Per parameter, host memory holds the master weight, ``exp_avg``, ``exp_avg_sq`` and the gradient (fp32,
or fp64 for fp64 parameters), each array one exactly sized pinned buffer carved into buckets of about
``bucket_params`` elements. Buckets hold whole parameters and never mix parameter groups: a parameter
is never split (one larger than ``bucket_params`` gets a bucket of its own, and sets the staging size).

The step streams buckets through two GPU staging slots: while bucket g is updated on the GPU (the
``torch._foreach`` form of ``torch.optim.AdamW``'s arithmetic, element for element), bucket g+1
(master, moments, gradient) is uploaded on one copy stream and bucket g-1 written back on another.
The low-precision GPU weights are then overwritten in place from the updated master.

Gradients. ``grads_to_host()`` (run by ``clip_grad_norm_`` and ``step``) copies every GPU gradient into
its host slot and frees it; with ``grads_in_backward=True`` a post-accumulate-grad hook does this as
each gradient is produced, so the model's gradients never all sit on the GPU (a gradient that arrives
again in the same step, from gradient accumulation, is added to the host copy). With ``accumulate=True`` and
the gradients kept on the GPU until the step (sequence segments: each gradient arrives once per segment), a
low-precision parameter's gradients are summed in the master dtype on the GPU as they arrive (``acc``, 4 B a
parameter, as ``MasterAdamW`` sums them), not in its bf16 ``.grad``. Parameters that got no gradient are
skipped, as ``torch.optim.AdamW`` does (no decay, no step count).

Clipping: ``clip_grad_norm_(max_norm)`` replaces ``torch.nn.utils.clip_grad_norm_`` (which cannot see
host gradients): the global 2-norm over all gradients before the update, with torch's coefficient
``min(1, max_norm / (norm + 1e-6))`` applied in the update. ``param_groups`` carry ``lr``, so LR
schedulers work; ``state_dict()/load_state_dict()`` hold steps, moments and the master weights.
FSDP2 shards (DTensor parameters): the host arrays hold each rank's local shard, the update runs on it and
writes the local bf16 shard back; clipping sums each sharded gradient's squares over its mesh
(``master_adam.combine_norms``) and ``state_dict`` wraps the host views as DTensors with the parameters'
placements (DCP reshards them). On a CPU-only run the same code runs, the streams being no-ops.

``SequentialOffloadAdamW`` is the baseline: gradients to the host, ``torch.optim.AdamW`` on the CPU,
parameters back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from megaseq.memory.host_memory import HostBuffer
from megaseq.memory.master_adam import combine_norms, fold_grad, like_param, local, restore_groups, weak_hook
from megaseq.memory.rules import round_up


@dataclass
class _Bucket:
    group: int
    params: list[torch.Tensor]
    offsets: list[int]  # element offset of each parameter in the bucket
    numel: int
    host_offset: int = 0  # byte offset in each host array
    # flat views into the host arrays: master, exp_avg, exp_avg_sq, grad
    host: dict[str, torch.Tensor] = field(default_factory=dict)


def _build_buckets(groups: list[dict[str, Any]], bucket_params: int) -> list[_Bucket]:
    buckets: list[_Bucket] = []
    for gi, group in enumerate(groups):
        cur: list[torch.Tensor] = []
        offs: list[int] = []
        n = 0
        for p in group["params"]:
            numel = local(p).numel()
            if cur and n + numel > bucket_params:
                buckets.append(_Bucket(gi, cur, offs, n))
                cur, offs, n = [], [], 0
            cur.append(p)
            offs.append(n)
            n += numel
        if cur:
            buckets.append(_Bucket(gi, cur, offs, n))
    return buckets


class _Streams:
    """An upload and a download stream on CUDA; no-ops on the CPU or with ``overlap=False``."""

    def __init__(self, device: torch.device, overlap: bool) -> None:
        self.cuda = device.type == "cuda"
        use = self.cuda and overlap
        self.up = torch.cuda.Stream(device) if use else None
        self.down = torch.cuda.Stream(device) if use else None

    def on(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def record(self, stream: Any) -> Any:
        if stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def wait(self, stream: Any, event: Any) -> None:
        if stream is not None and event is not None:
            stream.wait_event(event)


class OffloadStreamAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, as ``torch.optim.AdamW``) with host-resident fp32 state."""

    ARRAYS = ("master", "exp_avg", "exp_avg_sq", "grad")

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, bucket_params: int = 100_000_000,
                 overlap: bool = True, grads_in_backward: bool = False,
                 hookable: Callable[[torch.Tensor], bool] | None = None, accumulate: bool = False) -> None:
        if bucket_params < 1:
            raise ValueError(f"memory.optimizer_bucket_params must be >= 1, got {bucket_params}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        all_params = [p for g in self.param_groups for p in g["params"]]
        devices = {p.device for p in all_params}
        if len(devices) != 1:
            raise ValueError("OffloadStreamAdamW needs all parameters on one device, got "
                             f"{sorted(map(str, devices))}")
        self.device = devices.pop()
        self.dtype = torch.float64 if any(p.dtype == torch.float64 for p in all_params) else torch.float32
        self.buckets = _build_buckets(self.param_groups, bucket_params)
        self.bucket_of = {p: (b, off) for b in self.buckets for p, off in zip(b.params, b.offsets)}
        self.streams = _Streams(self.device, overlap)
        self._alloc_host()
        self.staging: list[dict[str, torch.Tensor]] = []
        self.has_grad: dict[torch.Tensor, bool] = {p: False for p in all_params}
        self.norms: dict[torch.Tensor, torch.Tensor] = {}
        self.clip_coef: torch.Tensor | None = None
        hookable = hookable or (lambda p: True)  # several ranks: only FSDP's shards are complete in the backward
        self.hooks = [p.register_post_accumulate_grad_hook(weak_hook(self._grad_hook))
                      for p in all_params if grads_in_backward and p.requires_grad and hookable(p)]
        # the sums of gradients kept on the GPU over several backward passes, in the master dtype (``accumulate``)
        self.acc: dict[torch.Tensor, torch.Tensor] = {}
        self.hooks += [p.register_post_accumulate_grad_hook(weak_hook(self._fold)) for p in all_params
                       if accumulate and not grads_in_backward and p.requires_grad and hookable(p)
                       and p.dtype.itemsize < self.dtype.itemsize]

    # ---- host state ----------------------------------------------------------------------------
    def _alloc_host(self) -> None:
        esize = torch.empty((), dtype=self.dtype).element_size()
        total = 0
        for b in self.buckets:
            b.host_offset = total
            total += round_up(b.numel * esize)
        pin = self.device.type == "cuda"
        self.host_buffers = {name: HostBuffer(total, pin) for name in self.ARRAYS}
        for b in self.buckets:
            for name, buf in self.host_buffers.items():
                b.host[name] = buf.view(b.host_offset, (b.numel,), self.dtype)
            for p, off in zip(b.params, b.offsets):
                lp = local(p)
                n = lp.numel()
                view = b.host["master"][off:off + n]
                view.copy_(lp.detach().reshape(-1))  # bf16 -> fp32 is exact
                b.host["exp_avg"][off:off + n].zero_()
                b.host["exp_avg_sq"][off:off + n].zero_()
                self.state[p] = {
                    "step": torch.tensor(0.0, dtype=torch.float64),
                    "exp_avg": like_param(b.host["exp_avg"][off:off + n].view(lp.shape), p),
                    "exp_avg_sq": like_param(b.host["exp_avg_sq"][off:off + n].view(lp.shape), p),
                    "master": like_param(view.view(lp.shape), p),
                }

    def _host_view(self, p: torch.Tensor, name: str) -> torch.Tensor:
        b, off = self.bucket_of[p]
        return b.host[name][off:off + local(p).numel()]

    @property
    def host_bytes(self) -> int:
        return sum(buf.nbytes for buf in self.host_buffers.values())

    @property
    def staging_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for slot in self.staging for t in slot.values())

    # ---- gradients to the host -----------------------------------------------------------------
    def _grad_hook(self, p: torch.Tensor) -> None:
        self._move_grad(p)

    def _fold(self, p: torch.Tensor) -> None:
        """A gradient kept on the GPU until the step, added to its sum in the master dtype (``accumulate``)."""
        fold_grad(self.acc, p, self.dtype)

    def _move_grad(self, p: torch.Tensor) -> None:
        if p in self.acc:  # the summed gradient (a bf16 .grad that came after the sums is folded in first)
            self._fold(p)
            g = self.acc.pop(p)
        elif p.grad is None:  # a hook of an inner backward (recompute, tiling) already moved this gradient
            return
        else:
            g = local(p.grad)
        host = self._host_view(p, "grad")
        s = self.streams
        if self.has_grad[p]:  # accumulation: bring the host copy back, add, go again
            if s.down is not None:
                torch.cuda.current_stream(self.device).wait_stream(s.down)
            g = g.to(self.dtype) + host.view(g.shape).to(g.device, non_blocking=True)
        # torch's clip_grad_norm_ takes each gradient's norm, then the norm of those norms (here in the
        # master dtype, so bf16 gradients are not squared in bf16)
        self.norms[p] = torch.linalg.vector_norm(g, dtype=self.dtype)
        if s.down is not None:
            s.down.wait_stream(torch.cuda.current_stream(self.device))
        with s.on(s.down):
            host.copy_(g.reshape(-1), non_blocking=s.cuda)
        if s.down is not None:
            g.record_stream(s.down)
        self.has_grad[p] = True
        p.grad = None

    def grads_to_host(self) -> None:
        """Copy every gradient still on the device (or its sum, ``accumulate``) into host memory and free it."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None or p in self.acc:
                    self._move_grad(p)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Global 2-norm of all gradients (returned); the update scales them by torch's clip coefficient."""
        self.grads_to_host()
        norms = [(p, n) for p, n in self.norms.items() if self.has_grad[p]]
        if not norms:
            return torch.tensor(0.0)
        total = combine_norms(norms, self.dtype)
        self.clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        return total

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None
                self.has_grad[p] = False
        self.acc.clear()
        self.norms.clear()
        self.clip_coef = None

    # ---- the streamed update -------------------------------------------------------------------
    def _ensure_staging(self) -> None:
        if self.staging:
            return
        n_max = max(b.numel for b in self.buckets)
        self.staging = [{name: torch.empty(n_max, dtype=self.dtype, device=self.device)
                         for name in self.ARRAYS} for _ in range(2)]

    def release_staging(self) -> None:
        """Give the two staging slots back to the allocator (they are re-made at the next step)."""
        self.staging = []

    def _upload(self, b: _Bucket, slot: dict[str, torch.Tensor], after: Any) -> Any:
        s = self.streams
        s.wait(s.up, after)  # the slot's previous bucket has been written back
        with s.on(s.up):
            for name in self.ARRAYS:
                slot[name][:b.numel].copy_(b.host[name], non_blocking=s.cuda)
        return s.record(s.up)

    def _writeback(self, b: _Bucket, slot: dict[str, torch.Tensor], after: Any) -> Any:
        s = self.streams
        s.wait(s.down, after)
        with s.on(s.down):
            for name in ("master", "exp_avg", "exp_avg_sq"):
                b.host[name].copy_(slot[name][:b.numel], non_blocking=s.cuda)
        return s.record(s.down)

    def _update(self, b: _Bucket, slot: dict[str, torch.Tensor]) -> None:
        """``torch.optim.AdamW``'s single-tensor arithmetic, in foreach form over this bucket's parameters."""
        group = self.param_groups[b.group]
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        idx = [i for i, p in enumerate(b.params) if self.has_grad[p]]
        views = {name: [slot[name][b.offsets[i]:b.offsets[i] + local(b.params[i]).numel()] for i in idx]
                 for name in self.ARRAYS}
        P, M, V, G = views["master"], views["exp_avg"], views["exp_avg_sq"], views["grad"]
        steps = []
        for i in idx:
            st = self.state[b.params[i]]["step"]
            st += 1
            steps.append(st.item())
        if self.clip_coef is not None:
            torch._foreach_mul_(G, self.clip_coef.to(self.device, self.dtype))
        if wd != 0:
            torch._foreach_mul_(P, 1 - lr * wd)
        torch._foreach_lerp_(M, G, 1 - beta1)
        torch._foreach_mul_(V, beta2)
        torch._foreach_addcmul_(V, G, G, 1 - beta2)
        denom = torch._foreach_sqrt(V)
        torch._foreach_div_(denom, [(1 - beta2**k) ** 0.5 for k in steps])
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(P, M, denom, [-(lr / (1 - beta1**k)) for k in steps])
        del denom
        for i, master in zip(idx, P):  # the GPU weights, in their own dtype, from the new master
            lp = local(b.params[i])
            lp.detach().copy_(master.view(lp.shape))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.grads_to_host()
        todo = [b for b in self.buckets if any(self.has_grad[p] for p in b.params)]
        if todo:
            self._stream_buckets(todo)
        self.clip_coef = None
        return loss

    def _stream_buckets(self, todo: list[_Bucket]) -> None:
        """Upload g+1 while g updates and g-1 writes back: two slots, three streams."""
        self._ensure_staging()
        s = self.streams
        compute = torch.cuda.current_stream(self.device) if s.cuda else None
        if s.up is not None:
            s.up.wait_stream(compute)  # gradient copies to the host (and the forward's weights) are done
            s.up.wait_stream(s.down)
        written: list[Any] = [None, None]
        uploaded = [self._upload(todo[0], self.staging[0], None), None]
        for g, b in enumerate(todo):
            k = g % 2
            if g + 1 < len(todo):
                uploaded[1 - k] = self._upload(todo[g + 1], self.staging[1 - k], written[1 - k])
            s.wait(compute, uploaded[k])
            self._update(b, self.staging[k])
            written[k] = self._writeback(b, self.staging[k], s.record(compute))
        if s.cuda:  # host state complete before anyone reads it (state_dict, the next step's gradients)
            torch.cuda.synchronize(self.device)

    # ---- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch layout: ``state`` by parameter index (step, exp_avg, exp_avg_sq, master: views of the host
        buffers, complete since ``step`` synchronises its copies; clone them to keep a snapshot)."""
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore hyperparameters, steps, moments and master weights (into the host buffers, in place);
        the GPU weights are set from the master. A state without ``master`` keeps the current weights."""
        index = restore_groups(self, state_dict["param_groups"])
        with torch.no_grad():
            for key, st in state_dict["state"].items():
                p = index[key]
                mine = self.state[p]
                mine["step"].fill_(float(st["step"]))
                for name in ("exp_avg", "exp_avg_sq", "master"):
                    if name in st and st[name] is not mine[name]:
                        local(mine[name]).copy_(local(st[name]).reshape(local(mine[name]).shape))
                if "master" in st:
                    local(p).detach().copy_(local(mine["master"]))


class SequentialOffloadAdamW(torch.optim.Optimizer):
    """Baseline: gradients to host memory, ``torch.optim.AdamW`` on the CPU over fp32 masters, weights
    back."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        pin = any(p.is_cuda for g in self.param_groups for p in g["params"])
        self.masters = {p: p.detach().to("cpu", torch.float32, copy=True) for g in self.param_groups
                        for p in g["params"]}
        if pin:
            self.masters = {p: m.pin_memory() for p, m in self.masters.items()}
        self.inner = torch.optim.AdamW(
            [{**{k: v for k, v in g.items() if k != "params"},
              "params": [self.masters[p] for p in g["params"]]} for g in self.param_groups], foreach=True)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update({k: v for k, v in group.items() if k != "params"})
            for p in group["params"]:
                m = self.masters[p]
                m.grad = None if p.grad is None else p.grad.to("cpu", torch.float32)
        self.inner.step()
        for p, m in self.masters.items():
            if m.grad is not None:
                p.copy_(m, non_blocking=True)
        return loss

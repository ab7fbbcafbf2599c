"""MasterAdamW: AdamW for bf16 weights, with fp32 master weights and moments beside them (sharded as they are).

Shapes: each parameter's local tensor (its FSDP2 shard, a DTensor's ``to_local()``; the whole tensor without
FSDP), n elements.

A bf16 model keeps 2 bytes per weight on the GPU; the update needs the weights to more bits than that, or
small steps round away. Per parameter this optimizer holds, on the parameter's device and with its sharding:

    master      fp32 copy of the weight (exact: bf16 -> fp32), updated by AdamW     4 B
    exp_avg, exp_avg_sq                                                          4 + 4 B
    acc         fp32 sum of the gradients of several backward passes (``accumulate``)  4 B

and a step is ``torch.optim.AdamW``'s own arithmetic on the master (its functional ``adamw``: fused for whole
tensors when ``fused``, as ``make_optimizer`` asks on CUDA; else foreach as given), then ``weight <- master``
rounded to the weight's dtype. So the result equals AdamW run on an fp32 copy and cast, bit for bit
(``tests/memory/test_master_adam.py``). Weights that are already fp32 (the router a bf16 model keeps) get a master
too, equal to them: one code path. With ``kernel="triton"`` (``make_optimizer``'s choice on CUDA where Triton
is installed; ``MEGASEQ_ADAMW=torch`` declines it) the whole parameters step in ``ops.adamw.fused``: torch's
fused arithmetic in one pass that reads a lone bf16 gradient as it is (28 bytes an element against the five
passes' 48), within a few fp32 ulps of it (``tests/ops/adamw/test_triton_adamw.py``).

Gradients. The bf16 gradient a backward leaves (FSDP: reduce-scattered in ``parallel.reduce_dtype``, then
cast to the weight's dtype) is cast to fp32 at the step. With ``accumulate`` (micro-batches, sequence
segments: several backward passes per step) a post-accumulate-grad hook adds each arriving gradient into an
fp32 sum and frees it, so nothing is summed in bf16; only gradients that are complete when they arrive may
be folded (FSDP's shards, or any gradient in a one-process run): a whole parameter of a multi-rank run is
all-reduced after the backward, so it stays in ``.grad`` (fp32 in a bf16 FSDP model).

Clipping: ``clip_grad_norm_(max_norm)`` is torch's (global 2-norm, coefficient ``min(1, max / (norm + 1e-6))``)
over local shards: each sharded gradient's squares are summed over its mesh's sharded dims (``grad_norm``).
``state_dict`` holds DTensors with the parameters' placements, so DCP reshards them on resume.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.adamw import adamw


def is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


# A parameter attribute: its gradient is not final when the backward leaves it (an expert-parallel DTensor,
# summed over the ranks holding the same experts afterwards), so no hook may fold or move it in the backward
REDUCED_AFTER_BACKWARD = "reduced_after_backward"


def complete_in_backward(p: Any) -> bool:
    """Whether a parameter's gradient is final when the backward leaves it on a multi-rank run: an FSDP
    shard's (reduce-scattered in the backward), not a whole parameter's nor an expert-parallel DTensor's
    (both reduced by the environment after the backward)."""
    return is_dtensor(p) and not getattr(p, REDUCED_AFTER_BACKWARD, False)


def restore_groups(optimizer: torch.optim.Optimizer, saved_groups: list[dict[str, Any]]) -> dict[Any, Any]:
    """A saved state's hyperparameters into ``optimizer.param_groups`` (in place); returns the saved parameter
    keys -> this optimizer's parameters. Shared by MasterAdamW and OffloadStreamAdamW, whose states torch's
    loader would cast or move."""
    if len(saved_groups) != len(optimizer.param_groups) or any(
            len(a["params"]) != len(b["params"]) for a, b in zip(saved_groups, optimizer.param_groups)):
        raise ValueError("optimizer state does not match this model's parameter groups")
    index = {}
    for saved, group in zip(saved_groups, optimizer.param_groups):
        index.update(zip(saved["params"], group["params"]))
        group.update({k: v for k, v in saved.items() if k != "params"})
        group["betas"] = tuple(group["betas"])
    return index


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard (a view), else ``t``."""
    return t.to_local() if is_dtensor(t) else t


def like_param(t_local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``t_local`` (this rank's part of a tensor shaped and sharded as ``p``) as ``p`` is: a DTensor with its
    mesh and placements for a DTensor ``p`` (what DCP saves and reshards), else itself."""
    if not is_dtensor(p):
        return t_local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(t_local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                              stride=p.stride())


def _shard_groups(t: torch.Tensor) -> list[Any]:
    """The process groups over which a DTensor is split (its mesh dims with a Shard placement)."""
    return [t.device_mesh.get_group(d) for d, pl in enumerate(t.placements) if pl.is_shard()]


def grad_norm(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]],
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Global 2-norm of gradients given as (parameter, local gradient) pairs: whole gradients count once,
    a sharded one's squares are summed over its sharded mesh dims. The same value on every rank."""
    pairs = list(pairs)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}  # torch's clip_grad_norm_ groups the same way
    for i, (_, g) in enumerate(pairs):
        groups.setdefault((g.device, g.dtype), []).append(i)
    norms: list[torch.Tensor | None] = [None] * len(pairs)
    for idx in groups.values():  # one multi-tensor pass per device and dtype, not a reduction per tensor
        for i, n in zip(idx, torch._foreach_norm([pairs[i][1] for i in idx], 2, dtype=dtype), strict=True):
            norms[i] = n
    return combine_norms([(p, n) for (p, _), n in zip(pairs, norms, strict=True)], dtype)


def combine_norms(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]],
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The global 2-norm from (parameter, 2-norm of its local gradient) pairs (see ``grad_norm``)."""
    whole: list[torch.Tensor] = []
    sharded: dict[tuple[int, ...], tuple[list[Any], list[torch.Tensor]]] = {}  # by the groups it is split over
    for p, n in pairs:
        if is_dtensor(p):
            groups = _shard_groups(p)
            sharded.setdefault(tuple(id(x) for x in groups), (groups, []))[1].append(n)
        else:
            whole.append(n)
    # stacked, then squared: the same squares and sum as squaring each norm first, in two launches, not one
    # per parameter (about 300 a glm5-flash-1gpu step, launched while the GPU waited)
    parts = [torch.stack(whole).to(dtype).square().sum()] if whole else []
    for groups, ns in sharded.values():
        part = torch.stack(ns).to(dtype).square().sum()
        for group in groups:
            dist.all_reduce(part, group=group)
        parts.append(part)
    return torch.stack(parts).sum().sqrt() if parts else torch.zeros((), dtype=dtype)


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_'s factor: ``min(1, max_norm / (norm + 1e-6))``."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


@torch.no_grad()
def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for parameters some of which are FSDP shards (DTensors): the global
    norm (returned) over every rank's shards, then every gradient scaled by torch's coefficient."""
    pairs = [(p, local(p.grad)) for p in params if p.grad is not None]
    if not pairs:
        return torch.zeros(())
    norm = grad_norm(pairs, dtype=torch.promote_types(pairs[0][1].dtype, torch.float32))
    coef = clip_coefficient(norm, max_norm)
    for _, g in pairs:
        g.mul_(coef.to(g.dtype))
    return norm


class SplitAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` for parameter groups that mix DTensors and plain tensors (expert parallelism:
    the routed experts are DTensors over the ep axis, every other parameter a whole tensor), which its
    foreach and fused kernels refuse in one call ("got mixed torch.Tensor and DTensor"). Each step runs
    every group as two (its plain tensors, then its DTensors) with the group's hyperparameters, so the
    arithmetic is AdamW's and ``param_groups`` / ``state_dict`` keep the groups as built (a checkpoint of
    an ep run has the one-process run's groups, and resumes there)."""

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        groups = self.param_groups
        self.param_groups = [{**g, "params": part} for g in groups
                             for part in ([p for p in g["params"] if not is_dtensor(p)],
                                          [p for p in g["params"] if is_dtensor(p)]) if part]
        try:
            return super().step(closure)
        finally:
            self.param_groups = groups


def mixes_dtensors(params: Iterable[torch.Tensor]) -> bool:
    """Whether ``params`` hold both DTensors and plain tensors."""
    kinds = {is_dtensor(p) for p in params}
    return len(kinds) == 2


def weak_hook(method: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    """A bound ``method`` as a parameter's gradient hook that does not keep its object alive. A tensor's hooks are
    held where Python's collector does not look, so a hook holding its optimizer makes the cycle parameter ->
    hook -> optimizer -> parameter uncollectable: the optimizer, its state (GiBs: fp32 masters and moments) and
    the parameters would outlive their last user, as long as the process. The hook does nothing once the object
    is gone."""
    ref = weakref.WeakMethod(method)

    def hook(p: torch.Tensor) -> None:
        bound = ref()
        if bound is not None:
            bound(p)

    return hook


def fold_grad(acc: dict[torch.Tensor, torch.Tensor], p: torch.Tensor, dtype: torch.dtype) -> None:
    """``p``'s gradient (local) added to its sum ``acc[p]`` in ``dtype`` (made on the first), ``.grad`` freed: the
    optimizers' sums of several backward passes (``MasterAdamW``'s and ``OffloadStreamAdamW``'s ``accumulate``)."""
    if p.grad is None:
        return
    g = local(p.grad)
    if p in acc:
        acc[p].add_(g)
    else:
        acc[p] = g.to(dtype, copy=True)
    p.grad = None


class MasterAdamW(torch.optim.Optimizer):
    """AdamW with fp32 master weights and moments for low-precision weights (see the module docstring)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, foreach: bool | None = None,
                 accumulate: bool = False, foldable: Callable[[torch.Tensor], bool] | None = None,
                 fused: bool = False, kernel: str = "torch") -> None:
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        if kernel not in ("torch", "triton"):
            raise ValueError(f"MasterAdamW kernel must be torch or triton, got {kernel!r}")
        self.foreach = foreach
        # kernel "triton": ops.adamw.fused's one pass per whole parameter (clip, AdamW, rounding; the bf16
        # gradient read as it is, not copied to fp32) where it supports the tensors; torch's way elsewhere
        self.kernel = kernel
        # fused: torch's fused AdamW kernel over the masters (one pass; foreach makes about ten), its step
        # counters on the masters' device as torch.optim.AdamW(fused=True) keeps them; DTensors step foreach
        self.fused = fused
        self.acc: dict[torch.Tensor, torch.Tensor] = {}  # fp32 gradient sums (``accumulate``), local
        self.clip_coef: torch.Tensor | None = None
        self.master_dtype = torch.float32
        for group in self.param_groups:
            for p in group["params"]:
                self._init_state(p)
        foldable = foldable or (lambda p: True)
        self.hooks = [p.register_post_accumulate_grad_hook(weak_hook(self._fold)) for g in self.param_groups
                      for p in g["params"] if accumulate and p.requires_grad and foldable(p)]

    def _init_state(self, p: torch.Tensor) -> None:
        dt = torch.promote_types(p.dtype, self.master_dtype)  # fp64 weights keep fp64 masters
        master = local(p).detach().to(dt, copy=True)
        on = master.device if self.fused and not is_dtensor(p) else None
        self.state[p] = {"step": torch.tensor(0.0, dtype=torch.float32, device=on),
                         "master": like_param(master, p),
                         "exp_avg": like_param(torch.zeros_like(master), p),
                         "exp_avg_sq": like_param(torch.zeros_like(master), p)}

    # ---- gradients -------------------------------------------------------------------------------
    def _fold(self, p: torch.Tensor) -> None:
        fold_grad(self.acc, p, local(self.state[p]["master"]).dtype)

    def _grad(self, p: torch.Tensor) -> torch.Tensor | None:
        """This step's gradient of ``p`` (local): in the master dtype, folding a gradient still in ``.grad``;
        with the Triton kernel a whole parameter's lone gradient stays as the backward left it (the kernel
        reads it in its dtype)."""
        if p.grad is not None:
            if self.kernel == "triton" and p not in self.acc and not is_dtensor(p):
                return p.grad
            self._fold(p)
        return self.acc.get(p)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The global gradient norm (returned); the step scales the gradients by torch's coefficient."""
        pairs = [(p, g) for group in self.param_groups for p in group["params"] if (g := self._grad(p)) is not None]
        if not pairs:
            return torch.zeros(())
        norm = grad_norm(pairs, dtype=self.master_dtype if pairs[0][1].dtype != torch.float64 else torch.float64)
        self.clip_coef = clip_coefficient(norm, max_norm)
        return norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=True)
        self.acc.clear()
        self.clip_coef = None

    # ---- the step --------------------------------------------------------------------------------
    # the trainer may hand ``step`` the step's finiteness as a device tensor (``finite``) instead of reading the
    # loss and gradient norm back first (host syncs between the backward and the update leave the GPU idle
    # while the update is launched; benchmarks/results/speed/runs/2026-12-04_host-syncs/ has the measured gain)
    guards_on_device = True

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, finite: torch.Tensor | None = None) -> Any:
        """One step. ``finite`` (0-d bool, or None): update only if it is true; the Triton kernel decides on the
        device (no host sync), torch's way reads it back (one sync, only when some parameter steps that way)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        skip_torch: bool | None = None  # finite read back once, when torch's way first needs it
        for group in self.param_groups:
            live = [(p, g) for p in group["params"] if (g := self._grad(p)) is not None]
            if not live:
                continue
            beta1, beta2 = group["betas"]
            hyper = dict(amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                         weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
            parts: dict[bool, list] = {True: [], False: []}  # whole tensors step fused (if asked), DTensors foreach
            if self.kernel == "triton":
                live = self._triton_update(live, hyper, finite)
            if live and finite is not None:
                if skip_torch is None:
                    skip_torch = not bool(finite)
                if skip_torch:
                    continue
            for p, g in live:
                if g.dtype != local(self.state[p]["master"]).dtype:
                    g = g.to(local(self.state[p]["master"]).dtype)  # a lone gradient the kernel declined
                parts[self.fused and not is_dtensor(p)].append((p, g))
            for part, how in ((parts[True], dict(fused=True)), (parts[False], dict(foreach=self.foreach))):
                if part:
                    self._update(part, hyper, how)
        self.acc.clear()
        self.clip_coef = None
        return loss

    def _triton_update(self, live: list[tuple[torch.Tensor, torch.Tensor]], hyper: dict[str, Any],
                       finite: torch.Tensor | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Step the parameters ``ops.adamw.fused`` supports; returns the others."""
        from megaseq.ops.adamw import fused as triton_adamw

        mine, rest = [], []
        for p, g in live:
            ok = not is_dtensor(p) and triton_adamw.supports(p.data, g, self.state[p]["master"]) is None
            (mine if ok else rest).append((p, g))
        if mine:
            st = [self.state[p] for p, _ in mine]
            triton_adamw.master_adamw_(
                [p.data for p, _ in mine], [g for _, g in mine], [s["master"] for s in st],
                [s["exp_avg"] for s in st], [s["exp_avg_sq"] for s in st], [s["step"] for s in st],
                self.clip_coef, hyper["lr"], hyper["beta1"], hyper["beta2"], hyper["eps"], hyper["weight_decay"],
                finite)
        return rest

    def _update(self, live: list[tuple[torch.Tensor, torch.Tensor]], hyper: dict[str, Any],
                how: dict[str, Any]) -> None:
        """Clip, AdamW on the masters, round into the weights: one list of parameters of one kind."""
        grads = [g for _, g in live]
        if self.clip_coef is not None:
            if how.get("fused"):
                torch._foreach_mul_(grads, self.clip_coef.to(grads[0].dtype))
            else:
                for g in grads:
                    g.mul_(self.clip_coef.to(g.dtype))
        st = [self.state[p] for p, _ in live]
        masters = [local(s["master"]) for s in st]
        adamw(masters, grads, [local(s["exp_avg"]) for s in st], [local(s["exp_avg_sq"]) for s in st], [],
              [s["step"] for s in st], **how, **hyper)
        if how.get("fused"):
            torch._foreach_copy_([p.data for p, _ in live], masters)  # round to nearest into the weights' dtype
        else:
            for (p, _), m in zip(live, masters):
                local(p).copy_(m)  # round to nearest into the weight's dtype

    # ---- checkpoints -----------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore hyperparameters, steps, moments and masters in place (torch's loader would cast the fp32
        state to the weights' bf16), then the weights from the masters."""
        index = restore_groups(self, state_dict["param_groups"])
        with torch.no_grad():
            for key, saved in state_dict["state"].items():
                p = index[key]
                mine = self.state[p]
                mine["step"].fill_(float(saved["step"]))
                for name in ("master", "exp_avg", "exp_avg_sq"):
                    if saved[name] is not mine[name]:
                        local(mine[name]).copy_(local(saved[name]))
                local(p).copy_(local(mine["master"]))

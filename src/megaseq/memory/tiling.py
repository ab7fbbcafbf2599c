"""Sequence-tiled token-separable modules (MLP, MoE): forward without a graph, backward per tile.

Shapes: N tokens (B*S), H hidden, T tokens per tile, P parameters of the module.

A token-separable module maps each token independently (``y[i]`` depends on ``x[i]`` only), so it
can run over the sequence in tiles. ``tiled_forward`` runs the tiles under ``no_grad`` and keeps only
the input; the backward recomputes one tile at a time with grad enabled and accumulates the input
gradient and the parameter gradients. The working set is one tile's activations (for an MoE: one
tile's dispatch buffers, whatever the routing skew) instead of the whole sequence's.

Side state. A module may leave per-forward state behind (``MoE.last_tokens_per_expert``) or update
buffers in forward (load counters). Over the tiles of one forward, the attributes named in
``TILE_SUMMED_ATTRS`` (or a module's own ``_tile_summed_attrs``) are summed, so they hold the whole
sequence's value, as the untiled forward would. The backward's recompute must not count twice: every
tensor attribute and buffer of every submodule is snapshotted before the recompute and put back after
(``snapshot_side_state`` / ``restore_side_state``, also used by full-layer recompute in ``offload``).

``enable_tiling(module, tile_tokens)`` tiles a module in place (its state-dict names are unchanged);
``TiledModule`` wraps one. Tiling composes with recompute and offload (the layer recompute re-runs
the tiled forward) and with sequence parallelism (each rank tiles its own shard).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from megaseq.ops.amp import autocast_as, autocast_state

# attributes (per submodule) that hold a per-forward count: summed over the tiles of one forward
TILE_SUMMED_ATTRS: tuple[str, ...] = ("last_tokens_per_expert",)
# buffers up to this size are cloned before a recompute and restored after; larger ones (caches)
# must not be mutated in place by the forward, which the restore checks
_SNAPSHOT_BUFFER_BYTES = 16 << 20


# ---- side state ------------------------------------------------------------------------------
def snapshot_side_state(module: nn.Module) -> list[tuple[nn.Module, dict[str, Any], dict[str, Any]]]:
    """References to every submodule's tensor attributes, and buffers (cloned when small)."""
    snap = []
    for m in module.modules():
        attrs = {k: v for k, v in m.__dict__.items() if isinstance(v, torch.Tensor)}
        bufs = {}
        for k, b in m._buffers.items():
            if b is None:
                continue
            small = b.numel() * b.element_size() <= _SNAPSHOT_BUFFER_BYTES
            bufs[k] = (b, b._version, b.clone() if small else None)
        snap.append((m, attrs, bufs))
    return snap


def restore_side_state(snap: list[tuple[nn.Module, dict[str, Any], dict[str, Any]]]) -> None:
    """Undo what a recompute did to tensor attributes and buffers (see ``snapshot_side_state``)."""
    for m, attrs, bufs in snap:
        for k, v in attrs.items():
            m.__dict__[k] = v
        for k, (b, version, copy) in bufs.items():
            m._buffers[k] = b
            if b._version != version:
                assert copy is not None, (
                    f"{type(m).__name__}.{k}: a large buffer was modified in place by a recomputed forward; "
                    "recompute cannot restore it"
                )
                with torch.no_grad():
                    b.copy_(copy)


SummedTotals = dict[tuple[int, str], tuple[nn.Module, torch.Tensor]]


def collect_summed(module: nn.Module, totals: SummedTotals) -> None:
    """Add this tile's (or segment's) value of every summed attribute of ``module``'s submodules to
    ``totals`` (looked up after each forward, since a module may create the attribute in its first)."""
    for m in module.modules():
        for name in dict.fromkeys(tuple(getattr(m, "_tile_summed_attrs", ())) + TILE_SUMMED_ATTRS):
            v = getattr(m, name, None)
            if isinstance(v, torch.Tensor):
                key = (id(m), name)
                prev = totals.get(key)
                totals[key] = (m, v.detach().clone() if prev is None else prev[1] + v.detach())


def set_summed(totals: SummedTotals) -> None:
    """Leave every summed attribute at its total (the whole sequence's value)."""
    for (_, name), (m, total) in totals.items():
        setattr(m, name, total)


def _run_tiles(run: Callable[[torch.Tensor], torch.Tensor], module: nn.Module, tile_tokens: int,
               x_NH: torch.Tensor) -> torch.Tensor:
    """All tiles without a graph; the summed side state ends as the whole sequence's value."""
    totals: SummedTotals = {}
    y_N = None
    with torch.no_grad():
        for a, b in _tiles(x_NH.shape[0], tile_tokens):
            y_T = run(x_NH[a:b])
            if y_N is None:  # one output buffer, written tile by tile (no concatenation copy)
                y_N = y_T.new_empty((x_NH.shape[0],) + tuple(y_T.shape[1:]))
            y_N[a:b] = y_T
            del y_T
            collect_summed(module, totals)
    set_summed(totals)
    assert y_N is not None, "tiled_forward needs at least one token"
    return y_N


def _tiles(N: int, tile_tokens: int) -> list[tuple[int, int]]:
    return [(a, min(a + tile_tokens, N)) for a in range(0, N, tile_tokens)]


def _module_params(module: nn.Module) -> list[torch.Tensor]:
    """The parameters the Function takes as inputs (so autograd routes their gradients through it)."""
    return list(module.parameters())


class _TiledFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, module, tile_tokens, x_NH, *params):
        ctx.run, ctx.module, ctx.tile_tokens = run, module, tile_tokens
        ctx.autocast = autocast_state()
        ctx.save_for_backward(x_NH)
        return _run_tiles(run, module, tile_tokens, x_NH)

    @staticmethod
    def backward(ctx, grad_y_N):
        (x_NH,) = ctx.saved_tensors
        need_x, need_p = ctx.needs_input_grad[3], ctx.needs_input_grad[4:]
        params = _module_params(ctx.module)
        assert len(params) == len(need_p), "the module's parameters changed between forward and backward"
        wanted = [i for i, need in enumerate(need_p) if need]
        grad_x = torch.empty_like(x_NH) if need_x else None
        grad_p: list[torch.Tensor | None] = [None] * len(params)
        snap = snapshot_side_state(ctx.module)
        for a, b in _tiles(x_NH.shape[0], ctx.tile_tokens):
            x_T = x_NH[a:b].detach().requires_grad_(need_x)
            with torch.enable_grad(), autocast_as(ctx.autocast):
                y_T = ctx.run(x_T)
            inputs = ([x_T] if need_x else []) + [params[i] for i in wanted]
            grads = list(torch.autograd.grad(y_T, inputs, grad_y_N[a:b], allow_unused=True))
            del y_T
            if need_x:
                grad_x[a:b] = grads.pop(0)
            for i, g in zip(wanted, grads):
                if g is None:
                    continue
                if grad_p[i] is None:  # the running sum is updated in place: own it
                    grad_p[i] = g if g.untyped_storage().data_ptr() != grad_y_N.untyped_storage().data_ptr() \
                        else g.clone()
                else:
                    grad_p[i].add_(g)
            grads = g = None  # a tile's parameter gradients must not outlive it into the next tile
        restore_side_state(snap)
        return (None, None, None, grad_x, *grad_p)


def tiled_forward(module: nn.Module, x: torch.Tensor, tile_tokens: int,
                  run: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """``module(x)`` for a token-separable module, in tiles of ``tile_tokens`` tokens.

    ``x`` is ``[B, S, H]`` or ``[N, H]``; the module sees ``[T, H]`` tiles of the flattened tokens.
    ``run`` is the function to tile (default ``module``; ``enable_tiling`` passes the unpatched forward).
    Without a graph to build (no grad, or nothing requires grad) the tiles just run.
    """
    if tile_tokens < 1:
        raise ValueError(f"memory.mlp_tile_tokens must be >= 1, got {tile_tokens}")
    run = run or module
    x_NH = x.reshape(-1, x.shape[-1])
    params = _module_params(module)
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
        y_N = _TiledFn.apply(run, module, tile_tokens, x_NH, *params)
    else:
        y_N = _run_tiles(run, module, tile_tokens, x_NH)
    return y_N.reshape(tuple(x.shape[:-1]) + tuple(y_N.shape[1:]))


# ---- applying it ---------------------------------------------------------------------------------
class _TiledForward:
    """The forward that ``enable_tiling`` installs on an instance (keeps the class and state-dict names)."""

    def __init__(self, module: nn.Module, tile_tokens: int) -> None:
        # an instance-level forward someone installed before us is kept and tiled
        self.prior = module.__dict__.get("forward")
        self.inner = self.prior or type(module).forward.__get__(module)
        self.module_ref = module
        self.tile_tokens = tile_tokens

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return tiled_forward(self.module_ref, x, self.tile_tokens, run=self.inner)


def enable_tiling(module: nn.Module, tile_tokens: int) -> nn.Module:
    """Tile ``module``'s forward in place (calling again changes the tile size). Returns the module."""
    if tile_tokens < 1:
        raise ValueError(f"memory.mlp_tile_tokens must be >= 1, got {tile_tokens}")
    current = module.__dict__.get("forward")
    if isinstance(current, _TiledForward):
        current.tile_tokens = tile_tokens
    else:
        module.forward = _TiledForward(module, tile_tokens)
    return module


def disable_tiling(module: nn.Module) -> nn.Module:
    """Undo ``enable_tiling`` (an instance forward installed before it comes back)."""
    current = module.__dict__.get("forward")
    if isinstance(current, _TiledForward):
        del module.forward
        if current.prior is not None:
            module.forward = current.prior
    return module


class TiledModule(nn.Module):
    """A wrapper that runs ``module`` tiled (state-dict names gain a ``module.`` prefix; prefer
    ``enable_tiling`` inside a model)."""

    def __init__(self, module: nn.Module, tile_tokens: int) -> None:
        super().__init__()
        if tile_tokens < 1:
            raise ValueError(f"memory.mlp_tile_tokens must be >= 1, got {tile_tokens}")
        self.module = module
        self.tile_tokens = tile_tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tiled_forward(self.module, x, self.tile_tokens)


# ---- memory formula ------------------------------------------------------------------------------
def tiled_bytes(N: int, H: int, tile_tokens: int, dtype_bytes: int, tile_working_bytes: int,
                param_grad_bytes: int) -> int:
    """GPU bytes of one tiled module across its forward and backward.

    The saved input ``N*H*d`` plus the output ``N*H*d`` (which the untiled module also produces), one
    tile's working set (``tile_working_bytes``: the module's own per-token activations times
    ``tile_tokens``, e.g. an MoE's dispatch buffers for a tile), the input gradient ``N*H*d``, and in
    backward one tile's parameter gradients on top of their running sum (``2 * param_grad_bytes``).
    """
    del tile_tokens  # the caller folds it into tile_working_bytes
    return 3 * N * H * dtype_bytes + tile_working_bytes + 2 * param_grad_bytes

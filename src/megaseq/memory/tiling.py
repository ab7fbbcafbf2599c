"""Token tiling: token-separable computations over the sequence in tiles, each recomputed in backward.

Shapes: N tokens (B*S flattened), H hidden, T tokens per tile.

A token-separable computation maps each token independently (row i of every output depends on row i of
the inputs only), so it can run over the tokens in tiles. The tiles run without a graph and only the
inputs are kept; the backward replays one tile at a time with a graph (``memory.replay``: the forward's
autocast, the side state guarded, per-forward counts summed over the tiles). The working set is one tile's
activations (for an MoE: one tile's dispatch buffers, whatever the routing skew) instead of the whole
sequence's.

Three ways in, all applied from outside the model (a family's ``parallelize``):

- ``enable_tiling(module, T)``: a token-separable module (an MLP or MoE) tiled in place, its state-dict
  names unchanged (``TiledModule`` wraps one instead). With ``residual_only`` (the module's output feeds only
  its layer's residual sum, ``h + mlp(norm(h))``), a layer's rerun in its backward (recompute:
  ``replay.in_layer_rerun``) builds the tiles' graph node without running them: their output's value is read
  by nothing that backpropagates, and the tiles replay from their input in the backward either way;
- ``tile_layer(layer, T)``: a decoder layer that says where its token mixer is (``layer.parts()``, a
  ``models.common.decoder.LayerParts``): everything but the mixer runs tile by tile, so the layer keeps
  its input, the mixer's own saved set and the few tensors between the parts instead of every
  ``[S, N * H]`` temporary of the mHC maps and the MLP's activations;
- ``token_tiled(fn, modules, T, *inputs)``: any token-separable function of several inputs and outputs.

Tiling composes with recompute and offload (the layer recompute reruns the tiled forward) and with
sequence parallelism (each rank tiles its own shard).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from megaseq.memory import forwards
from megaseq.memory.replay import Replay, chunk_bounds, in_layer_rerun, replay

SETTING = "memory.mlp_tile_tokens"
TileFn = Callable[..., tuple[torch.Tensor, ...]]


def token_tiled(fn: TileFn, modules: Sequence[nn.Module], tile: int, *inputs: torch.Tensor,
                outputs_like: Callable[[Sequence[torch.Tensor]], tuple[torch.Tensor, ...]] | None = None
                ) -> tuple[torch.Tensor, ...]:
    """``fn(*inputs)`` for a token-separable ``fn`` (all tensors ``[N, ...]``), over tiles of ``tile`` rows;
    ``modules`` hold every parameter ``fn`` uses. ``outputs_like``: ``Replay.outputs_like`` (the tiles not run
    in the forward, only replayed in the backward)."""
    chunks = chunk_bounds(inputs[0].shape[0], tile, setting=SETTING)
    r = Replay(step=lambda xs, carry, chunk: (tuple(fn(*xs)), None), chunks=chunks, modules=tuple(modules),
               outputs_like=outputs_like)
    return replay(r, *inputs)


def tiled_forward(module: nn.Module, x: torch.Tensor, tile_tokens: int,
                  run: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  outputs_like: Callable[[Sequence[torch.Tensor]], tuple[torch.Tensor, ...]] | None = None
                  ) -> torch.Tensor:
    """``module(x)`` for a token-separable module, in tiles of ``tile_tokens`` tokens.

    ``x`` is ``[B, S, H]`` or ``[N, H]``; the module sees ``[T, H]`` tiles of the flattened tokens.
    ``run`` is the function to tile (default ``module``; ``enable_tiling`` passes the unpatched forward).
    """
    run = run or module
    x_NH = x.reshape(-1, x.shape[-1])
    (y_N,) = token_tiled(lambda x_TH: (run(x_TH),), (module,), tile_tokens, x_NH, outputs_like=outputs_like)
    return y_N.reshape(tuple(x.shape[:-1]) + tuple(y_N.shape[1:]))


# ---- a token-separable module, tiled in place ---------------------------------------------------------
class _TiledForward(forwards.InstanceForward):
    """The forward that ``enable_tiling`` installs on an instance (keeps the class and state-dict names); an
    instance forward installed before it is kept and tiled. ``residual_only``: see the module docstring; the
    output's trailing shape and dtype of the last forward that ran are what a layer's rerun stands in."""

    def __init__(self, module: nn.Module, tile_tokens: int, residual_only: bool = False) -> None:
        super().__init__(module)
        self.module_ref = module
        self.tile_tokens = tile_tokens
        self.residual_only = residual_only
        self.out_meta: tuple[tuple[int, ...], torch.dtype] | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.residual_only and self.out_meta is not None and torch.is_grad_enabled() and in_layer_rerun():
            tail, dtype = self.out_meta
            like = lambda xs: (torch.empty((xs[0].shape[0],) + tail, dtype=dtype, device=xs[0].device),)  # noqa: E731
            return tiled_forward(self.module_ref, x, self.tile_tokens, run=self.inner, outputs_like=like)
        y = tiled_forward(self.module_ref, x, self.tile_tokens, run=self.inner)
        self.out_meta = (tuple(y.shape[x.dim() - 1:]), y.dtype)
        return y


def _check_tile(tile_tokens: int) -> None:
    if tile_tokens < 1:
        raise ValueError(f"{SETTING} must be >= 1, got {tile_tokens}")


def enable_tiling(module: nn.Module, tile_tokens: int, residual_only: bool = False) -> nn.Module:
    """Tile ``module``'s forward in place (calling again changes the settings). ``residual_only``: the module's
    output feeds only its layer's residual sum, so a layer's rerun skips running its tiles (module docstring).
    Returns the module."""
    _check_tile(tile_tokens)
    current = forwards.installed(module, _TiledForward)
    if current is not None:
        current.tile_tokens, current.residual_only = tile_tokens, residual_only
    else:
        module.forward = _TiledForward(module, tile_tokens, residual_only)
    return module


def disable_tiling(module: nn.Module) -> nn.Module:
    """Undo ``enable_tiling`` (an instance forward installed before it comes back)."""
    forwards.remove(module, _TiledForward)
    return module


class TiledModule(nn.Module):
    """A wrapper that runs ``module`` tiled (state-dict names gain a ``module.`` prefix; prefer
    ``enable_tiling`` inside a model)."""

    def __init__(self, module: nn.Module, tile_tokens: int) -> None:
        super().__init__()
        _check_tile(tile_tokens)
        self.module = module
        self.tile_tokens = tile_tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tiled_forward(self.module, x, self.tile_tokens)


# ---- a decoder layer: everything but its token mixer, tiled -------------------------------------------
class _TiledLayerForward:
    """``layer(h, ctx)`` with ``layer.parts()``'s token-separable parts in tiles (``tile_layer``)."""

    def __init__(self, layer: nn.Module, tile_tokens: int) -> None:
        self.layer_ref = layer
        self.tile_tokens = tile_tokens

    def __call__(self, h: torch.Tensor, ctx) -> torch.Tensor:
        p, tile = self.layer_ref.parts(), self.tile_tokens
        B, S = h.shape[:2]
        h_T = h.reshape((B * S,) + tuple(h.shape[2:]))
        *kept, x_TH = token_tiled(p.before, p.before_modules, tile, h_T)
        y = p.mixer(x_TH.view(B, S, -1), ctx)
        (out_T,) = token_tiled(lambda *a: (p.after(*a),), p.after_modules, tile, *kept, y.reshape(B * S, -1), h_T)
        return out_T.view(h.shape)


def tile_layer(layer: nn.Module, tile_tokens: int | None) -> nn.Module:
    """Run ``layer``'s token-separable parts in tiles of ``tile_tokens`` (None: untiled again); the layer
    must provide ``parts()`` (``models.common.decoder.LayerParts``). Returns the layer."""
    current = layer.__dict__.get("forward")
    if isinstance(current, _TiledLayerForward):
        del layer.forward
    if tile_tokens is not None:
        _check_tile(tile_tokens)
        layer.forward = _TiledLayerForward(layer, tile_tokens)
    return layer

"""The chunked replay's input gradients (``memory/replay.py``) against the plain computation in float64: chunks
without halos copy each chunk's gradient into an uninitialised buffer, so every row must be written once; a chunk
whose step does not use an input must leave zeros there; chunks with halos add their overlapping rows."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megaseq.memory import replay as rp

torch.set_num_threads(1)


class _Mix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))


USES_B = {  # which chunks (by first row) multiply by ``b``: the others give it no gradient
    "all": lambda start: True,
    "none": lambda start: False,
    "the first two": lambda start: start < 10,  # the later chunks zero their rows
    "from the second": lambda start: start >= 5,  # the buffer is made after a chunk without one
}


def _step_for(mod: _Mix, uses_b):
    """``(a, b) -> tanh(a @ w) * b`` row-wise, ``* b`` only in the chunks ``uses_b`` names."""

    def step(xs, carry, c):
        a, b = xs
        y = torch.tanh(a @ mod.w)
        if uses_b(c.start):
            y = y * b
        return (y[c.halo:],), None

    return step


def _plain(mod, a, b, chunks, uses_b):
    outs = []
    for c in chunks:
        (y,), _ = _step_for(mod, uses_b)([a[c.lo:c.end], b[c.lo:c.end]], None, c)
        outs.append(y)
    return torch.cat(outs)


def _grads(out, leaves, g):
    return torch.autograd.grad(out, leaves, g, allow_unused=True)


@pytest.fixture(autouse=True)
def _uninitialised_is_nan(monkeypatch):
    """Buffers ``empty_like`` makes hold NaN here, so a row the replay leaves unwritten shows."""
    real = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: real(t, **kw).fill_(float("nan")))


@pytest.mark.parametrize("uses", list(USES_B))
@pytest.mark.parametrize("halo", [0, 2])
def test_input_gradients_match_the_plain_computation(uses, halo):
    uses_b = USES_B[uses]
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(17, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    b = torch.randn(17, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    g = torch.randn(17, 6, dtype=torch.float64, generator=gen)
    mod = _Mix()
    chunks = [rp.Chunk(s, min(s + 5, 17), halo=min(halo, s)) for s in range(0, 17, 5)]  # 5, 5, 5, 2 rows
    want = _grads(_plain(mod, a, b, chunks, uses_b), [a, b, mod.w], g)
    r = rp.Replay(step=_step_for(mod, uses_b), chunks=chunks, modules=(mod,))
    (out,) = rp.replay(r, a, b)
    got = _grads(out, [a, b, mod.w], g)
    for name, x, y in zip(("a", "b", "w"), got, want):
        if y is None:
            assert x is None or not x.any(), name
            continue
        torch.testing.assert_close(x, y, rtol=0, atol=1e-12, msg=name)

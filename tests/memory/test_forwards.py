"""``memory.forwards``: forwards stacked on one module instance, each found and removed wherever it sits."""

import torch
from torch import nn

from megaseq.memory import forwards
from megaseq.memory.tiling import _TiledForward, disable_tiling, enable_tiling


class Add(forwards.InstanceForward):
    def __init__(self, module: nn.Module, k: float) -> None:
        super().__init__(module)
        self.k = k

    def __call__(self, x):
        return self.inner(x) + self.k


class Mul(forwards.InstanceForward):
    def __call__(self, x):
        return self.inner(x) * 10


def test_a_forward_taken_out_of_the_middle_leaves_the_others_calling_through():
    m = nn.Linear(3, 3, bias=False)
    nn.init.eye_(m.weight)
    x = torch.ones(2, 3)
    m.forward = Add(m, 1.0)  # the class's forward, then +1
    m.forward = Mul(m)  # ( ... ) * 10
    m.forward = Add(m, 0.5)  # ( ... ) + 0.5: a second Add, outermost
    assert m(x)[0, 0].item() == (1 + 1) * 10 + 0.5
    assert forwards.installed(m, Mul) is m.forward.prior
    assert forwards.installed(m, Add) is m.forward  # the outermost of a kind
    assert forwards.remove(m, Mul) is not None  # from the middle
    assert m(x)[0, 0].item() == (1 + 1) + 0.5 and forwards.installed(m, Mul) is None
    assert forwards.remove(m, Add).k == 0.5  # the outermost
    assert m(x)[0, 0].item() == 2 and "forward" in m.__dict__
    forwards.remove(m, Add)
    assert "forward" not in m.__dict__ and m(x)[0, 0].item() == 1
    assert forwards.remove(m, Add) is None


def test_tiling_under_another_forward_changes_size_and_comes_off():
    m = nn.Linear(4, 4)
    x = torch.randn(2, 8, 4, dtype=torch.float32)
    want = m(x)
    enable_tiling(m, 3)
    m.forward = Mul(m)  # installed after the tiling
    enable_tiling(m, 5)  # changes the installed tiling's size, not a second one
    tiled = forwards.installed(m, _TiledForward)
    assert tiled.tile_tokens == 5 and tiled.prior is None and isinstance(m.forward, Mul)
    torch.testing.assert_close(m(x), want * 10)
    disable_tiling(m)
    assert forwards.installed(m, _TiledForward) is None and m.forward.prior is None
    torch.testing.assert_close(m(x), want * 10)

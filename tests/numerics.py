"""How the tests compare tensors: errors relative to the reference's largest value, in float64."""

from __future__ import annotations

import torch


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got - want| / max |want|``, computed in float64 (half inputs included)."""
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float) -> None:
    """Relative to max |want|; on failure says where the largest difference is."""
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    diff = (got.double() - want.double()).abs()
    scale = want.double().abs().max().clamp_min(1e-30)
    rel = (diff.max() / scale).item()
    if not rel <= rtol:
        i = int(diff.argmax())
        idx = tuple(int(v) for v in torch.unravel_index(torch.tensor(i), got.shape))
        raise AssertionError(f"{name}: max abs err {diff.max().item():.3e} at {idx} (got {got.flatten()[i].item()}, "
                             f"want {want.flatten()[i].item()}), rel {rel:.3e} > {rtol:.1e}")

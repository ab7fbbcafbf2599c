"""Shared checks of a model family against its transformers reference (float64, CPU).

Each family's test module builds a tiny random HF config (odd sizes, at least two layers of each kind) and
calls these:

- ``make_pair``: the HF ``*ForCausalLM`` with every tensor random (seeded) and the megaseq model of the same
  config loaded from its state dict through the family's adapter (the HF in-memory names, ``model.`` off);
- ``check_logits_and_grads``: logits to 1e-10 relative and every parameter's gradient;
- ``check_packed``: packed documents (``doc_ids``) equal each document run alone;
- ``check_round_trip``: ``save_pretrained`` in small shards -> megaseq -> export -> ``AutoModelForCausalLM``;
- ``hf_promoted``: transformers' modeling module with its literal float32 casts promoted to float64
  outside the classes megaseq keeps literally (norms), as megaseq computes those parts in
  ``promote_types(dtype, float32)`` (docs/architecture.md, "Precision in float64").

Every check raises AssertionError with the worst tensors named, so a family's broken-variant test can
assert that a deliberately wrong block fails it.
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F

from megaseq.models.build import build_model
from megaseq.models.hf_io import export_hf_checkpoint, load_hf_checkpoint
from megaseq.models.spec import from_hf_config

RTOL = 1e-10


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def hf_promoted(module: types.ModuleType, literal: set[str], min_changes: int = 1) -> types.ModuleType:
    """``module`` (a transformers modeling file) re-executed with ``torch.float32`` / ``torch.float`` /
    ``.float()`` turned into float64 except inside the classes or functions named in ``literal``."""
    name = f"{module.__name__}_f64"
    if name in sys.modules:
        return sys.modules[name]
    out, owner, changed = [], None, 0
    for line in open(module.__file__).read().splitlines(keepends=True):
        if m := re.match(r"(?:class|def) (\w+)", line):
            owner = m.group(1)
        if owner not in literal:
            new = re.sub(r"\btorch\.float(32)?\b", "torch.float64", line).replace(".float()", ".double()")
            changed += new != line
            line = new
        out.append(line)
    assert changed >= min_changes, f"{module.__name__}: the float32 casts moved ({changed} found)"
    mod = types.ModuleType(name)
    mod.__file__, mod.__package__ = module.__file__, module.__package__
    sys.modules[name] = mod
    exec(compile("".join(out), f"{module.__file__}[float64]", "exec"), mod.__dict__)
    return mod


def randomize_(model: torch.nn.Module, seed: int, scale: float = 1.0) -> None:
    """Every parameter and buffer random (seeded) at scales that keep every gate and norm non-degenerate."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if not t.is_floating_point() or "inv_freq" in name:
                continue
            r = torch.randn(t.shape, generator=gen, dtype=torch.float64)
            if name.endswith(("norm.weight", "layernorm.weight")):
                r = 1.0 + 0.2 * r if "zero_centered" not in name else 0.2 * r
            elif name.endswith("dt_bias"):
                r = -4.0 + 0.5 * r
            elif t.dim() >= 2:
                r = scale * r * t.shape[-1] ** -0.5
            else:
                r = 0.5 * r
            t.copy_(r.to(t.dtype))


def make_pair(hf_cls: type, cfg, seed: int, prefix: str = "model.", randomize=randomize_):
    """(HF model, megaseq model) with the same random weights, both float64 and in eval mode."""
    torch.manual_seed(seed)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    hf = hf_cls(cfg).to(torch.float64).eval()
    randomize(hf, seed)
    spec = from_hf_config(cfg.to_dict())
    ours = build_model(spec, dtype=torch.float64, seed=seed).eval()
    state = {k.removeprefix(prefix): v for k, v in hf.state_dict().items() if "rotary_emb" not in k}
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return hf, ours


def compare_grads(hf: torch.nn.Module, ours: torch.nn.Module, rtol: float = RTOL, prefix: str = "model.") -> float:
    """Every HF parameter's gradient equals megaseq's (both None/zero or within ``rtol``); the worst error."""
    mine = dict(ours.named_parameters())
    worst, bad = 0.0, []
    for name, p in hf.named_parameters():
        q = mine[name.removeprefix(prefix)]
        hf_none = p.grad is None or not p.grad.any()
        our_none = q.grad is None or not q.grad.any()
        assert hf_none == our_none, f"{name}: HF grad none/zero {hf_none}, megaseq {our_none}"
        if hf_none:
            continue
        err = rel_err(q.grad, p.grad)
        worst = max(worst, err)
        if err > rtol:
            bad.append(f"{name}: {err:.2e}")
    assert not bad, f"{len(bad)} gradients differ, e.g. " + "; ".join(bad[:4])
    return worst


def check_logits_and_grads(hf, ours, ids: torch.Tensor, rtol: float = RTOL, seed: int = 0) -> tuple[float, float]:
    """Logits and every gradient of ``(logits * g).sum()`` (g random); returns (logit error, worst grad)."""
    ref = hf(input_ids=ids).logits
    got = ours.logits(ours(ids))
    err = rel_err(got, ref)
    assert err < rtol, f"logits differ: {err:.2e}"
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    (ref * g).sum().backward()
    (got * g).sum().backward()
    return err, compare_grads(hf, ours, rtol)


def check_packed(hf, ours, lengths: list[list[int]], vocab: int, rtol: float = RTOL, seed: int = 0) -> float:
    """Rows of packed documents (``doc_ids``) against each document run alone in HF; grads accumulate."""
    gen = torch.Generator().manual_seed(seed)
    S = sum(lengths[0])
    assert all(sum(r) == S for r in lengths)
    ids = torch.randint(1, vocab, (len(lengths), S), generator=gen)
    doc_ids = torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in lengths])
    logits = ours.logits(ours(ids, doc_ids=doc_ids))
    g = torch.randn(logits.shape, generator=gen, dtype=torch.float64)
    (logits * g).sum().backward()
    worst = 0.0
    for b, row in enumerate(lengths):
        start = 0
        for n in row:
            ref = hf(input_ids=ids[b:b + 1, start:start + n]).logits
            err = rel_err(logits[b:b + 1, start:start + n], ref)
            assert err < rtol, f"row {b}, document at {start} (length {n}): {err:.2e}"
            worst = max(worst, err)
            (ref * g[b:b + 1, start:start + n]).sum().backward()
            start += n
    compare_grads(hf, ours, rtol)
    return worst


def check_round_trip(hf, tmp: Path, ids: torch.Tensor, arch: str, prepare=None, rtol: float = RTOL) -> Path:
    """``save_pretrained`` (small shards) -> megaseq (``load_hf_checkpoint``) -> ``export_hf_checkpoint`` ->
    ``AutoModelForCausalLM.from_pretrained``: the class ``arch`` and its logits equal the original's.
    ``prepare(model)`` applies the test's float64 promotions to the reloaded HF model."""
    import transformers

    keep32 = list(getattr(hf, "_keep_in_fp32_modules_strict", None) or []) + list(
        getattr(hf, "_keep_in_fp32_modules", None) or [])
    with torch.no_grad():  # HF reloads these in float32 whatever the dtype: make them exactly float32 values
        for name, t in list(hf.named_parameters()) + list(hf.named_buffers()):
            if any(k in name for k in keep32) and t.is_floating_point():
                t.copy_(t.float().double())
    src = tmp / "hf"
    hf.save_pretrained(src, max_shard_size="40KB")
    assert (src / "model.safetensors.index.json").is_file(), "the test checkpoint should be sharded"
    spec = from_hf_config(src)
    model = build_model(spec, dtype=torch.float64, seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))  # anything not loaded would poison the logits
    load_hf_checkpoint(src, model=model, spec=spec)
    want = hf(input_ids=ids).logits
    assert rel_err(model.logits(model(ids)), want) < rtol, "megaseq after load_hf_checkpoint"
    out = export_hf_checkpoint(model, spec, tmp / "export", max_shard_bytes=60_000)
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
    assert type(back).__name__ == arch, type(back).__name__
    back.config._experts_implementation = "eager"
    back.config._attn_implementation = "eager"
    back = (prepare(back) if prepare else back).to(torch.float64).eval()
    assert rel_err(back(input_ids=ids).logits, want) < rtol, "transformers after the megaseq export"
    assert from_hf_config(out) == spec
    return out


def ce_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

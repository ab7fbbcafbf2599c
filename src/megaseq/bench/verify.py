"""``megaseq verify``: which kernel every layer runs, and parity with the transformers reference.

1. Builds the configured model (a model too large for this machine is cut to its first layers of
   each kind, shapes unchanged), runs one forward and backward on random tokens long enough that
   the DSA selection is sparse, and prints the dispatcher's per-layer table. With
   ``model.strict_kernels`` a layer that fell back from its planned kernel is an error.
2. If ``transformers`` is installed and the model is small, compares megaseq's logits with the
   reference implementation on the same weights (float64, CPU) and prints the largest difference.
"""

from __future__ import annotations

import logging
import math
import tempfile

import torch

from megaseq.bench.hf_model import load_reference_model
from megaseq.config import Config
from megaseq.console import TO_STDOUT
from megaseq.models.spec import ModelSpec
from megaseq.ops import dispatch
from megaseq.ops.kernels import planned_kernels

logger = logging.getLogger(__name__)


def say(text: str) -> None:
    """A line of the verification report (stdout, through the CLI's log handler)."""
    logger.info(text, extra=TO_STDOUT)


MAX_VERIFY_PARAMS = 2_000_000_000
PARITY_MAX_PARAMS = 50_000_000


def param_count(spec: ModelSpec) -> int:
    """Parameters of ``spec`` counted on the meta device (no memory)."""
    from megaseq.models.build import build_model

    model = build_model(spec, dtype=torch.float32, device="meta")
    return sum(p.numel() for p in model.parameters())


def shrink(spec: ModelSpec) -> ModelSpec:
    """The first layer of each (layer kind, mlp kind) pair, in order: same shapes, fewer layers."""
    keep, seen = [], set()
    for i, key in enumerate(zip(spec.layer_types, spec.mlp_types)):
        if key not in seen:
            seen.add(key)
            keep.append(i)
    pick = lambda t: tuple(t[i] for i in keep) if t else t  # noqa: E731
    indexer = list(pick(spec.indexer_types))
    if "dsa" in spec.layer_types:  # the first DSA layer must run its own indexer
        indexer[[spec.layer_types[i] for i in keep].index("dsa")] = "full"
    return spec.replace(num_layers=len(keep), layer_types=pick(spec.layer_types), mlp_types=pick(spec.mlp_types),
                        indexer_types=tuple(indexer))


def _seq_len(spec: ModelSpec) -> int:
    if "dsa" in spec.layer_types:  # longer than the top-k so the selection is sparse
        return min(max(2 * spec.index_topk + spec.index_kpool + 3, 64), 8192)
    return 64


def kernel_table(spec: ModelSpec, device: torch.device, strict: bool) -> str:
    from megaseq.models.build import build_model

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(spec, dtype=dtype, device=device, seed=0)
    planned = planned_kernels(device.type, "bf16" if dtype == torch.bfloat16 else "fp32")
    dispatch.configure(planned=planned, strict=strict)
    dispatch.reset_records()
    S = _seq_len(spec)
    ids = torch.randint(0, spec.vocab_size, (1, S), device=device)
    doc_ids = torch.zeros(1, S, dtype=torch.int32, device=device)
    doc_ids[:, S // 2:] = 1  # two packed documents exercise the document-bounded paths
    hidden = model(ids, doc_ids=doc_ids)
    hidden.float().square().mean().backward()
    return dispatch.format_table()


def _break_ties_(model: torch.nn.Module, scale: float = 0.05) -> None:
    """Seeded noise on every floating parameter, so the check runs on weights without the fresh init's
    structure (unit norm weights and zero biases, on which an indexer's ReLU'd head scores tie exactly; the
    selection breaks such ties as transformers' ``torch.topk`` does when a document is scored whole on the
    CPU, as here)."""
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def hf_parity(spec: ModelSpec) -> float:
    """Max |megaseq - transformers| / max |transformers| of the logits, float64 on the CPU."""
    from megaseq.models.build import build_model
    from megaseq.models.hf_io import export_hf_checkpoint

    model = build_model(spec, dtype=torch.float64, device="cpu", seed=1)
    _break_ties_(model)
    with tempfile.TemporaryDirectory() as tmp:
        export_hf_checkpoint(model, spec, f"{tmp}/hf")
        ref = load_reference_model(f"{tmp}/hf", dtype=torch.float64)
    S = _seq_len(spec)
    ids = torch.randint(0, spec.vocab_size, (1, S), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.logits(model(ids))
        theirs = ref(input_ids=ids).logits
    return float((ours - theirs).abs().max() / theirs.abs().max().clamp_min(1e-30))


def verify(cfg: Config) -> bool:
    from megaseq.models.presets import resolve_spec

    spec = resolve_spec(cfg.model.name)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n = param_count(spec)
    say(f"model {cfg.model.name}: {spec.family}, {spec.num_layers} layers, {n / 1e9:.3f}B parameters")
    run_spec = spec
    if n > MAX_VERIFY_PARAMS or (device.type == "cpu" and n > PARITY_MAX_PARAMS):
        run_spec = shrink(spec)
        say(f"  too large to run here: checking {run_spec.num_layers} layers, one of each kind, same shapes")
    try:
        say(kernel_table(run_spec, device, cfg.model.strict_kernels))
    except dispatch.KernelFallbackError as e:
        say(f"kernel check failed: {e}")
        return False
    try:
        import transformers  # noqa: F401
    except ImportError:
        say("parity: skipped (transformers is not installed: pip install 'megaseq[hf]')")
        return True
    if param_count(run_spec) > PARITY_MAX_PARAMS:
        say("parity: skipped for a model this large (run the parity tests on a tiny config: pytest -k parity)")
        return True
    err = hf_parity(run_spec)
    # transformers computes norms, routers and softmaxes in float32 even in a float64 model: ~1e-7
    ok = math.isfinite(err) and err < 1e-5
    say(f"parity with transformers (float64, CPU): max relative logit difference {err:.2e} "
          f"{'ok' if ok else 'FAILED'}")
    return ok

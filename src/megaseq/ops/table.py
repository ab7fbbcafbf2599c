"""Every compute op, its reference and its fast implementations: the one registration table.

The dispatcher (``ops.dispatch``) reads an op's rows the first time the op is called and imports their modules
then; ``model.kernels`` (``ops.kernels``) and the planner (``plan.planner.planned_fast_ops``) read the same rows.
Nothing registers by being imported: an implementation that is not a row here never runs.

A row names the implementation, where it lives (module and callable) and, for a fast one, its ``supports``
check (``None`` when it can run these arguments, else the reason) and the packages it needs. An ``Op`` adds
what the fast set (``model.kernels fast`` on a GPU) puts first, whether the memory plan counts that kernel's
working set, and the implementation a bf16 GPU run is planned to use (``model.strict_kernels``).

Adding a kernel: its module in ``ops/<op>/``, one ``Impl`` row below, its test in ``tests/ops/<op>/``
(checked against the reference on the GPU).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Impl:
    """One implementation of an op."""

    name: str  # the implementation's name in the dispatcher's records (``megaseq verify``)
    module: str  # the module that defines it, imported when the op is first called
    fn: str  # the callable in ``module``
    supports: str | None = None  # a callable in ``module``: None when it can run the arguments, else why not
    reference: bool = False  # the pure-torch reference every other implementation is checked against
    opt_in: bool = False  # tried only where a run prefers or plans it (the fast set), not by default
    packages: tuple[str, ...] = ()  # importable packages it needs beyond torch


@dataclass(frozen=True)
class Op:
    """One op: its implementations (the reference among them) and its place in the kernel sets."""

    name: str
    impls: tuple[Impl, ...]
    fast: str | None = None  # the implementation ``model.kernels fast`` puts first on a GPU
    fast_fallbacks: tuple[str, ...] = ()  # where ``fast`` declines (a dtype, a shape), tried before the others
    plan_counts_fast: bool = False  # the memory plan counts ``fast``'s working set (where its packages are)
    gpu_bf16: str | None = None  # the implementation a bf16 run on CUDA is planned to use (``strict_kernels``)


_OPS = "megaseq.ops"
TRITON = ("triton",)
FLA = ("triton", "fla")

OPS: tuple[Op, ...] = (
    Op("attention", (
        Impl("torch_reference", "megaseq.models.common.attention", "attention_reference", reference=True),
        Impl("torch_exact", "megaseq.models.common.attention", "attention_exact", opt_in=True),
        Impl("sdpa", "megaseq.models.common.attention", "attention_sdpa", "_sdpa_supports"),
    ), gpu_bf16="sdpa"),
    Op("sink_attention", (
        Impl("torch_reference", "megaseq.models.common.sink_attention", "sink_attention_reference", reference=True),
        Impl("sdpa", "megaseq.models.common.sink_attention", "sink_attention_sdpa", "_sdpa_supports"),
    )),
    Op("rms_norm", (
        Impl("torch", f"{_OPS}.rms_norm.reference", "rms_norm_reference", reference=True),
        Impl("torch_chunked", f"{_OPS}.rms_norm.reference", "rms_norm_torch"),
        Impl("triton", f"{_OPS}.rms_norm.fused", "rms_norm_triton", "rms_norm_triton_supports", opt_in=True,
             packages=TRITON),
    ), fast="triton", plan_counts_fast=True),
    Op("rope", (
        Impl("torch", f"{_OPS}.rope.reference", "rope_reference", reference=True),
        Impl("liger", f"{_OPS}.rope.liger", "rope_liger", "liger_rope_supports", opt_in=True,
             packages=("triton", "liger_kernel")),
    ), fast="liger"),
    Op("swiglu", (
        Impl("torch", f"{_OPS}.swiglu.reference", "swiglu", reference=True),
        Impl("triton", f"{_OPS}.swiglu.fused", "swiglu_triton", "swiglu_triton_supports", opt_in=True,
             packages=TRITON),
    ), fast="triton", plan_counts_fast=True),
    Op("clamped_swiglu", (
        Impl("torch", f"{_OPS}.swiglu.reference", "clamped_swiglu", reference=True),
    )),
    Op("grouped_mm", (
        Impl("torch_loop", f"{_OPS}.moe_glue.reference", "grouped_mm_reference", reference=True),
        Impl("torch_grouped_mm", f"{_OPS}.moe_glue.reference", "grouped_mm_fast", "_grouped_mm_supports"),
    ), gpu_bf16="torch_grouped_mm"),
    Op("moe_permute", (
        Impl("torch", f"{_OPS}.moe_glue.reference", "moe_permute_reference", reference=True),
        Impl("triton", f"{_OPS}.moe_glue.fused", "moe_permute_triton", "moe_permute_triton_supports", opt_in=True,
             packages=TRITON),
    ), fast="triton"),
    Op("moe_combine", (
        Impl("torch", f"{_OPS}.moe_glue.reference", "moe_combine_reference", reference=True),
        Impl("triton", f"{_OPS}.moe_glue.fused", "moe_combine_triton", "moe_combine_triton_supports", opt_in=True,
             packages=TRITON),
    ), fast="triton"),
    Op("hc_mix", (
        Impl("torch", f"{_OPS}.mhc.reference", "hc_mix_reference", reference=True),
        Impl("torch_fused", f"{_OPS}.mhc.mix_fused", "hc_mix_fused", "hc_mix_fused_supports", opt_in=True),
        Impl("triton", f"{_OPS}.mhc.mix_triton", "hc_mix_triton", "hc_mix_triton_supports", opt_in=True,
             packages=TRITON),
    ), fast="triton", fast_fallbacks=("torch_fused",), plan_counts_fast=True),
    Op("hc_weights", (
        Impl("torch", f"{_OPS}.mhc.reference", "hc_weights_reference", reference=True),
        Impl("triton", f"{_OPS}.mhc.weights_triton", "hc_weights_triton", "hc_weights_triton_supports",
             opt_in=True, packages=TRITON),
    ), fast="triton", plan_counts_fast=True),
    Op("hc_collapse", (
        Impl("torch", f"{_OPS}.mhc.reference", "hc_collapse_reference", reference=True),
        Impl("triton", f"{_OPS}.mhc.streams_triton", "hc_collapse_triton", "hc_collapse_triton_supports",
             opt_in=True, packages=TRITON),
    ), fast="triton"),
    Op("hc_merge", (
        Impl("torch", f"{_OPS}.mhc.reference", "hc_merge_reference", reference=True),
        Impl("triton", f"{_OPS}.mhc.streams_triton", "hc_merge_triton", "hc_merge_triton_supports", opt_in=True,
             packages=TRITON),
    ), fast="triton", plan_counts_fast=True),
    Op("sparse_attention", (
        Impl("torch_masked", f"{_OPS}.sparse_mla.reference", "sparse_mla_reference", reference=True),
        Impl("absorbed", f"{_OPS}.sparse_mla.absorbed", "sparse_mla", "sparse_mla_supports"),
        Impl("triton", f"{_OPS}.sparse_mla.fused", "triton_sparse_mla", "triton_sparse_mla_supports", opt_in=True,
             packages=TRITON),
    ), fast="triton", plan_counts_fast=True, gpu_bf16="absorbed"),
    Op("indexer_topk", (
        Impl("torch_fp32", f"{_OPS}.indexer.scoring", "select_pools", reference=True),
        Impl("triton", f"{_OPS}.indexer.topk", "indexer_topk_triton", "indexer_topk_supports", opt_in=True,
             packages=TRITON),
    ), fast="triton", plan_counts_fast=True),
    Op("indexer_target", (
        Impl("torch_gather", f"{_OPS}.indexer.target", "indexer_target_reference", reference=True),
        Impl("triton", f"{_OPS}.indexer.target", "indexer_target_triton", "indexer_target_supports", opt_in=True,
             packages=TRITON),
    ), fast="triton", plan_counts_fast=True),
    Op("indexer_kl", (
        Impl("torch_gather", f"{_OPS}.indexer.kl", "indexer_kl_reference", reference=True),
        Impl("triton", f"{_OPS}.indexer.kl", "indexer_kl_triton", "indexer_kl_supports", opt_in=True,
             packages=TRITON),
    ), fast="triton", plan_counts_fast=True),
    Op("causal_conv", (
        Impl("torch_conv1d", f"{_OPS}.kda.reference", "causal_conv_reference", reference=True),
        Impl("fla", f"{_OPS}.kda.fla", "conv_fla", "conv_fla_supports", packages=FLA),
    ), gpu_bf16="fla"),
    Op("kda", (
        Impl("torch_chunked", f"{_OPS}.kda.reference", "kda_reference", reference=True),
        Impl("fla_chunk", f"{_OPS}.kda.fla", "kda_fla", "kda_fla_supports", packages=FLA),
    ), gpu_bf16="fla_chunk"),
    Op("kda_gate", (
        Impl("torch", f"{_OPS}.kda.reference", "kda_gate_reference", reference=True),
        Impl("fla", f"{_OPS}.kda.fla", "kda_gate_fla", "kda_gate_fla_supports", opt_in=True, packages=FLA),
    ), fast="fla", plan_counts_fast=True),
    Op("gated_rms_norm", (
        Impl("torch", f"{_OPS}.gated_norm.reference", "gated_rms_norm_reference", reference=True),
        Impl("fla", f"{_OPS}.gated_norm.fla", "gated_rms_norm_fla", "gated_rms_norm_fla_supports", opt_in=True,
             packages=FLA),
    ), fast="fla", plan_counts_fast=True),
    Op("gdn", (
        Impl("torch_chunked", f"{_OPS}.gdn.reference", "gdn_reference", reference=True),
        Impl("fla_chunk", f"{_OPS}.gdn.fla", "gdn_fla", "gdn_fla_supports", packages=FLA),
    ), gpu_bf16="fla_chunk"),
    Op("linear_cross_entropy", (
        Impl("torch", f"{_OPS}.vocab_loss.reference", "plain_linear_cross_entropy", reference=True),
        Impl("liger", f"{_OPS}.vocab_loss.liger", "linear_cross_entropy_liger", "liger_loss_supports", opt_in=True,
             packages=("triton", "liger_kernel")),
    ), fast="liger", plan_counts_fast=True),
    Op("chunked_linear_cross_entropy", (
        Impl("torch_chunked", "megaseq.memory.vocab_loss", "chunked_linear_cross_entropy", reference=True),
        Impl("liger", f"{_OPS}.vocab_loss.liger", "chunked_linear_cross_entropy_liger", "chunked_liger_supports",
             opt_in=True, packages=("triton", "liger_kernel")),
    ), fast="liger"),
)

BY_NAME: dict[str, Op] = {op.name: op for op in OPS}


def fast_impl(op: Op) -> Impl:
    """The row of ``op.fast``."""
    return next(i for i in op.impls if i.name == op.fast)


def problems(ops: tuple[Op, ...] = OPS) -> list[str]:
    """What is wrong with ``ops``, one line each (empty: every row resolves): a module that does not import, a
    callable it lacks, an op without exactly one reference, a fast, fallback or planned name without a row."""
    import importlib

    found: list[str] = []
    for op in ops:
        names = [i.name for i in op.impls]
        if len(set(names)) != len(names):
            found.append(f"{op.name}: implementation names repeat: {names}")
        if sum(i.reference for i in op.impls) != 1:
            found.append(f"{op.name}: needs exactly one reference, has {[i.name for i in op.impls if i.reference]}")
        for name in (op.fast, *op.fast_fallbacks, op.gpu_bf16):
            if name is not None and name not in names:
                found.append(f"{op.name}: {name!r} is named but has no row (rows: {names})")
        for impl in op.impls:
            try:
                module = importlib.import_module(impl.module)
            except ImportError as e:
                found.append(f"{op.name}={impl.name}: module {impl.module} does not import ({e})")
                continue
            for attr in (impl.fn, impl.supports):
                if attr is not None and not callable(getattr(module, attr, None)):
                    found.append(f"{op.name}={impl.name}: {impl.module} has no callable {attr!r}")
    return found

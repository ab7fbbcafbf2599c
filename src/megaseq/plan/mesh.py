"""What a plan runs on: the byte units, the GPU mesh (``Mesh``), the dtypes per class of tensor
(``Precision``, ``precision_for``) and the named coefficients a measured H200 peak recalibrates
(``Calibration``).

Pure Python (no torch), like every module of the planner.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

GIB = 2**30


GB = 10**9


# ---- mesh and dtypes -----------------------------------------------------------------------------
FSDP_MODES = ("off", "dp", "dp_cp")


@dataclass(frozen=True)
class Mesh:
    """The GPUs of a run: ``world = dp * ep * cp`` (megaseq.parallel.mesh lays ranks out the same way).

    ``fsdp`` (``parallel.fsdp``) shards parameters, gradients and optimizer state per layer (FSDP2): over the
    dp x ep ranks (``dp``, replicated over cp) or over the whole world (``dp_cp``); ``off`` replicates them.
    Under expert parallelism the routed experts are not among them: each GPU holds its ``E / ep`` experts
    whole, their gradients and optimizer state too (``expert_params``).
    ``True`` / ``False`` are read as ``dp_cp`` / ``off``.
    ``mla_mode``: how DSA/MLA layers go context-parallel (``auto``, ``gather_kv`` or ``ulysses``).
    """

    dp: int = 1
    cp: int = 1
    ep: int = 1
    gpus_per_host: int = 1
    fsdp: bool | str = "off"
    mla_mode: str = "auto"

    def __post_init__(self) -> None:
        for name in ("dp", "cp", "ep", "gpus_per_host"):
            if getattr(self, name) < 1:
                raise ValueError(f"mesh {name} must be >= 1, got {getattr(self, name)}")
        if self.mla_mode not in ("auto", "gather_kv", "ulysses"):
            raise ValueError(f"parallel.mla_mode must be auto, gather_kv or ulysses, got {self.mla_mode!r}")
        if isinstance(self.fsdp, bool):
            object.__setattr__(self, "fsdp", "dp_cp" if self.fsdp else "off")
        if self.fsdp not in FSDP_MODES:
            raise ValueError(f"parallel.fsdp must be off, dp or dp_cp, got {self.fsdp!r}")

    @property
    def world(self) -> int:
        return self.dp * self.ep * self.cp

    @property
    def gpus_on_host(self) -> int:
        """GPUs sharing one host's RAM (a world smaller than a host uses only part of it)."""
        return min(self.world, self.gpus_per_host)

    @property
    def hosts(self) -> int:
        return -(-self.world // self.gpus_per_host)

    @property
    def shard(self) -> int:
        """Ranks the parameters, gradients and optimizer state are split over."""
        return {"off": 1, "dp": self.dp * self.ep, "dp_cp": self.world}[self.fsdp]

    @property
    def sharded(self) -> bool:
        """Whether FSDP runs (it shards over more than one rank)."""
        return self.shard > 1


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each class of tensor."""

    param: int = 4  # parameters on the GPU (fp32 weights under autocast, or bf16 weights)
    grad: int = 4
    moments: int = 8  # AdamW exp_avg + exp_avg_sq
    compute: int = 2  # matmul outputs (bf16 under autocast)
    stream: int = 4  # residual stream, norm outputs, embeddings: the parameter dtype
    f32: int = 4  # what the blocks compute "in float32" (promote_types(dtype, fp32))
    autocast: bool = True  # a linear casts its fp32 input: each linear saves its own bf16 copy
    master: int = 0  # the optimizer's fp32 master copy of bf16 weights (MasterAdamW), made with the optimizer
    norm: int = 0  # the norms' weights (0: the parameter dtype); a frozen bf16 base: 2, so their outputs are bf16
    frozen_norms: bool = False  # the norms' weights get no gradient: their normalised value is not kept


FP32_WEIGHTS = Precision()  # fp32 parameters under bf16 autocast (the trainer's default)
BF16_WEIGHTS = Precision(param=2, grad=2, moments=8, compute=2, stream=2, f32=4, autocast=False, master=4)


@functools.lru_cache(maxsize=64)  # a plan asks for it per term; Precision is frozen
def precision_for(model_dtype: str = "bf16", weights: str = "fp32", frozen_embedding: bool = False,
                  frozen_norms: bool = False) -> Precision:
    """The trainer's dtypes (``train/build.py: dtypes``) for a GPU run.

    bf16: fp32 parameters + bf16 autocast, or with ``model.weights bf16`` bf16 parameters (no autocast, a
    bf16 residual stream) and the optimizer's fp32 master beside them (``BF16_WEIGHTS``). fp32 / fp64:
    everything in that dtype. ``frozen_embedding`` / ``frozen_norms``: a frozen base stored in bf16 (LoRA)
    with the embedding / the norms among it, so the residual stream / the norms' outputs are bf16 as in the
    transformers bf16 model; autocast still casts the fp32 adapters. (With bf16 weights the base is bf16
    already: only the norms' kept value changes.)"""
    if model_dtype == "fp64":
        return Precision(param=8, grad=8, moments=16, compute=8, stream=8, f32=8, autocast=False,
                         frozen_norms=frozen_norms)
    if model_dtype == "fp32":
        return Precision(param=4, grad=4, moments=8, compute=4, stream=4, f32=4, autocast=False,
                         frozen_norms=frozen_norms)
    if model_dtype != "bf16":
        raise ValueError(f"model.dtype must be bf16, fp32 or fp64, got {model_dtype!r}")
    if weights not in ("fp32", "bf16"):
        raise ValueError(f"model.weights must be fp32 or bf16, got {weights!r}")
    if weights == "bf16":
        return replace(BF16_WEIGHTS, frozen_norms=frozen_norms)
    return Precision(stream=2 if frozen_embedding else 4, norm=2 if frozen_norms else 0, frozen_norms=frozen_norms)


@dataclass(frozen=True)
class Calibration:
    """Named coefficients of the working-set formulas (to be fitted to measured H200 peaks).

    Temporaries are in units of (bytes x width) per token, e.g. ``kda_fwd_temp_cd = 7`` means
    ``7 * c * D`` bytes per token above the saved set while a KDA layer's forward runs.
    """

    kda_conv_copies: int = 1  # fla's causal_conv1d saves only its input (SiLU fused, recomputed); the
    # torch reference conv would keep its output too (2)
    kda_fwd_temp_cd: float = 7.0  # fla chunk_kda: contiguous q/k/v copies, w, u, kg, v_new, o
    kda_bwd_temp_fd: float = 0.0  # fla backward: its fp32 grads (fitted to 0 on the H200, see docs/planner.md)
    kda_segment_bwd_temp_fd: float = 8.0  # the same, for one recomputed segment (segmented KDA, H200)
    kda_bwd_temp_cd: float = 4.0  # fla backward: recomputed w, u, v_new, conv grads
    mlp_fwd_temp_ci: float = 2.0  # SwiGLU forward temporaries (x c x I per token or row)
    mlp_bwd_temp_ci: float = 4.0  # SwiGLU backward: grads of gate/up/activation
    moe_fwd_temp_rows: float = 2.0  # per routed row, x (xb x H): gathered x / weighted y / unsorted y (H200)
    moe_bwd_temp_rows: float = 1.4  # per routed row, x (xb x H): grads of the rows and of y (H200)
    attn_block_elems: int = 1 << 26  # score elements per query block of the reference sparse attention
    nograd_fraction: float = 0.35  # peak of a layer's no-grad forward, as a fraction of its saved set
    sinkhorn_saved: bool = True  # Sinkhorn's 2*iters-1 divisions each save [N, N] + [N] in fp32
    hc_mix_torch: bool = False  # the fast set with hc_mix as the closed-form torch op
    # (ops/mhc/mix_fused.py, its input's copy kept in the GEMM's dtype; the Triton op keeps none) and KDA's gated norm
    # the reference; True plans a run whose fast set runs those two
    process_host_bytes: int = 2_010_000_000  # one training process: Python, torch, CUDA host state, data
    # (H200, torch 2.11: VmHWM 1.95-2.07 GB, mean 2.01 GB, over 14 runs of glm5-flash-1gpu 8K-1M and
    # glm5-flash-tiny 128K-1M without offload, benchmarks/results/speed/runs/2026-11-29_base-kernels/)
    cuda_context_bytes: int = int(0.6 * GIB)  # CUDA context + cuBLAS/cuDNN workspaces, outside torch's count
    allocator_fixed: int = 2 * GIB  # caching-allocator reserve: a fixed part ...
    allocator_fraction: float = 0.05  # ... plus 5% of the tensors for fragmentation


CAL = Calibration()

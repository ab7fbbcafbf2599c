"""What one evaluation of a memory setting reads and returns: ``Run`` (the model, the lengths, the mesh,
the dtypes, the memory settings and the fast ops), ``LayerTerms`` (one layer's saved set and temporaries)
and ``Evaluation`` (the peak, its phase and its breakdown, the host bytes).

Pure Python. ``layer_terms`` fills ``LayerTerms``, ``phases.evaluate`` sweeps them into an ``Evaluation``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megaseq.config import ExpertDispatchSettings, MemorySettings
from megaseq.models.spec import ModelSpec
from megaseq.plan.components import ParamCounts
from megaseq.plan.mesh import CAL, Calibration, Mesh, Precision, precision_for


@dataclass(frozen=True)
class Run:
    """Everything one evaluation depends on; ``memory`` the settings evaluated (a dict of ``MemorySettings``
    fields is read into one)."""

    spec: ModelSpec
    seq_len: int
    batch: int
    mesh: Mesh
    model_dtype: str
    memory: MemorySettings
    counts: ParamCounts
    mla_mode: str = "gather_kv"
    imbalance: float = 4.0
    grad_accum: int = 1
    sparse_impl: str = "absorbed"  # ops/sparse_mla/absorbed.py on the GPU; "torch_masked" is the CPU reference
    packed_documents: bool = False  # data with document boundaries (text): no segmented KDA
    loss_in_compute_dtype: bool = True  # the trainer casts hidden + head for the loss (False: in the stream's dtype)
    cal: Calibration = CAL
    ep_dispatch: ExpertDispatchSettings = ExpertDispatchSettings()  # how routed rows travel when mesh.ep > 1
    weights: str = "fp32"  # model.weights: fp32 (+ autocast) or bf16 (fp32 master in the optimizer)
    reduce_dtype: str = "fp32"  # parallel.reduce_dtype: the FSDP reduce-scatter's dtype
    # ops whose fast kernel (``model.kernels fast``) the plan counts instead of the reference's working set:
    # "rms_norm", "swiglu", "indexer_topk", "indexer_target", "indexer_kl", "sparse_attention", "hc_merge"
    # (Triton), "hc_mix" (fused torch), "linear_cross_entropy" (Liger); every other op keeps the base set's
    # (for the fast kernels an upper bound). ``ops.kernels.planned_fast_ops`` picks them for a config.
    fast_ops: frozenset[str] = frozenset()
    indexer_objective: bool = False  # model.train_indexer: each full-indexer layer adds its KL objective

    def __post_init__(self) -> None:
        if isinstance(self.memory, dict):
            object.__setattr__(self, "memory", MemorySettings.from_dict(self.memory))

    @property
    def prec(self) -> Precision:
        """Dtypes of ``model.dtype`` and ``model.weights`` (``mesh.precision_for``); a frozen bf16 base
        with its embedding makes the residual stream bf16, with its norms their outputs bf16."""
        tr = self.counts.trained
        frozen = tr is not None
        return precision_for(self.model_dtype, self.weights, frozen and tr.embed == 0, frozen and not tr.norms)

    @property
    def reduce_bytes(self) -> int:
        """Bytes per element of FSDP's reduce-scatter (fp64 parameters reduce in fp64)."""
        return max(self.prec.param, 4 if self.reduce_dtype == "fp32" else 2)

    @property
    def accumulates(self) -> bool:
        """Several backward passes per step (micro-batches, sequence segments): gradients accumulate."""
        return self.grad_accum > 1 or bool(self.segment)

    @property
    def segment(self) -> int:
        """Tokens per sequence segment (``memory.model_segment_tokens``), 0 when the step is not segmented."""
        T = self.memory.model_segment_tokens
        return T if 0 < T < self.seq_len else 0

    @property
    def n(self) -> int:
        """Tokens one GPU runs at once: ``B * S / cp``, or ``B * T`` under sequence segments."""
        return self.batch * (self.segment or self.seq_len) // self.mesh.cp

    @property
    def n_seq(self) -> int:
        """Tokens of the sequence one GPU holds: ``B * S / cp``."""
        return self.batch * self.seq_len // self.mesh.cp


@dataclass
class LayerTerms:
    """One layer: saved bytes by name (attention half, MLP half) and its temporaries."""

    attn: dict[str, int]
    ffn: dict[str, int]
    mixer_fwd: int
    mixer_bwd: int
    mlp_fwd: int
    mlp_bwd: int
    merge_fwd: int  # the mHC merge's forward temporaries (after either half)
    wgrad: int  # one weight's gradient temporary (the largest tensor of the layer)
    boundary_term: int  # the part of ``attn`` that is the layer input itself
    tiled: bool = False  # the MLP runs tiled: its weights are not held by the layer's graph
    kept_attention: int = 0  # what the layer holds from forward to backward when it keeps attention's output
    kept_attention_host: int = 0  # the pinned bytes of those kept in host memory (aligned per tensor)

    @property
    def saved(self) -> int:
        return sum(self.attn.values()) + sum(self.ffn.values())

    @property
    def before_mixer_output(self) -> int:
        """The attention half's saved bytes while the mixer's working set peaks: before its output
        stage (o_proj's input, the merge) and, for DSA, before the selection exists."""
        late = ("o_proj input", "merge", "selection")
        return sum(v for k, v in self.attn.items() if not any(w in k for w in late))


@dataclass
class Evaluation:
    peak_tensors: int
    peak_gpu: int  # + allocator reserve + CUDA context
    phase: str
    breakdown: dict[str, int]
    notes: dict[str, str]
    phases: dict[str, int]
    host_per_gpu: dict[str, int]
    peak_host: int  # per host
    saved_terms: dict[str, int] = field(default_factory=dict)
    # the first step's tensor peak: the optimizer's state is created by its first update, so the forward,
    # loss and backward of the first step run without it (what a one-step measurement reads)
    first_step_tensors: int = 0
    offloaded_layers: int = 0  # layer inputs SCO puts in pinned host memory in each forward

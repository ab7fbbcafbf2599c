"""The settings the runtime and the planner read as typed objects: the device mesh and the expert dispatch
(``ParallelConfig``, ``ExpertDispatchSettings``) and the exact memory schemes (``MemorySettings``, and
``MemoryConfig``, which adds the planner's own settings). Each field's checks are its metadata
(``config.fields``); the rules between fields are ``config.checks``. No torch import here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from megaseq import schemes
from megaseq.config.fields import opt, validate

EP_DISPATCH = ("pipelined_llep", "llep", "plain")
OFF = " (0: off)"


@dataclass(frozen=True)
class ExpertDispatchSettings:
    """How routed tokens reach experts on other ep ranks (``parallel/expert.py``, docs/expert_parallel.md);
    read from ``parallel.ep_*`` / ``parallel.llep_*`` by ``ParallelConfig.ep_dispatch_settings``."""

    mode: str = opt("pipelined_llep", "pipelined_llep, llep or plain", name="ep_dispatch", choices=EP_DISPATCH)
    chunk_tokens: int = opt(8192, "c: tokens per source per chunk (PipelinedLLEP)", name="ep_chunk_tokens", ge=1)
    max_chunks: int = opt(32, "K_max", name="ep_max_chunks", ge=1)
    alpha: float = opt(1.1, "LLEP per-GPU cap: alpha * total / ep", name="llep_alpha", ge=1.0,
                       note=" (the GPUs' caps must hold every row)")
    threshold: float = opt(1.3, "LLEP only when max / mean GPU load exceeds this", name="llep_threshold")
    min_tokens: int = opt(512, "no spilled piece smaller than this", name="llep_min_tokens", ge=1)

    def __post_init__(self) -> None:
        validate(self, "parallel")


    @property
    def balances(self) -> bool:
        """LLEP plans the dispatch (above the threshold)."""
        return self.mode != "plain"

    @property
    def pipelined(self) -> bool:
        """Chunked dispatch, each chunk recomputed in backward (the dispatch buffer bounded)."""
        return self.mode == "pipelined_llep"


@dataclass
class ParallelConfig:
    """The device mesh: data-parallel x expert-parallel x context-parallel, and the expert dispatch."""

    dp: int = opt(1, "data-parallel size (-1: whatever the world size leaves after cp and ep)", ge=1, also=(-1,),
                  note=" or -1 (fill the world)")
    cp: int = opt(1, "context-parallel (Ulysses) size: each rank holds seq_len / cp tokens", ge=1)
    ep: int = opt(1, "expert-parallel size: each rank holds num_experts / ep experts; ep ranks read different "
                  "sequences (a data axis for every other parameter)", ge=1)
    launcher: str = opt("auto", "auto (torchrun env if present, else one process), ray, or none",
                        choices=("auto", "torchrun", "ray", "none"))
    num_workers: int = opt(1, "Ray workers (with --parallel.launcher ray)", ge=1)
    backend: str = opt("auto", "collective backend: auto (nccl on GPU, gloo on CPU), nccl or gloo",
                       choices=("auto", "nccl", "gloo"))
    mla_mode: str = opt("auto", "how DSA/MLA layers go context-parallel: ulysses, gather_kv or auto",
                        choices=("auto", "ulysses", "gather_kv"))
    loss_parallel: str = opt("auto", "vocabulary loss over the cp group: ring_dtp, local or auto",
                             choices=("auto", "ring_dtp", "local"))
    ep_dispatch: str = opt("pipelined_llep", "expert dispatch with ep > 1: pipelined_llep (LLEP in chunks, each "
                           "recomputed in backward: the dispatch buffer bounded whatever the routing), llep (one "
                           "all-to-all, LLEP-balanced) or plain (one all-to-all, every expert serves its own rows)",
                           choices=EP_DISPATCH)
    ep_chunk_tokens: Any = opt("8K", "pipelined_llep: tokens each rank sends per chunk (c); the chunks are "
                               "K = min(ceil(N / c), ep_max_chunks)", size=True, ge=1)
    ep_max_chunks: int = opt(32, "pipelined_llep: the most chunks per MoE layer (K_max)", ge=1)
    llep_alpha: float = opt(1.1, "LLEP: per-GPU cap = llep_alpha * rows / ep (>= 1)", ge=1.0,
                             note=" (the GPUs' caps must hold every row)")
    llep_threshold: float = opt(1.3, "LLEP: balance only when the busiest GPU's rows exceed this times the mean "
                                "(>= llep_alpha)")
    llep_min_tokens: Any = opt(512, "LLEP: no expert's rows are spilled to another GPU in a piece smaller than this",
                               size=True, ge=1)
    fsdp: str = opt("off", "FSDP2: shard parameters, gradients and optimizer state per layer over the dp ranks (dp) "
                           "or over dp x cp (dp_cp), or off (every rank holds all of them)",
                       choices=("off", "dp", "dp_cp"))
    reduce_dtype: str = opt("fp32", "dtype gradients are reduced in across ranks: fp32 or bf16 (fp64 parameters "
                                    "reduce in fp64)", choices=("fp32", "bf16"))


    def __post_init__(self) -> None:
        validate(self, "parallel")

    def ep_dispatch_settings(self) -> ExpertDispatchSettings:
        """The typed dispatch settings the runtime and the planner read."""
        return ExpertDispatchSettings(mode=self.ep_dispatch, chunk_tokens=self.ep_chunk_tokens,
                                      max_chunks=self.ep_max_chunks, alpha=self.llep_alpha,
                                      threshold=self.llep_threshold, min_tokens=self.llep_min_tokens)

    def axis_sizes(self, world_size: int) -> tuple[int, int, int]:
        """(dp, cp, ep) for ``world_size`` processes; one clear ValueError for each misfit."""
        inner = self.cp * self.ep
        if world_size % inner:
            raise ValueError(
                f"world size {world_size} is not a multiple of parallel.cp * parallel.ep = {self.cp} * {self.ep}: "
                f"launch a multiple of {inner} processes or lower --parallel.cp / --parallel.ep"
            )
        dp = world_size // inner if self.dp == -1 else self.dp
        if dp * inner != world_size:
            raise ValueError(
                f"parallel.dp * cp * ep = {self.dp} * {self.cp} * {self.ep} = {dp * inner} but the world size is "
                f"{world_size}: set --parallel.dp {world_size // inner} (or -1 to fill the world)"
            )
        return dp, self.cp, self.ep


@dataclass
class MemorySettings:
    """The exact memory schemes of one run and their chunk sizes: what ``megaseq plan`` chooses (its
    ``memory``), what ``memory.auto false`` forces, and what a family's ``parallelize`` applies. One typed,
    torch-free object; ``MemoryConfig`` adds the planner's own settings."""

    chunked_loss: bool = opt(False, "vocabulary projection + cross-entropy chunk by chunk (online log-sum-exp)")
    loss_chunk_tokens: Any = opt("8K", "tokens per chunk of the chunked loss", size=True, ge=1)
    tiled_mlp: bool = opt(False, "run MLP/MoE layers over the sequence in tiles, recomputing in backward")
    mlp_tile_tokens: Any = opt("16K", "tokens per MLP/MoE tile", size=True, ge=1)
    indexer_query_chunk: Any = opt("1K", "DSA indexer: queries scored per block (bounds scoring memory)", size=True,
                                  ge=1)
    recompute: bool = opt(False, "full recompute per layer; only the (4-stream) layer input is kept")
    keep_attention_layers: int = opt(0, "under recompute, the last N layers keep softmax attention's output and "
                                        "log-sum-exp from the forward, so the rerun skips attention's kernel "
                                        "(o + lse bytes per token held until the layer's backward; 0: off; with "
                                        "auto, as many as fit with 5% to spare)", ge=0)
    keep_attention_host_layers: int = opt(0, "of the layers keeping attention's output, the first N (in forward "
                                             "order) keep it in pinned host memory instead of the GPU: copied out "
                                             "after the layer's forward, back a layer ahead of its rerun (at most "
                                             "two layers' worth on the GPU at once; <= keep_attention_layers; 0: "
                                             "all on the GPU; with auto, the layers beyond those that fit on the "
                                             "GPU, where the host has room and the copies hide behind the "
                                             "compute)", ge=0)
    checkpoint_offload: bool = opt(False, "SCO: copy layer boundaries to pinned host memory (needs recompute)")
    offload_host_budget: Any = opt("64G", "host bytes SCO may pin for boundaries (accepts 64G)", size=True, ge=0,
                                  note=OFF)
    optimizer_offload: bool = opt(False, "OffloadStreamAdamW: master weights, moments and grads in host memory")
    optimizer_bucket_params: Any = opt("100M", "parameters per OffloadStreamAdamW bucket", size=True, ge=1)
    kda_segment_tokens: Any = opt(0, "KDA layers over the sequence in segments of this many tokens, the recurrent "
                                     "state carried, each segment recomputed in backward (0: off; one rank, "
                                     "no packed documents)", size=True, ge=0, note=OFF)
    model_segment_tokens: Any = opt(0, "sequence segments: the whole model over the sequence this many tokens at a "
                                       "time, each layer's state (KDA state, DSA latents) carried, each segment "
                                       "rerun in backward; replaces recompute/SCO/tiling at long lengths (0: off; "
                                       "glm5 models; a multiple of parallel.cp, each segment split over the cp "
                                       "ranks)", size=True, ge=0, note=OFF)
    segment_keep_selection: bool = opt(False, "under sequence segments, keep each DSA selection of the forward pass "
                                              "for the backward (int32 [S, topk + 15] per DSA layer) instead of "
                                              "scoring again (saves the indexer's second pass; with auto, used "
                                              "where it fits with 5% to spare; not yet measured on a GPU)")
    segment_kv_host: bool = opt(False, "under sequence segments, keep the softmax-attention and MLA layers' earlier "
                                       "keys/values (or latents) and their fp32 gradients in pinned host memory, "
                                       "copied to the GPU a layer ahead (at most about two layers' worth there); "
                                       "with auto, chosen only where the GPU-resident store does not fit")
    stream_base: bool = opt(False, "a frozen base (LoRA, train.trainable) kept in pinned host memory, each decoder "
                                   "layer's frozen weights copied to the GPU a layer ahead of use (forward, "
                                   "recompute, backward); at most 2 layers on the GPU; with parallel.fsdp each rank "
                                   "streams its own shards")


    def __post_init__(self) -> None:
        validate(self, "memory")

    def check_combination(self) -> None:
        """ValueError naming the settings when these schemes cannot run together (settings that will run as
        given: forced ones, and what the planner chose, which never combines them): the schemes' ``requires``
        and ``excludes`` (``megaseq.schemes``)."""
        schemes.check_combination(self)
        if self.keep_attention_layers and not self.recompute:
            raise ValueError(f"memory.keep_attention_layers={self.keep_attention_layers} keeps attention's output "
                             "for the layers' recompute: set --memory.recompute true or "
                             "--memory.keep_attention_layers 0")
        if self.keep_attention_host_layers > self.keep_attention_layers:
            raise ValueError(f"memory.keep_attention_host_layers={self.keep_attention_host_layers} exceeds "
                             f"memory.keep_attention_layers={self.keep_attention_layers}: the host-kept layers are "
                             "the first of the kept ones; set --memory.keep_attention_layers "
                             f"{self.keep_attention_host_layers} (or more) or --memory.keep_attention_host_layers "
                             f"{self.keep_attention_layers} (or fewer)")
        if self.segment_kv_host and not self.model_segment_tokens:
            raise ValueError("memory.segment_kv_host keeps sequence segments' keys and values in host memory: set "
                             "--memory.model_segment_tokens (e.g. 64K) or --memory.segment_kv_host false")

    def to_dict(self) -> dict[str, Any]:
        """The settings alone (a plan's ``memory``), in field order."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(MemorySettings)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MemorySettings:
        """From a plan's ``memory`` (or ``to_dict``); an unknown key is an error naming it, never dropped."""
        names = [f.name for f in dataclasses.fields(MemorySettings)]
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise ValueError(f"unknown memory settings {unknown} (a plan from another megaseq version?); "
                             f"known: {', '.join(names)}")
        return MemorySettings(**d)

    def replace(self, **changes: Any) -> MemorySettings:
        return dataclasses.replace(self, **changes)


@dataclass
class MemoryConfig(MemorySettings):
    """Exact memory schemes. With `auto`, the planner picks the cheapest set that fits."""

    auto: bool = opt(True, "let the planner choose the schemes and chunk sizes below (set false to force them)")
    gpu_budget: Any = opt("auto", "GPU bytes the plan may use (auto: the device's total less a reserve)", size=True,
                          also=("auto",))
    host_budget: Any = opt("auto", "host bytes the plan may use (auto: 90% of physical RAM)", size=True,
                           also=("auto",))


    def __post_init__(self) -> None:
        validate(self, "memory")

    def settings(self) -> MemorySettings:
        """The scheme settings as configured (what ``auto false`` runs)."""
        return MemorySettings.from_dict(self.to_dict())

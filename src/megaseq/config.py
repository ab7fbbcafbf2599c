"""Typed configuration: one dataclass per component, YAML recipes, dotted overrides.

Each field carries its help text in ``metadata["help"]``; the CLI builds ``--help`` from it, and its
bounds (``ge``, ``gt``, ``le``, ``lt``, ``choices``), which ``check_bounds`` enforces when a section is built.
Unknown keys are rejected with the closest valid name; values of the wrong type (an integer given as 2.7, a
number given as ``true``, a non-finite number), a YAML key given twice and a section that is not a mapping
are each one ValueError naming the setting (and the file and line), before anything else runs. No torch
import here.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megaseq import schemes
from megaseq.schemes import SEGMENT_EXCLUDED, SEGMENT_SETTING, SIZE_SETTINGS  # noqa: F401  (re-exported)


def opt(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with help text (mutable defaults go through default_factory)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


_SIZE_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _with_unit(s: str, units: dict[str, float]) -> float | None:
    """``s`` times its unit suffix's multiplier ('1.5K' -> 1536.0 with K = 1024); None when not a number."""
    mult = 1.0
    if s and s[-1] in units:
        s, mult = s[:-1], units[s[-1]]
    try:
        return float(s) * mult
    except ValueError:
        return None


def parse_size(value: Any, setting: str | None = None) -> int:
    """'32K' -> 32768, '1M' -> 1048576, '4G' -> 4 * 2**30, '1.5K' -> 1536; ints pass through. A value that is
    not a whole number (2.7, '1.3K'), not finite, or a bool is a ValueError (naming ``setting`` when given)."""
    where = f"{setting} " if setting else ""
    if isinstance(value, bool):
        raise ValueError(f"{where}expects an integer (like 4096 or 32K), got {value!r}")
    if isinstance(value, int):
        return value
    v = _with_unit(str(value).strip().upper().replace("_", ""), _SIZE_UNITS)
    if v is None or not math.isfinite(v) or not v.is_integer():
        raise ValueError(f"{where}expects an integer (like 4096, 32K or 1M), got {value!r}")
    return int(v)


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600}


def parse_duration(value: Any, setting: str | None = None) -> float:
    """'90s' -> 90.0, '20m' -> 1200.0, '1.5h' -> 5400.0, 300 -> 300.0 (seconds); '' or None -> 0.0 (no limit).
    A negative, non-finite, unreadable or bool value is a ValueError (naming ``setting`` when given)."""
    where = f"{setting} " if setting else ""
    if value is None or value == "":
        return 0.0
    v = None if isinstance(value, bool) else _with_unit(str(value).strip().lower(), _DURATION_UNITS)
    if v is None or not math.isfinite(v) or v < 0:
        raise ValueError(f"{where}expects a duration (like 600, 90s, 20m or 2h), got {value!r}")
    return v


def check_bounds(obj: Any, section: str) -> None:
    """Enforce each field's ``ge`` / ``gt`` / ``le`` / ``lt`` / ``choices`` metadata (None passes: unset)."""
    for f in dataclasses.fields(obj):
        value, m = getattr(obj, f.name), f.metadata
        values = value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if v is None or isinstance(v, str) and "choices" not in m:
                continue
            if "choices" in m and v not in m["choices"]:
                raise ValueError(f"{section}.{f.name} must be one of {', '.join(map(str, m['choices']))}, got {v!r}")
            for key, ok, word in (("ge", lambda a, b: a >= b, ">="), ("gt", lambda a, b: a > b, ">"),
                                  ("le", lambda a, b: a <= b, "<="), ("lt", lambda a, b: a < b, "<")):
                if key in m and isinstance(v, (int, float)) and not ok(v, m[key]):
                    what = "each entry of " if isinstance(value, (list, tuple)) else ""
                    raise ValueError(f"{what}{section}.{f.name} must be {word} {m[key]}, got {value!r}"
                                     f"{m.get('fix', '')}")


def hf_weights_in(path: str | None) -> bool:
    """Whether ``path`` is a Hugging Face checkpoint directory holding safetensors weights."""
    p = Path(path) if path else None
    return p is not None and p.is_dir() and any((p / f).is_file() for f in HF_WEIGHT_FILES)


HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


@dataclass
class ModelConfig:
    """The architecture and where its weights come from."""

    name: str = opt("glm5-flash-tiny", "preset name (`megaseq config model` lists them) or a path to a "
                    "Hugging Face checkpoint directory or config.json")
    init_from: str | None = opt(None, "HF checkpoint directory (safetensors) to load weights from; unset: "
                                "`name` itself when it is a checkpoint directory with weights, else random init "
                                "(give `name` as DIR/config.json to train a checkpoint's architecture from random)")
    dtype: str = opt("bf16", "compute dtype on the GPU: bf16, fp32 or fp64 (the CPU default job uses fp32)")
    strict_kernels: bool = opt(False, "fail when a layer falls back from its planned fast kernel")
    weights: str = opt("fp32", "parameter dtype: fp32 (fp32 weights, bf16 compute by autocast) or bf16 (bf16 weights "
                       "on the GPU, half the weight and gradient bytes; the optimizer keeps fp32 master weights "
                       "and moments, sharded with --parallel.fsdp, in host memory with memory.optimizer_offload; "
                       "needs model.dtype bf16)")
    kernels: str = opt("fast", "GPU kernels: fast (the Triton kernels for sparse MLA, the indexer top-k, mHC, SwiGLU, "
                                "RMSNorm and the MoE glue, and Liger's loss, each checked against its reference; "
                                "an op a kernel cannot run falls back to its reference, reported after the first "
                                "step) or base (the set the memory plan is calibrated on: fla's KDA, the absorbed "
                                "sparse MLA, SDPA, grouped GEMMs, torch elsewhere); the plan is an upper bound "
                                "for fast")
    train_indexer: bool = opt(False, "train the DSA lightning indexer with its KL objective (DeepSeek-V3.2's): the "
                              "main attention's probabilities summed over heads, over the selected keys, as the "
                              "target of the indexer's softmax, the indexer's inputs detached (docs/indexer.md)")
    indexer_loss_coef: float = opt(0.001, "coefficient of the indexer's KL term (a mean over the step's tokens, per "
                                   "DSA layer); 0.001 is Megatron-Bridge's default for DeepSeek-V3.2 and GLM-5",
                                   ge=0.0)
    dsa_warmup_steps: int = opt(0, "with model.train_indexer: the first N optimizer steps are the dense warm-up "
                                "(every DSA layer attends every visible key, the main model frozen, LoRA adapters "
                                "too, only the indexers train); then the sparse stage", ge=0)

    def __post_init__(self) -> None:
        check_bounds(self, "model")
        if self.dsa_warmup_steps and not self.train_indexer:
            raise ValueError(f"model.dsa_warmup_steps {self.dsa_warmup_steps} warms up the indexer, which trains only "
                             "with model.train_indexer: set --model.train_indexer true (or dsa_warmup_steps 0)")
        if self.train_indexer and self.indexer_loss_coef == 0:
            raise ValueError("model.train_indexer with model.indexer_loss_coef 0 trains nothing: set a coefficient "
                             "(0.001 is the reference's) or --model.train_indexer false")
        if self.init_from is None and hf_weights_in(self.name):
            self.init_from = self.name  # a checkpoint directory with weights: train from them, not from random
        if self.dtype not in ("bf16", "fp32", "fp64"):
            raise ValueError(f"model.dtype must be bf16, fp32 or fp64, got {self.dtype!r}")
        if self.kernels == "default":  # an older name of the base set, still in existing run directories
            self.kernels = "base"
        if self.kernels not in ("fast", "base"):
            raise ValueError(f"model.kernels must be fast or base, got {self.kernels!r}")
        if self.weights not in ("fp32", "bf16"):
            raise ValueError(f"model.weights must be fp32 or bf16, got {self.weights!r}")
        if self.weights == "bf16" and self.dtype != "bf16":
            raise ValueError(f"model.weights bf16 computes in bf16: it needs model.dtype bf16 (got {self.dtype}); "
                             "set --model.dtype bf16 or --model.weights fp32")


@dataclass
class DataConfig:
    """Training and held-out data."""

    kind: str = opt("fasta", "fasta (DNA, or protein families with data.alphabet protein), text (JSONL, .txt or "
                    "columnar files through a HF tokenizer), chat (conversations with a 'messages' list, through the "
                    "checkpoint's chat template) or random (memory tests)")
    train: list[str] = opt([], "training files (FASTA: .fa/.fasta[.gz|.xz]; text: .jsonl/.txt); "
                           "empty means the lambda phage genome shipped with megaseq")
    heldout: list[str] = opt([], "held-out files (a whole genome or chromosome the model never sees)")
    heldout_records: list[str] = opt([], "FASTA record ids to hold out of the training files instead")
    heldout_tail: float = opt(-1.0, "hold out the last fraction of every training record (a region split); "
                              "-1: 0.1 when training on the built-in genome with nothing else held out, else 0")
    seq_len: Any = opt(4096, "tokens per training sequence (accepts 32K, 1M)")
    reverse_complement: bool = opt(False, "also draw reverse-complement windows (DNA)")
    related: int = opt(0, "DNA: windows of this many homologous regions of different strains of one species "
                       "(a file is a strain, its species the name before the first '_'); held-out genomes are "
                       "scored after related - 1 training strains' regions (docs/long_context.md). 0: off")
    related_jitter: float = opt(0.0, "DNA, with data.related: each training window's region lengths drawn at "
                                "random, each at least (1 - this) of an equal share. 0: equal lengths, so homologous "
                                "bases sit the same distance apart in every window, and a model can learn that "
                                "fixed-offset copy instead of matching content (docs/long_context.md)", ge=0.0, lt=1.0)
    lowercase: str = opt("upper", "lower-case bases (soft-masked repeats): upper (keep as bases) or n (as N)")
    non_acgt: str = opt("n", "IUPAC ambiguity codes other than ACGTN: n (map to N) or error")
    tokenizer: str = opt("dna", "dna or protein (the single-letter tokenizer of data.alphabet) or a path to a HF "
                         "tokenizer.json / checkpoint dir")
    text_field: str = opt("text", "JSONL field holding the document text")
    txt_docs: str = opt("file", ".txt files: one document per file (file) or per blank-line paragraph (paragraph)")
    seed: int = opt(0, "seed for window sampling", ge=0)
    alphabet: str = opt("dna", "data.kind fasta: dna (nucleotides) or protein (families of homologs, FASTA or A3M; "
                        "20 amino acids, B Z X U O and a gap, docs/data.md)", choices=("dna", "protein"))
    gaps: str = opt("keep", "protein: the gap '-' of aligned families (A3M) as a token (keep) or removed, giving "
                    "unaligned homologs (drop)", choices=("keep", "drop"))
    protein_docs: str = opt("family", "protein: one document per family file, each protein attending to the "
                            "homologs before it (family), or one per protein (protein)", choices=("family", "protein"))
    loss_roles: list[str] = opt(["assistant"], "chat: the roles whose tokens the loss counts (system, developer, user, "
                                "assistant, tool)")
    column: str = opt("", "the field or column holding the data in JSONL, parquet, Arrow or datasets directories; "
                      "empty: messages (chat), data.text_field (text)")

    def __post_init__(self) -> None:
        self.seq_len = parse_size(self.seq_len, "data.seq_len")
        if self.alphabet == "protein" and self.tokenizer == "dna":
            self.tokenizer = "protein"  # the alphabet's own single-letter tokenizer
        if self.alphabet == "dna" and self.tokenizer == "protein":
            raise ValueError("data.tokenizer protein reads protein sequences: set --data.alphabet protein")
        check_bounds(self, "data")
        if self.kind not in ("fasta", "text", "chat", "random"):
            raise ValueError(f"data.kind must be fasta, text, chat or random, got {self.kind!r}")
        if self.seq_len < 2:
            raise ValueError(f"data.seq_len must be at least 2, got {self.seq_len}")
        if self.lowercase not in ("upper", "n"):
            raise ValueError(f"data.lowercase must be 'upper' or 'n', got {self.lowercase!r}")
        if self.txt_docs not in ("file", "paragraph"):
            raise ValueError(f"data.txt_docs must be 'file' or 'paragraph', got {self.txt_docs!r}")
        if not (self.heldout_tail == -1.0 or 0.0 <= self.heldout_tail < 1.0):
            raise ValueError(f"data.heldout_tail must be in [0, 1) (or -1 for the default), got {self.heldout_tail}")
        if self.non_acgt not in ("n", "error"):
            raise ValueError(f"data.non_acgt must be 'n' or 'error', got {self.non_acgt!r}")
        self._check_kind_settings()
        if self.related_jitter and not self.related:
            raise ValueError(f"data.related_jitter {self.related_jitter} varies the regions of related windows, but "
                             "data.related is 0 (off): set data.related (2 or more regions) or leave the jitter at 0")


    def _check_kind_settings(self) -> None:
        """Settings of one kind of data given for another have no effect: refused, naming the setting."""
        protein = self.alphabet == "protein"
        if protein and self.kind != "fasta":
            raise ValueError(f"data.alphabet protein reads FASTA / A3M families (data.kind fasta), not data.kind "
                             f"{self.kind}; set --data.kind fasta or --data.alphabet dna")
        if not protein and (self.gaps != "keep" or self.protein_docs != "family"):
            raise ValueError("data.gaps and data.protein_docs apply to protein families: set --data.alphabet protein "
                             "or leave them at their defaults")
        if self.kind != "chat" and list(self.loss_roles) != ["assistant"]:
            raise ValueError(f"data.loss_roles applies to conversations (data.kind chat), not data.kind {self.kind}; "
                             "leave it at its default")
        if self.column and self.kind not in ("text", "chat") and not protein:
            raise ValueError(f"data.column names the column of text, conversations or protein sequences; data.kind "
                             f"{self.kind} with DNA reads none: leave it empty")


EP_DISPATCH = ("pipelined_llep", "llep", "plain")


@dataclass(frozen=True)
class ExpertDispatchSettings:
    """How routed tokens reach experts on other ep ranks (``parallel/expert.py``, docs/expert_parallel.md);
    read from ``parallel.ep_*`` / ``parallel.llep_*`` by ``ParallelConfig.ep_dispatch_settings``."""

    mode: str = "pipelined_llep"  # pipelined_llep, llep or plain
    chunk_tokens: int = 8192  # c: tokens per source per chunk (PipelinedLLEP)
    max_chunks: int = 32  # K_max
    alpha: float = 1.1  # LLEP per-GPU cap: alpha * total / ep
    threshold: float = 1.3  # LLEP only when max / mean GPU load exceeds this
    min_tokens: int = 512  # no spilled piece smaller than this

    def __post_init__(self) -> None:
        if self.mode not in EP_DISPATCH:
            raise ValueError(f"parallel.ep_dispatch must be one of {', '.join(EP_DISPATCH)}, got {self.mode!r}")
        for name, flag in (("chunk_tokens", "ep_chunk_tokens"), ("max_chunks", "ep_max_chunks"),
                           ("min_tokens", "llep_min_tokens")):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{flag} must be >= 1, got {getattr(self, name)}")
        if self.alpha < 1.0:
            raise ValueError(f"parallel.llep_alpha must be >= 1 (the GPUs' caps must hold every row), got "
                             f"{self.alpha}")
        if self.threshold < self.alpha:
            raise ValueError(f"parallel.llep_threshold ({self.threshold}) must be >= parallel.llep_alpha "
                             f"({self.alpha}): below it LLEP could make the busiest GPU busier; raise "
                             "--parallel.llep_threshold")

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

    dp: int = opt(1, "data-parallel size (-1: whatever the world size leaves after cp and ep)")
    cp: int = opt(1, "context-parallel (Ulysses) size: each rank holds seq_len / cp tokens")
    ep: int = opt(1, "expert-parallel size: each rank holds num_experts / ep experts; ep ranks read different "
                  "sequences (a data axis for every other parameter)")
    launcher: str = opt("auto", "auto (torchrun env if present, else one process), ray, or none")
    num_workers: int = opt(1, "Ray workers (with --parallel.launcher ray)")
    backend: str = opt("auto", "collective backend: auto (nccl on GPU, gloo on CPU), nccl or gloo",
                       choices=("auto", "nccl", "gloo"))
    mla_mode: str = opt("auto", "how DSA/MLA layers go context-parallel: ulysses, gather_kv or auto",
                        choices=("auto", "ulysses", "gather_kv"))
    loss_parallel: str = opt("auto", "vocabulary loss over the cp group: ring_dtp, local or auto",
                             choices=("auto", "ring_dtp", "local"))
    ep_dispatch: str = opt("pipelined_llep", "expert dispatch with ep > 1: pipelined_llep (LLEP in chunks, each "
                           "recomputed in backward: the dispatch buffer bounded whatever the routing), llep (one "
                           "all-to-all, LLEP-balanced) or plain (one all-to-all, every expert serves its own rows)")
    ep_chunk_tokens: Any = opt("8K", "pipelined_llep: tokens each rank sends per chunk (c); the chunks are "
                               "K = min(ceil(N / c), ep_max_chunks)")
    ep_max_chunks: int = opt(32, "pipelined_llep: the most chunks per MoE layer (K_max)")
    llep_alpha: float = opt(1.1, "LLEP: per-GPU cap = llep_alpha * rows / ep (>= 1)")
    llep_threshold: float = opt(1.3, "LLEP: balance only when the busiest GPU's rows exceed this times the mean "
                                "(>= llep_alpha)")
    llep_min_tokens: Any = opt(512, "LLEP: no expert's rows are spilled to another GPU in a piece smaller than this")
    fsdp: str = opt("off", "FSDP2: shard parameters, gradients and optimizer state per layer over the dp ranks (dp) "
                           "or over dp x cp (dp_cp), or off (every rank holds all of them)")
    reduce_dtype: str = opt("fp32", "dtype gradients are reduced in across ranks: fp32 or bf16 (fp64 parameters "
                                    "reduce in fp64)")

    def __post_init__(self) -> None:
        check_bounds(self, "parallel")
        for name in ("cp", "ep", "num_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        if self.launcher not in ("auto", "ray", "none", "torchrun"):
            raise ValueError(f"parallel.launcher must be auto, torchrun, ray or none, got {self.launcher!r}")
        if self.fsdp not in ("off", "dp", "dp_cp"):
            raise ValueError(f"parallel.fsdp must be off, dp or dp_cp, got {self.fsdp!r}")
        if self.reduce_dtype not in ("fp32", "bf16"):
            raise ValueError(f"parallel.reduce_dtype must be fp32 or bf16, got {self.reduce_dtype!r}")
        if self.fsdp != "off" and self.ep > 1:
            raise ValueError("parallel.fsdp with parallel.ep > 1 is not supported yet (the experts would need an "
                             "FSDP mesh without the ep axis): set --parallel.fsdp off or --parallel.ep 1")
        self.ep_chunk_tokens = parse_size(self.ep_chunk_tokens)
        self.llep_min_tokens = parse_size(self.llep_min_tokens)
        if self.ep_dispatch_settings() != ExpertDispatchSettings() and self.ep == 1:  # (validates them too)
            warnings.warn("parallel.ep_dispatch / ep_* / llep_* have no effect with parallel.ep 1 (every expert "
                          "is on every rank)", stacklevel=2)

    def ep_dispatch_settings(self) -> ExpertDispatchSettings:
        """The typed dispatch settings the runtime and the planner read."""
        return ExpertDispatchSettings(mode=self.ep_dispatch, chunk_tokens=self.ep_chunk_tokens,
                                      max_chunks=self.ep_max_chunks, alpha=self.llep_alpha,
                                      threshold=self.llep_threshold, min_tokens=self.llep_min_tokens)

    def axis_sizes(self, world_size: int) -> tuple[int, int, int]:
        """(dp, cp, ep) for ``world_size`` processes; one clear ValueError for each misfit."""
        if self.dp != -1 and self.dp < 1:
            raise ValueError(f"parallel.dp must be >= 1 or -1 (fill the world), got {self.dp}")
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
    loss_chunk_tokens: Any = opt("8K", "tokens per chunk of the chunked loss")
    tiled_mlp: bool = opt(False, "run MLP/MoE layers over the sequence in tiles, recomputing in backward")
    mlp_tile_tokens: Any = opt("16K", "tokens per MLP/MoE tile")
    indexer_query_chunk: Any = opt("1K", "DSA indexer: queries scored per block (bounds scoring memory)")
    recompute: bool = opt(False, "full recompute per layer; only the (4-stream) layer input is kept")
    checkpoint_offload: bool = opt(False, "SCO: copy layer boundaries to pinned host memory (needs recompute)")
    offload_host_budget: Any = opt("64G", "host bytes SCO may pin for boundaries (accepts 64G)")
    optimizer_offload: bool = opt(False, "OffloadStreamAdamW: master weights, moments and grads in host memory")
    optimizer_bucket_params: Any = opt("100M", "parameters per OffloadStreamAdamW bucket")
    kda_segment_tokens: Any = opt(0, "KDA layers over the sequence in segments of this many tokens, the recurrent "
                                     "state carried, each segment recomputed in backward (0: off; one rank, "
                                     "no packed documents)")
    model_segment_tokens: Any = opt(0, "sequence segments: the whole model over the sequence this many tokens at a "
                                       "time, each layer's state (KDA state, DSA latents) carried, each segment "
                                       "rerun in backward; replaces recompute/SCO/tiling at long lengths (0: off; "
                                       "glm5 models; a multiple of parallel.cp, each segment split over the cp "
                                       "ranks)")
    segment_keep_selection: bool = opt(False, "under sequence segments, keep each DSA selection of the forward pass "
                                              "for the backward (int32 [S, topk + 15] per DSA layer) instead of "
                                              "scoring again (saves the indexer's second pass; with auto, used "
                                              "where it fits with 5% to spare; not yet measured on a GPU)")

    def __post_init__(self) -> None:
        for name in SIZE_SETTINGS:
            setattr(self, name, parse_size(getattr(self, name), f"memory.{name}"))
        self._check_ranges()

    def _check_ranges(self) -> None:
        for name in ("loss_chunk_tokens", "mlp_tile_tokens", "indexer_query_chunk", "optimizer_bucket_params"):
            if getattr(self, name) < 1:
                raise ValueError(f"memory.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("kda_segment_tokens", "model_segment_tokens", "offload_host_budget"):
            if getattr(self, name) < 0:
                raise ValueError(f"memory.{name} must be >= 0 (0: off), got {getattr(self, name)}")

    def check_combination(self) -> None:
        """ValueError naming the settings when these schemes cannot run together (settings that will run as
        given: forced ones, and what the planner chose, which never combines them): the schemes' ``requires``
        and ``excludes`` (``megaseq.schemes``)."""
        schemes.check_combination(self)

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
    gpu_budget: Any = opt("auto", "GPU bytes the plan may use (auto: the device's total less a reserve)")
    host_budget: Any = opt("auto", "host bytes the plan may use (auto: 90% of physical RAM)")

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("gpu_budget", "host_budget"):
            v = getattr(self, name)
            if v != "auto":
                setattr(self, name, parse_size(v, f"memory.{name}"))
        if not self.auto:  # forced: they run as given (with auto the planner chooses the combination)
            self.check_combination()

    def settings(self) -> MemorySettings:
        """The scheme settings as configured (what ``auto false`` runs)."""
        return MemorySettings.from_dict(self.to_dict())


@dataclass
class OptimConfig:
    """AdamW with linear warmup and cosine decay."""

    lr: float = opt(1e-3, "peak learning rate", gt=0)
    min_lr_ratio: float = opt(0.1, "final learning rate as a fraction of the peak", ge=0, le=1)
    warmup_steps: int = opt(10, "linear warmup steps", ge=0)
    betas: list[float] = opt([0.9, 0.95], "AdamW betas (two numbers in [0, 1))", ge=0, lt=1)
    eps: float = opt(1e-8, "AdamW epsilon", gt=0)
    weight_decay: float = opt(0.1, "decoupled weight decay (not applied to norms, biases, gates)", ge=0)
    grad_clip: float = opt(1.0, "clip the global gradient norm to this (0 disables)", ge=0)

    def __post_init__(self) -> None:
        if len(self.betas) != 2:
            raise ValueError(f"optim.betas needs two numbers, like [0.9, 0.95], got {self.betas}")
        check_bounds(self, "optim")


BALANCE_MODES = ("auto", "bias", "aux_loss", "none")
FAMILY_DEFAULT = "the model family's"  # what --help prints for a setting left unset (None) to follow the model
DATA_DEFAULT = "the data's"  # what --help prints for an evaluation setting left unset (None) to follow the data


@dataclass
class MoEConfig:
    """Router load balancing in training, as each family's reference trains it (``train/balance.py``). A setting
    left unset (None) follows the model's family; ``train/family_settings.py`` resolves it once the model is known,
    and the run's config.yaml records the value used."""

    balance: Any = opt(None, "bias (the auxiliary-loss-free score-correction bias update: the sigmoid "
                                    "routers of GLM-5, DeepSeek-V3, GLM-4.5, Kimi-Linear), aux_loss (the "
                                    "auxiliary load-balancing loss: the softmax routers of Qwen3-MoE, Qwen3-Next, "
                                    "OLMoE, Mixtral) or none; unset (or auto): the family's reference",
                              family=True)
    aux_loss_coef: float | None = opt(None, "auxiliary loss coefficient; unset: the model's router_aux_loss_coef "
                                            "from its config.json, else the family's default", family=True)
    bias_update_rate: float | None = opt(None, "score-correction bias step per optimizer step, bias += rate * "
                                               "sign(mean load - expert load) over the whole global batch; unset: "
                                               "the family's (0.001)", family=True)
    seq_aux_loss_coef: float | None = opt(None, "beside the bias update: DeepSeek-V3's sequence-wise balance loss "
                                                "alpha * sum_i f_i P_i per sequence and MoE layer on the normalised "
                                                "sigmoid scores (DeepSeek-V3 uses alpha 0.0001; 0: off; one process "
                                                "or data parallelism only); unset: the family's (off)", family=True)

    def __post_init__(self) -> None:
        if self.balance == "auto":  # the family's, as unset
            self.balance = None
        for name in ("aux_loss_coef", "bias_update_rate"):
            if getattr(self, name) == -1.0:  # the family's, as unset
                setattr(self, name, None)
        if self.balance is not None and self.balance not in BALANCE_MODES:
            raise ValueError(f"moe.balance must be one of {', '.join(BALANCE_MODES)}, got {self.balance!r}")
        if self.seq_aux_loss_coef is not None and self.seq_aux_loss_coef < 0:
            raise ValueError(f"moe.seq_aux_loss_coef must be >= 0 (0: off), got {self.seq_aux_loss_coef}")
        for name in ("aux_loss_coef", "bias_update_rate"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"moe.{name} must be >= 0 (or unset for the model family's), got {v}")


LORA_INITS = ("default", "gaussian")


@dataclass
class LoraConfig:
    """LoRA adapters on a frozen base (docs/lora.md): ``W x + (alpha / rank) * B A x`` per target, in PEFT's
    format in and out. Off while ``rank`` is 0."""

    rank: int = opt(0, "adapter rank r (0: no adapters; a multiple of 8 keeps the GPU's grouped GEMMs on the "
                       "routed experts)")
    alpha: float = opt(16.0, "scaling numerator: adapters add (alpha / rank) * B A x (alpha / sqrt(rank) with "
                             "use_rslora)")
    dropout: float = opt(0.0, "dropout on each adapter's input (PEFT's lora_dropout); must be 0 with the routed "
                              "experts or kv_b_proj as targets (their adapters fold into the weight, as PEFT's do)")
    targets: list[str] = opt(["q_proj", "k_proj", "v_proj", "o_proj"],
                             "projections to adapt: module-name suffixes as PEFT's target_modules (q_proj, "
                             "self_attn.o_proj, mlp.down_proj, shared_experts.up_proj), the fused routed "
                             "experts (experts.gate_up_proj, experts.down_proj: per-expert factors), or groups: "
                             "attention (every token-mixer projection), mlp (dense MLPs, shared experts), "
                             "experts (both routed tensors), all")
    use_rslora: bool = opt(False, "rank-stabilised scaling alpha / sqrt(rank) (PEFT's use_rslora)")
    init: str = opt("default", "initialisation as PEFT's init_lora_weights: default (A Kaiming-uniform, B "
                               "zero) or gaussian (A normal with std 1/rank, B zero)")
    init_from: str | None = opt(None, "a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) "
                                      "to start the adapters from; its r, alpha and targets must match these")
    export_merged: bool = opt(False, "at the end of a run also write the merged model (adapters folded into "
                                     "the base) as a HF checkpoint (run_dir/hf), besides the adapter "
                                     "(run_dir/adapter)")

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"lora.rank must be >= 0 (0: no adapters), got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        if self.init not in LORA_INITS:
            raise ValueError(f"lora.init must be one of {', '.join(LORA_INITS)}, got {self.init!r}")
        if self.rank and not self.targets:
            raise ValueError("lora.rank > 0 needs lora.targets (e.g. --lora.targets q_proj,v_proj or all)")
        if self.init_from is not None and not self.rank:
            raise ValueError(f"lora.init_from {self.init_from} needs adapters: set --lora.rank to the adapter's r")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        """The factor of ``B A x``: ``alpha / rank`` (``alpha / sqrt(rank)`` with ``use_rslora``)."""
        return self.alpha / (self.rank**0.5 if self.use_rslora else self.rank)


@dataclass(frozen=True)
class AdapterSettings:
    """What a family's ``parallelize`` applies besides the memory schemes: which parameters train (the rest
    frozen) and the LoRA adapters. Torch-free, as ``MemorySettings``; ``frozen_dtype`` is the dtype frozen
    matmul weights are stored in (``bf16`` under bf16 autocast on a GPU; None: the parameter dtype)."""

    lora: LoraConfig
    trainable: tuple[str, ...] = ()
    seed: int = 0
    frozen_dtype: str | None = None

    @property
    def freezes(self) -> bool:
        """Some parameters are frozen: adapters, or ``train.trainable`` patterns."""
        return self.lora.enabled or bool(self.trainable)

    @classmethod
    def of(cls, cfg: Config, frozen_dtype: str | None = None) -> AdapterSettings:
        """A run's adapter settings (``lora.*``, ``train.trainable``, ``train.seed``)."""
        return cls(cfg.lora, tuple(cfg.train.trainable), cfg.train.seed, frozen_dtype)


@dataclass
class TrainConfig:
    """The training loop."""

    steps: int = opt(60, "optimizer steps")
    batch_size: int = opt(1, "sequences per optimizer step and data-parallel rank, per micro-batch")
    grad_accum: int = opt(1, "micro-batches accumulated per optimizer step")
    seed: int = opt(0, "seed for weights, data and dropout: the same seed gives the same run", ge=0)
    device: str = opt("auto", "cuda, cpu or auto")
    run_dir: str = opt("runs/default", "where the run writes config, plan, metrics, checkpoints, exports")
    save_every: int = opt(0, "checkpoint every N steps (0: by time only, train.save_every_minutes; the end of the "
                          "run and SIGTERM/SIGINT always save one)", ge=0)
    save_every_minutes: float = opt(30.0, "checkpoint every this many minutes of training (wall clock since the run, "
                                    "its resume or the last checkpoint), so a kill loses at most that much; 0: off",
                                    ge=0)
    keep_checkpoints: int = opt(2, "how many step checkpoints to keep", ge=1)
    resume: bool = opt(False, "resume from the newest resumable checkpoint in run_dir (none yet: start at step 0)")
    overwrite: bool = opt(False, "replace a run already in run_dir (removes only what megaseq wrote there)")
    on_nonfinite: str = opt("stop", "a non-finite loss or gradient norm: stop (nothing written, the step named) "
                                    "or skip (no update for that step; stops after 5 in a row)",
                            choices=("stop", "skip"))
    export_hf: bool = opt(True, "write a Hugging Face checkpoint (safetensors + config.json) at the end")
    eval_after: bool = opt(True, "evaluate by position on the held-out data at the end")
    trainable: list[str] = opt([], "parameters to train, as glob patterns of their names (layers.*.self_attn.*, "
                                   "*norm*); the rest are frozen: no gradient, no optimizer state, stored in the "
                                   "compute dtype. Empty: all (or, with LoRA, only the adapters)")
    eval_every: int = opt(0, "held-out loss every N steps during training, beside the k-mer baseline, in "
                          "metrics.jsonl and loss_curve.png (0: only at the end; one process only: skipped, with a "
                          "message, under torchrun or Ray)")
    time_limit: str = opt("", "wall-clock budget of the training steps (600, 90s, 20m, 2h; empty: none). After "
                          "the last step that fits it (the longest step so far taken as the next one's time), the "
                          "run saves a checkpoint and ends as a finished run does (HF export, evaluation); "
                          "--train.resume true continues it towards train.steps")

    def __post_init__(self) -> None:
        if isinstance(self.time_limit, (int, float)) and not isinstance(self.time_limit, bool):
            self.time_limit = str(self.time_limit)
        parse_duration(self.time_limit, "train.time_limit")
        for name in ("steps", "batch_size", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if any(not str(p).strip() for p in self.trainable):
            raise ValueError(f"train.trainable holds an empty pattern: {self.trainable!r}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")
                and self.device[5:].isdigit()):
            raise ValueError(f"train.device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        check_bounds(self, "train")
        if self.eval_every < 0:
            raise ValueError(f"train.eval_every must be >= 0 (0: evaluate only at the end), got {self.eval_every}")


@dataclass
class EvalConfig:
    """Held-out loss by position."""

    by_position: Any = opt(None, "position bucket width (accepts 32K); unset: the data's, an eighth of the "
                                 "evaluation window rounded down to a power of two (8 buckets)",
                           ge=1, family=DATA_DEFAULT)
    seq_len: Any = opt(None, "tokens per evaluation window (default: data.seq_len)", ge=2)
    max_windows: int = opt(8, "evaluation windows per held-out file (0: all)", ge=0)
    kmer_k: int | None = opt(None, "order of the k-mer Markov baseline (0 disables); unset: the data's, 8 for DNA "
                                   "scored per base and 0 otherwise (a k-mer baseline of tokens or residues is not "
                                   "fitted)", ge=0, le=30, family=DATA_DEFAULT)
    batch_size: int = opt(1, "evaluation windows per forward pass", ge=1)

    def __post_init__(self) -> None:
        if self.by_position is not None:
            self.by_position = parse_size(self.by_position, "eval.by_position")
        if self.seq_len is not None:
            self.seq_len = parse_size(self.seq_len, "eval.seq_len")
        check_bounds(self, "eval")


@dataclass
class LogConfig:
    """Progress, metrics and TensorBoard."""

    every: int = opt(1, "log metrics every N steps", ge=1)
    tensorboard: bool = opt(True, "write TensorBoard events to run_dir/tb")
    progress: bool = opt(True, "show progress: a bar on a terminal, one plain line per logged step otherwise "
                         "(pipes, batch logs); rank 0 only")

    def __post_init__(self) -> None:
        check_bounds(self, "log")


@dataclass
class Config:
    """A whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        self.check_frozen_base()

    def check_frozen_base(self) -> None:
        """The combinations of a frozen base (``lora.rank > 0`` or ``train.trainable``) not tested yet, refused
        before anything starts: under expert parallelism (``LoRAExperts`` runs with every expert in the
        process) and with bf16 weights (the fp32 adapters would meet bf16 activations without autocast; the
        frozen base is stored in bf16 anyway). Under FSDP (``parallel.fsdp dp`` / ``dp_cp``) the frozen base is
        sharded and what trains is kept whole on every rank (``parallel.fsdp``)."""
        if not (self.lora.enabled or self.train.trainable):
            return
        what = f"lora.rank {self.lora.rank}" if self.lora.enabled else f"train.trainable {self.train.trainable}"
        if self.parallel.ep > 1:
            raise ValueError(f"{what} (a frozen base) with parallel.ep {self.parallel.ep} is not supported yet "
                             "(adapters on the routed experts run with every expert in the process): set "
                             "--parallel.ep 1")
        if self.model.weights == "bf16":
            raise ValueError(f"{what} (a frozen base) with model.weights bf16 is not supported yet (the fp32 "
                             "adapters would meet bf16 activations without autocast): set --model.weights fp32 (under "
                             "model.dtype bf16 the frozen base is stored in bf16 anyway)")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


SECTIONS: dict[str, type] = {
    "model": ModelConfig, "data": DataConfig, "parallel": ParallelConfig, "memory": MemoryConfig,
    "optim": OptimConfig, "moe": MoEConfig, "lora": LoraConfig, "train": TrainConfig, "eval": EvalConfig,
    "log": LogConfig,
}


def _closest(name: str, choices: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" Did you mean {close[0]!r}?" if close else ""


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Turn a YAML/CLI value into the field's type (strings from the command line included)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        non_none = [a for a in args if a is not type(None)]
        return _coerce(value, non_none[0], key) if len(non_none) == 1 else value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"{key} expects true or false, got {value!r}")
    if isinstance(value, (dict, list, tuple)) and origin is not list:
        raise ValueError(f"{key} expects a single value, got {value!r}")
    if tp is int:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"{key} expects an integer, got {value!r}")
        return parse_size(value, key)
    if tp is float:
        return _number(value, key)
    if tp is str:
        return str(value)
    if origin is list:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v] if value else []
        if isinstance(value, dict) or not isinstance(value, (list, tuple)):
            value = [value]
        return [_coerce(v, args[0], key) for v in value] if args else list(value)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{key} must be a finite number, got {value!r}")
    return value


def _number(value: Any, key: str) -> float:
    """A finite float from YAML or the command line; ``true`` and ``.inf`` are refused, not turned into 1 and inf."""
    if isinstance(value, bool):
        raise ValueError(f"{key} expects a number, got {value!r}")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key} expects a number, got {value!r}") from None
    if not math.isfinite(x):
        raise ValueError(f"{key} must be a finite number, got {value!r}")
    return x


def _build_section(cls: type, values: dict[str, Any], section: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in values.items():
        if k not in fields:
            raise ValueError(f"unknown config key {section}.{k}.{_closest(k, fields)} "
                             f"Valid keys in {section}: {', '.join(sorted(fields))}")
        kwargs[k] = _coerce(v, hints[k], f"{section}.{k}")
    return cls(**kwargs)


def build_config(raw: dict[str, Any] | None = None, overrides: list[str] | dict[str, Any] | None = None) -> Config:
    """Build a Config from a nested dict (a recipe) plus dotted overrides (``model.name=x`` or a dict)."""
    for section, body in (raw or {}).items():
        if section not in SECTIONS:
            raise ValueError(f"unknown config section {section!r}.{_closest(section, SECTIONS)} "
                             f"Sections: {', '.join(SECTIONS)}")
        if body is not None and not isinstance(body, dict):
            raise ValueError(f"config section {section!r} must be a mapping of settings (like `{section}:` and "
                             f"indented `key: value` lines below it), got {body!r}")
    raw = {k: dict(v or {}) for k, v in (raw or {}).items()} if raw else {}
    items = overrides.items() if isinstance(overrides, dict) else [_split_override(o) for o in overrides or []]
    for key, value in items:
        section, _, name = key.partition(".")
        if section not in SECTIONS or not name:
            raise ValueError(f"unknown setting {key!r}: settings look like section.key, sections: "
                             f"{', '.join(SECTIONS)}.{_closest(section, SECTIONS)}")
        raw.setdefault(section, {})[name] = value
    return Config(**{s: _build_section(cls, raw.get(s, {}), s) for s, cls in SECTIONS.items()})


def _split_override(item: str) -> tuple[str, Any]:
    key, sep, value = item.partition("=")
    if not sep:
        raise ValueError(f"override {item!r} must look like section.key=value")
    try:
        parsed = yaml.load(value, Loader=_UniqueKeyLoader) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value  # not YAML (a path with odd characters): the string as given
    return key.strip().lstrip("-"), parsed


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's SafeLoader, except that a key given twice in one mapping is an error, not "the last one wins"."""


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        line = key_node.start_mark.line + 1
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"{key!r} is given twice (first at line {seen[key]}); YAML would silently keep only "
                "the last one: merge the two", key_node.start_mark)
        seen[key] = line
    return yaml.SafeLoader.construct_mapping(loader, node, deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)
# Booleans as YAML 1.2 has them (true / false): YAML 1.1 also reads on, off, yes, no as booleans, which would turn
# `fsdp: off` or `--parallel.fsdp off` into False; a bool setting still takes those words (``_coerce``)
_BOOL_TAG = "tag:yaml.org,2002:bool"
_UniqueKeyLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != _BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_UniqueKeyLoader.add_implicit_resolver(_BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def read_yaml(path: str | Path) -> Any:
    """A YAML file with duplicate keys refused; syntax errors are one ValueError naming the file and line."""
    p = Path(path)
    try:
        text = p.read_text()
    except UnicodeDecodeError:
        raise ValueError(f"config file {p} is not UTF-8 text: give a YAML recipe") from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ValueError(f"config file {p}{where}: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"config file {p} is not valid YAML: {e}") from None


# Files a recipe names: relative paths are relative to the recipe's directory, so a recipe works from any
# working directory (on the command line they are relative to the working directory, as usual).
RECIPE_PATH_LISTS = (("data", "train"), ("data", "heldout"))
# Settings that are a path or a name (a preset, "dna"): resolved only when the recipe-relative path exists.
RECIPE_PATH_OR_NAME = (("model", "name"), ("model", "init_from"), ("data", "tokenizer"))


def _anchor(value: Any, base: Path) -> Any:
    if not isinstance(value, str) or not value or Path(value).expanduser().is_absolute() or value.startswith("~"):
        return value
    return os.path.normpath(base / value)


def resolve_recipe_paths(raw: dict[str, Any], recipe: Path) -> dict[str, Any]:
    """``raw`` with the recipe's relative file paths made relative to the recipe's directory."""
    base = recipe.resolve().parent
    for section, key in RECIPE_PATH_LISTS:
        values = raw[section].get(key) if isinstance(raw.get(section), dict) else None
        if values:
            raw[section][key] = [_anchor(v, base) for v in (values if isinstance(values, list) else [values])]
    for section, key in RECIPE_PATH_OR_NAME:
        value = raw[section].get(key) if isinstance(raw.get(section), dict) else None
        anchored = _anchor(value, base)
        if anchored is not value and Path(anchored).exists():
            raw[section][key] = anchored
    return raw


def load_config(path: str | Path | None = None, overrides: list[str] | dict[str, Any] | None = None,
                drop_sections: tuple[str, ...] = ()) -> Config:
    """Read a YAML recipe (or none: the embedded default) and apply overrides. A relative file path in the
    recipe is relative to the recipe's directory (``resolve_recipe_paths``); ``drop_sections``: the recipe's
    sections left out (their settings then come from the overrides, the defaults or the model's family)."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config file {p} not found: give a YAML recipe (see recipes/)")
        loaded = read_yaml(p) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {p} must hold a mapping of sections, got {type(loaded).__name__}")
        raw = resolve_recipe_paths({k: (dict(v) if isinstance(v, dict) else v) for k, v in loaded.items()
                                    if k not in drop_sections}, p)
        try:
            return build_config(raw, overrides)
        except ValueError as e:
            raise ValueError(f"{e} (config file {p}, or its command-line settings)") from None
    return build_config(raw, overrides)


def default_recipe() -> str:
    """The embedded default job (glm5-flash-tiny on phage lambda), shipped inside the package."""
    from importlib.resources import files

    return str(files("megaseq") / "recipes" / "default.yaml")


def take_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """The command line's settings as dotted overrides, and the other arguments: ``['plan', '--train.steps',
    '5', '--data.seq_len=1K', '--memory.recompute']`` -> ``(['plan'], ['train.steps=5', 'data.seq_len=1K',
    'memory.recompute=true'])``; a setting takes the next argument as its value unless that is an option."""
    keep, out, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg.split("=")[0]:
            keep.append(arg)
            i += 1
        elif "=" in arg:
            out.append(arg[2:])
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out.append(f"{arg[2:]}={argv[i + 1]}")
            i += 2
        else:
            out.append(f"{arg[2:]}=true")
            i += 1
    return keep, out


def split_overrides(rest: list[str]) -> list[str]:
    """Command-line settings to dotted overrides (``take_overrides``); anything else is an error naming it."""
    keep, out = take_overrides(rest)
    if keep:
        raise ValueError(f"unexpected argument {keep[0]!r}: settings look like --section.key value "
                         "(see `megaseq train --help`)")
    return out


def field_help() -> dict[str, list[tuple[str, str, Any]]]:
    """Per section: (key, help, default) for the CLI's --help."""
    out = {}
    for section, cls in SECTIONS.items():
        rows = []
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            if f.metadata.get("family") and default is None:
                default = f.metadata["family"] if isinstance(f.metadata["family"], str) else FAMILY_DEFAULT
            rows.append((f.name, f.metadata.get("help", ""), default))
        out[section] = rows
    return out

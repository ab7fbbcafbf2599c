"""Typed configuration: one dataclass per component, YAML recipes, dotted overrides.

Each field carries its help text in ``metadata["help"]``; the CLI builds ``--help`` from it.
Unknown keys are rejected with the closest valid name. No torch import here.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


def opt(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with help text (mutable defaults go through default_factory)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


def parse_size(value: Any) -> int:
    """'32K' -> 32768, '1M' -> 1048576, '4G' -> 4 * 2**30; ints pass through."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size, got {value!r}")
    if isinstance(value, int):
        return value
    s = str(value).strip().upper().replace("_", "")
    mult = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(float(s))


@dataclass
class ModelConfig:
    """The architecture and where its weights come from."""

    name: str = opt("glm5-flash-tiny", "preset name (see `megaseq verify --list-presets`) or a path to a "
                    "Hugging Face checkpoint directory or config.json")
    init_from: str | None = opt(None, "HF checkpoint directory (safetensors) to load weights from; "
                                "random init when unset (or when `name` is a config without weights)")
    dtype: str = opt("bf16", "compute dtype on the GPU: bf16, fp32 or fp64 (the CPU default job uses fp32)")
    strict_kernels: bool = opt(False, "fail when a layer falls back from its planned fast kernel")
    kernels: str = opt("default", "GPU kernels: default (the set the memory plan is calibrated on) or fast (the "
                                  "Triton kernels for sparse MLA, the indexer, mHC, SwiGLU, RMSNorm and Liger's "
                                  "loss; checked per op, not yet measured in full steps; the plan is then an "
                                  "upper bound)")

    def __post_init__(self) -> None:
        if self.dtype not in ("bf16", "fp32", "fp64"):
            raise ValueError(f"model.dtype must be bf16, fp32 or fp64, got {self.dtype!r}")
        if self.kernels not in ("default", "fast"):
            raise ValueError(f"model.kernels must be default or fast, got {self.kernels!r}")


@dataclass
class DataConfig:
    """Training and held-out data."""

    kind: str = opt("fasta", "fasta (DNA), text (JSONL or .txt through a HF tokenizer) or random (memory tests)")
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
    lowercase: str = opt("upper", "lower-case bases (soft-masked repeats): upper (keep as bases) or n (as N)")
    non_acgt: str = opt("n", "IUPAC ambiguity codes other than ACGTN: n (map to N) or error")
    tokenizer: str = opt("dna", "dna (single-nucleotide) or a path to a HF tokenizer.json / checkpoint dir")
    text_field: str = opt("text", "JSONL field holding the document text")
    txt_docs: str = opt("file", ".txt files: one document per file (file) or per blank-line paragraph (paragraph)")
    seed: int = opt(0, "seed for window sampling")

    def __post_init__(self) -> None:
        self.seq_len = parse_size(self.seq_len)
        if self.kind not in ("fasta", "text", "random"):
            raise ValueError(f"data.kind must be fasta, text or random, got {self.kind!r}")
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


@dataclass
class ParallelConfig:
    """The device mesh: data-parallel x context-parallel (x expert-parallel, reserved)."""

    dp: int = opt(1, "data-parallel size (-1: whatever the world size leaves after cp and ep)")
    cp: int = opt(1, "context-parallel (Ulysses) size: each rank holds seq_len / cp tokens")
    ep: int = opt(1, "expert-parallel size (reserved; must be 1 for now)")
    launcher: str = opt("auto", "auto (torchrun env if present, else one process), ray, or none")
    num_workers: int = opt(1, "Ray workers (with --parallel.launcher ray)")
    backend: str = opt("auto", "collective backend: auto (nccl on GPU, gloo on CPU), nccl or gloo")
    mla_mode: str = opt("auto", "how DSA/MLA layers go context-parallel: ulysses, gather_kv or auto")
    loss_parallel: str = opt("auto", "vocabulary loss over the cp group: ring_dtp, local or auto")

    def __post_init__(self) -> None:
        for name in ("cp", "ep", "num_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        if self.launcher not in ("auto", "ray", "none", "torchrun"):
            raise ValueError(f"parallel.launcher must be auto, torchrun, ray or none, got {self.launcher!r}")

    def axis_sizes(self, world_size: int) -> tuple[int, int, int]:
        """(dp, cp, ep) for ``world_size`` processes; one clear ValueError for each misfit."""
        if self.dp != -1 and self.dp < 1:
            raise ValueError(f"parallel.dp must be >= 1 or -1 (fill the world), got {self.dp}")
        inner = self.cp * self.ep
        if world_size % inner:
            raise ValueError(
                f"world size {world_size} is not a multiple of parallel.cp * parallel.ep = {self.cp} * {self.ep}: "
                f"launch a multiple of {inner} processes or lower --parallel.cp"
            )
        dp = world_size // inner if self.dp == -1 else self.dp
        if dp * inner != world_size:
            raise ValueError(
                f"parallel.dp * cp * ep = {self.dp} * {self.cp} * {self.ep} = {dp * inner} but the world size is "
                f"{world_size}: set --parallel.dp {world_size // inner} (or -1 to fill the world)"
            )
        return dp, self.cp, self.ep


SIZE_SETTINGS = ("loss_chunk_tokens", "mlp_tile_tokens", "indexer_query_chunk", "offload_host_budget",
                 "optimizer_bucket_params", "kda_segment_tokens", "model_segment_tokens")
SEGMENT_SETTING = "memory.model_segment_tokens"
# the per-layer schemes sequence segments replace (each layer's memory is already bounded by the segment)
SEGMENT_EXCLUDED = ("recompute", "checkpoint_offload", "kda_segment_tokens")


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
                                       "glm5 models, one rank)")
    segment_keep_selection: bool = opt(False, "under sequence segments, keep each DSA selection of the forward pass "
                                              "for the backward (int32 [S, topk + 15] per DSA layer) instead of "
                                              "scoring again (saves the indexer's second pass; with auto, used "
                                              "where it fits with 5% to spare; not yet measured on a GPU)")

    def __post_init__(self) -> None:
        for name in SIZE_SETTINGS:
            setattr(self, name, parse_size(getattr(self, name)))
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
        given: forced ones, and what the planner chose, which never combines them)."""
        if self.checkpoint_offload and not self.recompute:
            raise ValueError("memory.checkpoint_offload needs memory.recompute: set --memory.recompute true")
        on = [f"memory.{k}" for k in SEGMENT_EXCLUDED if getattr(self, k)]
        if self.model_segment_tokens and on:
            raise ValueError(f"{SEGMENT_SETTING}={self.model_segment_tokens} with {', '.join(on)}: sequence segments "
                             "already bound each layer's memory by the segment; turn those off (--memory.recompute "
                             "false, --memory.checkpoint_offload false, --memory.kda_segment_tokens 0)")

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
                setattr(self, name, parse_size(v))
        if not self.auto:  # forced: they run as given (with auto the planner chooses the combination)
            self.check_combination()

    def settings(self) -> MemorySettings:
        """The scheme settings as configured (what ``auto false`` runs)."""
        return MemorySettings.from_dict(self.to_dict())


@dataclass
class OptimConfig:
    """AdamW with linear warmup and cosine decay."""

    lr: float = opt(1e-3, "peak learning rate")
    min_lr_ratio: float = opt(0.1, "final learning rate as a fraction of the peak")
    warmup_steps: int = opt(10, "linear warmup steps")
    betas: list[float] = opt([0.9, 0.95], "AdamW betas")
    eps: float = opt(1e-8, "AdamW epsilon")
    weight_decay: float = opt(0.1, "decoupled weight decay (not applied to norms, biases, gates)")
    grad_clip: float = opt(1.0, "clip the global gradient norm to this (0 disables)")

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"optim.lr must be positive, got {self.lr}")
        if len(self.betas) != 2:
            raise ValueError(f"optim.betas needs two numbers, got {self.betas}")


@dataclass
class TrainConfig:
    """The training loop."""

    steps: int = opt(60, "optimizer steps")
    batch_size: int = opt(1, "sequences per optimizer step and data-parallel rank, per micro-batch")
    grad_accum: int = opt(1, "micro-batches accumulated per optimizer step")
    seed: int = opt(0, "seed for weights, data and dropout: the same seed gives the same run")
    device: str = opt("auto", "cuda, cpu or auto")
    run_dir: str = opt("runs/default", "where the run writes config, plan, metrics, checkpoints, exports")
    save_every: int = opt(0, "checkpoint every N steps (0: only at the end)")
    keep_checkpoints: int = opt(2, "how many step checkpoints to keep")
    resume: bool = opt(False, "resume from the newest complete checkpoint in run_dir")
    overwrite: bool = opt(False, "replace a different run already in run_dir")
    export_hf: bool = opt(True, "write a Hugging Face checkpoint (safetensors + config.json) at the end")
    eval_after: bool = opt(True, "evaluate by position on the held-out data at the end")
    eval_every: int = opt(0, "held-out loss every N steps during training, beside the k-mer baseline, in "
                          "metrics.jsonl and loss_curve.png (0: only at the end; one process only: skipped, with a "
                          "message, under torchrun or Ray)")

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_every < 0:
            raise ValueError(f"train.eval_every must be >= 0 (0: evaluate only at the end), got {self.eval_every}")


@dataclass
class EvalConfig:
    """Held-out loss by position."""

    by_position: Any = opt("32K", "position bucket width (accepts 32K)")
    seq_len: Any = opt(None, "tokens per evaluation window (default: data.seq_len)")
    max_windows: int = opt(8, "evaluation windows per held-out file")
    kmer_k: int = opt(8, "order of the k-mer Markov baseline for DNA (0 disables)")
    batch_size: int = opt(1, "evaluation windows per forward pass")

    def __post_init__(self) -> None:
        self.by_position = parse_size(self.by_position)
        if self.seq_len is not None:
            self.seq_len = parse_size(self.seq_len)


@dataclass
class LogConfig:
    """Progress, metrics and TensorBoard."""

    every: int = opt(1, "log metrics every N steps")
    tensorboard: bool = opt(True, "write TensorBoard events to run_dir/tb")
    progress: bool = opt(True, "show progress: a bar on a terminal, one plain line per logged step otherwise "
                         "(pipes, batch logs); rank 0 only")


@dataclass
class Config:
    """A whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


SECTIONS: dict[str, type] = {
    "model": ModelConfig, "data": DataConfig, "parallel": ParallelConfig, "memory": MemoryConfig,
    "optim": OptimConfig, "train": TrainConfig, "eval": EvalConfig, "log": LogConfig,
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
    if tp is int:
        try:
            return parse_size(value)
        except (TypeError, ValueError):
            raise ValueError(f"{key} expects an integer, got {value!r}") from None
    if tp is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{key} expects a number, got {value!r}") from None
    if tp is str:
        return str(value)
    if origin is list:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v] if value else []
        if not isinstance(value, (list, tuple)):
            value = [value]
        return [_coerce(v, args[0], key) for v in value] if args else list(value)
    return value


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
    raw = {k: dict(v or {}) for k, v in (raw or {}).items()} if raw else {}
    for section in raw:
        if section not in SECTIONS:
            raise ValueError(f"unknown config section {section!r}.{_closest(section, SECTIONS)} "
                             f"Sections: {', '.join(SECTIONS)}")
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
    return key.strip().lstrip("-"), yaml.safe_load(value) if value.strip() else ""


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


def load_config(path: str | Path | None = None, overrides: list[str] | dict[str, Any] | None = None) -> Config:
    """Read a YAML recipe (or none: the embedded default) and apply overrides. A relative file path in the
    recipe is relative to the recipe's directory (``resolve_recipe_paths``)."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config file {p} not found: give a YAML recipe (see recipes/)")
        loaded = yaml.safe_load(p.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {p} must hold a mapping of sections, got {type(loaded).__name__}")
        raw = resolve_recipe_paths({k: (dict(v) if isinstance(v, dict) else v) for k, v in loaded.items()}, p)
    return build_config(raw, overrides)


def default_recipe() -> str:
    """The embedded default job (glm5-flash-tiny on phage lambda), shipped inside the package."""
    from importlib.resources import files

    return str(files("megaseq") / "recipes" / "default.yaml")


def split_overrides(rest: list[str]) -> list[str]:
    """Command-line settings to dotted overrides: ``['--train.steps', '5', '--data.seq_len=1K']`` ->
    ``['train.steps=5', 'data.seq_len=1K']``; a flag with no value is ``true``."""
    out, i = [], 0
    while i < len(rest):
        arg = rest[i]
        if not arg.startswith("--") or "." not in arg.split("=")[0]:
            raise ValueError(f"unexpected argument {arg!r}: settings look like --section.key value "
                             "(see `megaseq train --help`)")
        if "=" in arg:
            out.append(arg[2:])
            i += 1
        elif i + 1 < len(rest) and not rest[i + 1].startswith("--"):
            out.append(f"{arg[2:]}={rest[i + 1]}")
            i += 2
        else:
            out.append(f"{arg[2:]}=true")
            i += 1
    return out


def field_help() -> dict[str, list[tuple[str, str, Any]]]:
    """Per section: (key, help, default) for the CLI's --help."""
    out = {}
    for section, cls in SECTIONS.items():
        rows = []
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            rows.append((f.name, f.metadata.get("help", ""), default))
        out[section] = rows
    return out

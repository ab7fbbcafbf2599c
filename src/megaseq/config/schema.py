"""The run's configuration: one typed dataclass per section (``model``, ``data``, ``parallel``, ``memory``,
``optim``, ``moe``, ``lora``, ``train``, ``eval``, ``log``) and ``Config``, the whole run.

Each field carries its help text (``--help`` and ``megaseq config`` print it) and its checks as metadata
(``config.fields``: choices, bounds, sizes with units...), read by one validator when a section is built;
the rules between fields are ``config.checks``. The mesh and memory sections live in ``config.settings``.
No torch import here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import yaml

from megaseq.config import checks
from megaseq.config.fields import opt, validate
from megaseq.config.settings import MemoryConfig, ParallelConfig


@dataclass
class ModelConfig:
    """The architecture and where its weights come from."""

    name: str = opt("glm5-flash-tiny", "preset name (`megaseq config model` lists them) or a path to a "
                    "Hugging Face checkpoint directory or config.json")
    init_from: str | None = opt(None, "HF checkpoint directory (safetensors) to load weights from; unset: "
                                "`name` itself when it is a checkpoint directory with weights, else random init "
                                "(give `name` as DIR/config.json to train a checkpoint's architecture from random)")
    dtype: str = opt("bf16", "compute dtype on the GPU: bf16, fp32 or fp64 (the CPU default job uses fp32)",
                     choices=("bf16", "fp32", "fp64"))
    strict_kernels: bool = opt(False, "fail when a layer falls back from its planned fast kernel")
    weights: str = opt("fp32", "parameter dtype: fp32 (fp32 weights, bf16 compute by autocast) or bf16 (bf16 weights "
                       "on the GPU, half the weight and gradient bytes; the optimizer keeps fp32 master weights "
                       "and moments, sharded with --parallel.fsdp, in host memory with memory.optimizer_offload; "
                       "needs model.dtype bf16)", choices=("fp32", "bf16"))
    kernels: str = opt("fast", "GPU kernels: fast (the Triton kernels for sparse MLA, the indexer top-k, mHC, SwiGLU, "
                                "RMSNorm and the MoE glue, and Liger's RoPE and loss, each checked against its "
                                "reference; an op a kernel cannot run falls back to its reference, reported after the "
                                "first step) or base (the set the memory plan is calibrated on: fla's KDA, the "
                                "absorbed sparse MLA, SDPA, grouped GEMMs, torch elsewhere); the plan is an upper "
                                "bound for fast",
                      aliases={"default": "base"}, choices=("fast", "base"), expect="fast or base")
    autotune: str | None = opt(None, "Triton autotuning where no tuned table holds a kernel's key: pruned (a few "
                               "configs a space, timed once and cached), full (every config, as `megaseq tune`) or "
                               "one (the most conservative config, untimed); unset: MEGASEQ_AUTOTUNE, else pruned",
                               choices=("pruned", "full", "one"))
    kernel_cache: str | None = opt(None, "directory of the compiled GPU kernels and the tuned tables; unset: "
                                   "MEGASEQ_CACHE_DIR, else ~/.cache/megaseq")
    precompile: bool | None = opt(None, "on a GPU, load the package's compiled kernels for the run and compile the "
                                  "rest of the Triton kernels the run's kernel manifests list on several threads "
                                  "while the model is built, before the first step (manifests: shipped, written by "
                                  "`megaseq tune`, and the user's in the kernel cache, which each run extends); "
                                  "unset: MEGASEQ_PRECOMPILE (0: off; compile: compile all, load none), else on")
    cuda_graphs: bool = opt(True, "on a GPU, from the second step replay each KDA layer's forward and backward "
                            "as CUDA graphs (one process, no memory scheme in the plan, no autocast, no "
                            "auxiliary balance loss, one micro-batch a step; other layers and calls run eagerly): "
                            "the host's launches of their many small kernels, not the GPU, bound a step at short "
                            "lengths")
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
        validate(self, "model")


@dataclass
class DataConfig:
    """Training and held-out data."""

    kind: str = opt("fasta", "fasta (DNA, or protein families with data.alphabet protein), text (JSONL, .txt or "
                    "columnar files through a HF tokenizer), chat (conversations with a 'messages' list, through the "
                    "checkpoint's chat template) or random (memory tests)", choices=("fasta", "text", "chat", "random"))
    train: list[str] = opt([], "training files (FASTA: .fa/.fasta[.gz|.xz]; text: .jsonl/.txt); "
                           "empty means the lambda phage genome shipped with megaseq")
    heldout: list[str] = opt([], "held-out files (a whole genome or chromosome the model never sees)")
    heldout_records: list[str] = opt([], "FASTA record ids to hold out of the training files instead")
    heldout_tail: float = opt(-1.0, "hold out the last fraction of every training record (a region split); "
                              "-1: 0.1 when training on the built-in genome with nothing else held out, else 0",
                              ge=0.0, lt=1.0, also=(-1.0,),
                              expect="in [0, 1) (or -1 for the default)")
    seq_len: Any = opt(4096, "tokens per training sequence (accepts 32K, 1M)", size=True, ge=2)
    reverse_complement: bool = opt(False, "also draw reverse-complement windows (DNA)")
    related: int = opt(0, "DNA: windows of this many homologous regions of different strains of one species "
                       "(a file is a strain, its species the name before the first '_'); held-out genomes are "
                       "scored after related - 1 training strains' regions (docs/long_context.md). 0: off")
    related_jitter: float = opt(0.0, "DNA, with data.related: each training window's region lengths drawn at "
                                "random, each at least (1 - this) of an equal share. 0: equal lengths, so homologous "
                                "bases sit the same distance apart in every window, and a model can learn that "
                                "fixed-offset copy instead of matching content (docs/long_context.md)", ge=0.0, lt=1.0)
    lowercase: str = opt("upper", "lower-case bases (soft-masked repeats): upper (keep as bases) or n (as N)",
                         choices=("upper", "n"))
    non_acgt: str = opt("n", "IUPAC ambiguity codes other than ACGTN: n (map to N) or error", choices=("n", "error"))
    tokenizer: str = opt("dna", "dna or protein (the single-letter tokenizer of data.alphabet) or a path to a HF "
                         "tokenizer.json / checkpoint dir")
    text_field: str = opt("text", "JSONL field holding the document text")
    txt_docs: str = opt("file", ".txt files: one document per file (file) or per blank-line paragraph (paragraph)",
                        choices=("file", "paragraph"))
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
    chat_template: str = opt("", "chat: the chat template to render with instead of the tokenizer's: a Jinja file, a "
                             "tokenizer directory or tokenizer_config.json holding one, or a hub id whose template to "
                             "use; written into the HF export (chat_template.jinja). Empty: the tokenizer's own")
    shuffle_buffer: int = opt(0, "streamed data (chat, columnar text): documents are read through a buffer of this "
                              "many, drawn at random (seeded by data.seed and the pass), each pass in a new order. "
                              "0: file order", ge=0)

    def __post_init__(self) -> None:
        validate(self, "data")


@dataclass
class OptimConfig:
    """AdamW with linear warmup and cosine decay."""

    lr: float = opt(1e-3, "peak learning rate", gt=0)
    min_lr_ratio: float = opt(0.1, "final learning rate as a fraction of the peak", ge=0, le=1)
    warmup_steps: int = opt(10, "linear warmup steps", ge=0)
    betas: list[float] = opt([0.9, 0.95], "AdamW betas (two numbers in [0, 1))",
                             ge=0, lt=1, length=2, length_text="two numbers, like [0.9, 0.95]")
    eps: float = opt(1e-8, "AdamW epsilon", gt=0)
    weight_decay: float = opt(0.1, "decoupled weight decay (not applied to norms, biases, gates)", ge=0)
    grad_clip: float = opt(1.0, "clip the global gradient norm to this (0 disables)", ge=0)

    def __post_init__(self) -> None:
        validate(self, "optim")


UNSET = " (or unset for the model family's)"
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
                              family=True, aliases={"auto": None}, choices=BALANCE_MODES)
    aux_loss_coef: float | None = opt(None, "auxiliary loss coefficient; unset: the model's router_aux_loss_coef "
                                            "from its config.json, else the family's default",
                                      family=True, aliases={-1.0: None}, ge=0.0, note=UNSET)
    bias_update_rate: float | None = opt(None, "score-correction bias step per optimizer step, bias += rate * "
                                               "sign(mean load - expert load) over the whole global batch; unset: "
                                               "the family's (0.001)",
                                         family=True, aliases={-1.0: None}, ge=0.0, note=UNSET)
    seq_aux_loss_coef: float | None = opt(None, "beside the bias update: DeepSeek-V3's sequence-wise balance loss "
                                                "alpha * sum_i f_i P_i per sequence and MoE layer on the normalised "
                                                "sigmoid scores (DeepSeek-V3 uses alpha 0.0001; 0: off; one process "
                                                "or data parallelism only); unset: the family's (off)",
                                          family=True, ge=0.0, note=" (0: off)")

    def __post_init__(self) -> None:
        validate(self, "moe")


LORA_INITS = ("default", "gaussian")


@dataclass
class LoraConfig:
    """LoRA adapters on a frozen base (docs/lora.md): ``W x + (alpha / rank) * B A x`` per target, in PEFT's
    format in and out. Off while ``rank`` is 0."""

    rank: int = opt(0, "adapter rank r (0: no adapters; a multiple of 8 keeps the GPU's grouped GEMMs on the "
                       "routed experts)", ge=0, note=" (0: no adapters)")
    alpha: float = opt(16.0, "scaling numerator: adapters add (alpha / rank) * B A x (alpha / sqrt(rank) with "
                             "use_rslora)")
    dropout: float = opt(0.0, "dropout on each adapter's input (PEFT's lora_dropout); must be 0 with the routed "
                              "experts or kv_b_proj as targets (their adapters fold into the weight, as PEFT's do)",
                         ge=0.0, lt=1.0, expect="in [0, 1)")
    targets: list[str] = opt(["q_proj", "k_proj", "v_proj", "o_proj"],
                             "projections to adapt: module-name suffixes as PEFT's target_modules (q_proj, "
                             "self_attn.o_proj, mlp.down_proj, shared_experts.up_proj), the fused routed "
                             "experts (experts.gate_up_proj, experts.down_proj: per-expert factors), or groups: "
                             "attention (every token-mixer projection), mlp (dense MLPs, shared experts), "
                             "experts (both routed tensors), all")
    use_rslora: bool = opt(False, "rank-stabilised scaling alpha / sqrt(rank) (PEFT's use_rslora)")
    init: str = opt("default", "initialisation as PEFT's init_lora_weights: default (A Kaiming-uniform, B "
                               "zero) or gaussian (A normal with std 1/rank, B zero)", choices=LORA_INITS)
    init_from: str | None = opt(None, "a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) "
                                      "to start the adapters from; its r, alpha and targets must match these")
    export_merged: bool = opt(False, "at the end of a run also write the merged model (adapters folded into "
                                     "the base) as a HF checkpoint (run_dir/hf), besides the adapter "
                                     "(run_dir/adapter)")

    def __post_init__(self) -> None:
        validate(self, "lora")


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

    steps: int = opt(60, "optimizer steps", ge=1)
    batch_size: int = opt(1, "sequences per optimizer step and data-parallel rank, per micro-batch", ge=1)
    grad_accum: int = opt(1, "micro-batches accumulated per optimizer step", ge=1)
    seed: int = opt(0, "seed for weights, data and dropout: the same seed gives the same run", ge=0)
    device: str = opt("auto", "cuda, cpu or auto", pattern=r"auto|cpu|cuda(:[0-9]+)?",
                      expect="auto, cpu, cuda or cuda:N")
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
                                   "compute dtype. Empty: all (or, with LoRA, only the adapters)", nonempty="pattern")
    eval_every: int = opt(0, "held-out loss every N steps during training, beside the k-mer baseline, in "
                          "metrics.jsonl and loss_curve.png (0: only at the end; one process only: skipped, with a "
                          "message, under torchrun or Ray)", ge=0, note=" (0: evaluate only at the end)")
    time_limit: str = opt("", "wall-clock budget of the training steps (600, 90s, 20m, 2h; empty: none). After "
                          "the last step that fits it (the longest step so far taken as the next one's time), the "
                          "run saves a checkpoint and ends as a finished run does (HF export, evaluation); "
                          "--train.resume true continues it towards train.steps", duration=True)

    def __post_init__(self) -> None:
        validate(self, "train")


@dataclass
class EvalConfig:
    """Held-out loss by position."""

    by_position: Any = opt(None, "position bucket width (accepts 32K); unset: the data's, an eighth of the "
                                 "evaluation window rounded down to a power of two (8 buckets)",
                           ge=1, size=True, family=DATA_DEFAULT)
    seq_len: Any = opt(None, "tokens per evaluation window (default: data.seq_len)", ge=2, size=True)
    max_windows: int = opt(8, "evaluation windows per held-out file (0: all)", ge=0)
    kmer_k: int | None = opt(None, "order of the k-mer Markov baseline (0 disables); unset: the data's, 8 for DNA "
                                   "scored per base and 0 otherwise (a k-mer baseline of tokens or residues is not "
                                   "fitted)", ge=0, le=30, family=DATA_DEFAULT)
    batch_size: int = opt(1, "evaluation windows per forward pass", ge=1)

    def __post_init__(self) -> None:
        validate(self, "eval")


@dataclass
class LogConfig:
    """Progress, metrics and TensorBoard."""

    every: int = opt(1, "log metrics every N steps", ge=1)
    tensorboard: bool = opt(True, "write TensorBoard events to run_dir/tb")
    progress: bool = opt(True, "show progress: a bar on a terminal, one plain line per logged step otherwise "
                         "(pipes, batch logs); rank 0 only")

    def __post_init__(self) -> None:
        validate(self, "log")


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
        checks.run(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


SECTIONS: dict[str, type] = {
    "model": ModelConfig, "data": DataConfig, "parallel": ParallelConfig, "memory": MemoryConfig,
    "optim": OptimConfig, "moe": MoEConfig, "lora": LoraConfig, "train": TrainConfig, "eval": EvalConfig,
    "log": LogConfig,
}

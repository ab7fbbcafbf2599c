"""The rules between settings, in one place: each a named function of one section (or of the whole run),
raising one ValueError that names the settings and the fix. Rules of a single setting are that field's
metadata (``config.fields``); these are the ones that read two or more.

``DERIVED``: settings filled in from others before the checks (a checkpoint directory given as
``model.name`` is also where the weights come from). ``RULES``: per dataclass, its rules in the order
they run. Both are read by ``fields.validate`` when a section is built. No torch import here.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def hf_weights_in(path: str | None) -> bool:
    """Whether ``path`` is a Hugging Face checkpoint directory holding safetensors weights."""
    p = Path(path) if path else None
    return p is not None and p.is_dir() and any((p / f).is_file() for f in HF_WEIGHT_FILES)


# ---- derived settings ---------------------------------------------------------------------------------------
def init_from_checkpoint_name(m: Any) -> None:
    """``model.name`` a checkpoint directory with weights: train from them, not from random."""
    if m.init_from is None and hf_weights_in(m.name):
        m.init_from = m.name


def protein_tokenizer(d: Any) -> None:
    """``data.alphabet protein`` reads through its own single-letter tokenizer unless another is named."""
    if d.alphabet == "protein" and d.tokenizer == "dna":
        d.tokenizer = "protein"


# ---- model --------------------------------------------------------------------------------------------------
def dsa_warmup_needs_indexer(m: Any) -> None:
    if m.dsa_warmup_steps and not m.train_indexer:
        raise ValueError(f"model.dsa_warmup_steps {m.dsa_warmup_steps} warms up the indexer, which trains only "
                         "with model.train_indexer: set --model.train_indexer true (or dsa_warmup_steps 0)")


def indexer_needs_coefficient(m: Any) -> None:
    if m.train_indexer and m.indexer_loss_coef == 0:
        raise ValueError("model.train_indexer with model.indexer_loss_coef 0 trains nothing: set a coefficient "
                         "(0.001 is the reference's) or --model.train_indexer false")


def bf16_weights_need_bf16_compute(m: Any) -> None:
    if m.weights == "bf16" and m.dtype != "bf16":
        raise ValueError(f"model.weights bf16 computes in bf16: it needs model.dtype bf16 (got {m.dtype}); "
                         "set --model.dtype bf16 or --model.weights fp32")


# ---- data ---------------------------------------------------------------------------------------------------
def protein_tokenizer_needs_protein(d: Any) -> None:
    if d.alphabet == "dna" and d.tokenizer == "protein":
        raise ValueError("data.tokenizer protein reads protein sequences: set --data.alphabet protein")


def settings_of_the_data_kind(d: Any) -> None:
    """Settings of one kind of data given for another have no effect: refused, naming the setting."""
    protein = d.alphabet == "protein"
    if protein and d.kind != "fasta":
        raise ValueError(f"data.alphabet protein reads FASTA / A3M families (data.kind fasta), not data.kind "
                         f"{d.kind}; set --data.kind fasta or --data.alphabet dna")
    if not protein and (d.gaps != "keep" or d.protein_docs != "family"):
        raise ValueError("data.gaps and data.protein_docs apply to protein families: set --data.alphabet protein "
                         "or leave them at their defaults")
    if d.kind != "chat" and list(d.loss_roles) != ["assistant"]:
        raise ValueError(f"data.loss_roles applies to conversations (data.kind chat), not data.kind {d.kind}; "
                         "leave it at its default")
    if d.chat_template and d.kind != "chat":
        raise ValueError(f"data.chat_template renders conversations (data.kind chat), not data.kind {d.kind}; "
                         "leave it empty")
    if d.shuffle_buffer and d.kind not in ("text", "chat"):
        raise ValueError(f"data.shuffle_buffer orders streamed documents (data.kind chat, or text from parquet, "
                         f"Arrow or datasets directories); data.kind {d.kind} draws its windows at random "
                         "already: leave it 0")
    if d.column and d.kind not in ("text", "chat") and not protein:
        raise ValueError(f"data.column names the column of text, conversations or protein sequences; data.kind "
                         f"{d.kind} with DNA reads none: leave it empty")


def jitter_needs_related(d: Any) -> None:
    if d.related_jitter and not d.related:
        raise ValueError(f"data.related_jitter {d.related_jitter} varies the regions of related windows, but "
                         "data.related is 0 (off): set data.related (2 or more regions) or leave the jitter at 0")


# ---- parallel -----------------------------------------------------------------------------------------------
def dispatch_settings_need_ep(p: Any) -> None:
    """The dispatch settings (validated as ``ExpertDispatchSettings``) warned about when nothing dispatches."""
    settings = p.ep_dispatch_settings()
    if settings != type(settings)() and p.ep == 1:
        warnings.warn("parallel.ep_dispatch / ep_* / llep_* have no effect with parallel.ep 1 (every expert "
                      "is on every rank)", stacklevel=5)


def llep_threshold_above_alpha(e: Any) -> None:
    if e.threshold < e.alpha:
        raise ValueError(f"parallel.llep_threshold ({e.threshold}) must be >= parallel.llep_alpha "
                         f"({e.alpha}): below it LLEP could make the busiest GPU busier; raise "
                         "--parallel.llep_threshold")


# ---- memory, LoRA, the whole run ----------------------------------------------------------------------------
def forced_schemes_combine(m: Any) -> None:
    """``memory.auto false``: the forced schemes run as given, so they must run together (with auto the
    planner chooses the combination)."""
    if not m.auto:
        m.check_combination()


def lora_needs_targets(lo: Any) -> None:
    if lo.rank and not lo.targets:
        raise ValueError("lora.rank > 0 needs lora.targets (e.g. --lora.targets q_proj,v_proj or all)")


def lora_init_needs_rank(lo: Any) -> None:
    if lo.init_from is not None and not lo.rank:
        raise ValueError(f"lora.init_from {lo.init_from} needs adapters: set --lora.rank to the adapter's r")


def frozen_base_supported(cfg: Any) -> None:
    """The combination of a frozen base (``lora.rank > 0`` or ``train.trainable``) not tested yet, refused
    before anything starts: bf16 weights (the fp32 adapters would meet bf16 activations without autocast;
    the frozen base is stored in bf16 anyway). Under FSDP (``parallel.fsdp dp`` / ``dp_cp``) the frozen base
    is sharded and what trains is kept whole on every rank (``parallel.fsdp``); under expert parallelism
    the routed experts' adapters are split over the ep ranks with their experts (``parallel.expert``)."""
    if not (cfg.lora.enabled or cfg.train.trainable):
        return
    what = f"lora.rank {cfg.lora.rank}" if cfg.lora.enabled else f"train.trainable {cfg.train.trainable}"
    if cfg.model.weights == "bf16":
        raise ValueError(f"{what} (a frozen base) with model.weights bf16 is not supported yet (the fp32 "
                         "adapters would meet bf16 activations without autocast): set --model.weights fp32 (under "
                         "model.dtype bf16 the frozen base is stored in bf16 anyway)")


Rule = Callable[[Any], None]
DERIVED: dict[str, tuple[Rule, ...]] = {
    "ModelConfig": (init_from_checkpoint_name,),
    "DataConfig": (protein_tokenizer,),
}
RULES: dict[str, tuple[Rule, ...]] = {
    "ModelConfig": (dsa_warmup_needs_indexer, indexer_needs_coefficient, bf16_weights_need_bf16_compute),
    "DataConfig": (protein_tokenizer_needs_protein, settings_of_the_data_kind, jitter_needs_related),
    "ParallelConfig": (dispatch_settings_need_ep,),
    "ExpertDispatchSettings": (llep_threshold_above_alpha,),
    "MemoryConfig": (forced_schemes_combine,),
    "LoraConfig": (lora_needs_targets, lora_init_needs_rank),
    "Config": (frozen_base_supported,),
}


def derive(obj: Any) -> None:
    """Fill in the settings of ``obj`` that follow from others (``DERIVED``)."""
    for rule in DERIVED.get(type(obj).__name__, ()):
        rule(obj)


def run(obj: Any) -> None:
    """The cross-field rules of ``obj``'s class (``RULES``), in order; the first broken one raises."""
    for rule in RULES.get(type(obj).__name__, ()):
        rule(obj)

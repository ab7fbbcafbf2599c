"""Data: FASTA and text readers, tokenizers, long-sequence windows with document bounds.

``build_data(cfg.data, cfg.eval, ...)`` is the one entry point: it reads and checks everything a
run needs (training source, held-out windows) before any model is built, so a bad path, a
length the data cannot fill or a vocabulary that does not fit fails first, with one message.
The training source is sharded over data-parallel ranks by window number (``rank``, ``world_size``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megaseq.data.fasta import DnaSplit, FastaRecord, default_genome_path, load_dna_split, read_fasta
from megaseq.data.protein import ProteinTokenizer
from megaseq.data.text import PackedText, load_text
from megaseq.data.tokenizer import (
    ACGT_IDS,
    DNA_VOCAB_SIZE,
    DnaTokenizer,
    HfTokenizer,
    reverse_complement,
)
from megaseq.data.windows import (
    IGNORE_INDEX,
    EvalBatches,
    EvalWindow,
    RandomTokens,
    WindowSampler,
    heldout_windows,
    make_batch,
)

__all__ = [
    "ACGT_IDS", "DNA_VOCAB_SIZE", "IGNORE_INDEX", "Data", "DnaSplit", "DnaTokenizer", "EvalBatches",
    "EvalWindow", "FastaRecord", "HfTokenizer", "PackedText", "RandomTokens", "WindowSampler", "build_data",
    "build_tokenizer", "default_genome_path", "heldout_windows", "load_dna_split", "load_text", "make_batch",
    "read_fasta", "reverse_complement",
]


@dataclass
class Data:
    """What a run reads: a resumable training source and held-out windows per group (file)."""

    train: WindowSampler | RandomTokens
    heldout: dict[str, list[EvalWindow]]
    tokenizer: DnaTokenizer | HfTokenizer | None
    unit: str = "token"  # 'base' when tokens are single nucleotides (losses reported as bits per base)
    score_ids: tuple[int, ...] | None = None  # label ids that count in evaluation (A C G T for DNA)
    train_records: list[FastaRecord] = field(default_factory=list)  # DNA ids, for the k-mer baseline
    notes: list[str] = field(default_factory=list)  # sentences for the report (what is scored)
    log: list[str] = field(default_factory=list)  # lines for the run's log (what a resume did not read again)

    def heldout_batches(self, batch_size: int = 1) -> dict[str, EvalBatches]:
        return {group: EvalBatches(windows, batch_size) for group, windows in self.heldout.items()}


def build_tokenizer(data_cfg: Any) -> Any:
    """``data.tokenizer``: 'dna' -> DnaTokenizer (with data.lowercase / data.non_acgt), 'protein' ->
    ``protein.ProteinTokenizer`` (with data.gaps), else a HF path."""
    if data_cfg.tokenizer == "dna":
        return DnaTokenizer(data_cfg.lowercase, data_cfg.non_acgt)
    if data_cfg.tokenizer == "protein":
        return ProteinTokenizer(getattr(data_cfg, "gaps", "keep"))
    return HfTokenizer(data_cfg.tokenizer)


def _hf_records(records: list[FastaRecord], tok: HfTokenizer, both_strands: bool) -> list[FastaRecord]:
    """DNA records re-tokenized with a model's own tokenizer (the reverse strand as extra records)."""
    out = [FastaRecord(r.id, tok.encode_dna(r.tokens), r.source, r.description) for r in records]
    if both_strands:
        out += [FastaRecord(f"{r.id}:rc", tok.encode_dna(reverse_complement(r.tokens)), r.source)
                for r in records]
    return out


def build_data(data_cfg: Any, eval_cfg: Any = None, *, batch_size: int = 1, vocab_size: int | None = None,
               rank: int = 0, world_size: int = 1, heldout_tail: float | None = None,
               resume_state: dict[str, Any] | None = None) -> Data:
    """Build the training source and held-out windows of ``data_cfg`` (a DataConfig).

    ``vocab_size``: the model's; checked against the tokenizer, and the range of random tokens.
    ``eval_cfg`` (an EvalConfig): window length (default data.seq_len) and windows per group.
    ``heldout_tail``: see ``fasta.load_dna_split`` (a single-genome demo split); None reads
    ``data_cfg.heldout_tail``, whose -1 means 0.1 for the built-in genome with nothing else held out.
    ``resume_state``: the data state of the checkpoint a run resumes from (None: a first start); conversations
    use its summary of the first start's read of the same files instead of reading them again
    (``chat_build``).
    """
    if getattr(data_cfg, "related", 0) and (data_cfg.kind != "fasta" or data_cfg.tokenizer != "dna"):
        raise ValueError("data.related needs DNA with the single-nucleotide tokenizer (data.kind fasta, "
                         "data.tokenizer dna); set --data.related 0 for other data or a model's own tokenizer")
    if heldout_tail is None:
        heldout_tail = resolve_heldout_tail(data_cfg)
    seq_len = data_cfg.seq_len
    eval_len = (eval_cfg.seq_len if eval_cfg is not None else None) or seq_len
    max_windows = eval_cfg.max_windows if eval_cfg is not None else 0
    kw = {"batch_size": batch_size, "seed": data_cfg.seed, "rank": rank, "world_size": world_size}
    if data_cfg.kind == "random":
        if vocab_size is None:
            raise ValueError("data.kind=random needs the model's vocab_size")
        return Data(RandomTokens(vocab_size, seq_len, **kw), {}, None)
    if data_cfg.kind == "chat":
        from megaseq.data.chat_build import build_chat

        return Data(**build_chat(data_cfg, seq_len, eval_len, max_windows, kw, vocab_size, resume_state))
    tok = build_tokenizer(data_cfg)
    if vocab_size is not None:
        tok.check_vocab(vocab_size)
    if data_cfg.kind == "text":
        return _build_text(data_cfg, tok, seq_len, eval_len, max_windows, kw)
    if getattr(data_cfg, "alphabet", "dna") == "protein":
        from megaseq.data.protein_build import build_protein

        return Data(**build_protein(data_cfg, tok, seq_len, eval_len, max_windows, kw, heldout_tail))
    split = load_dna_split(data_cfg, heldout_tail=heldout_tail)
    heldout = split.heldout
    related = getattr(data_cfg, "related", 0)
    if related:
        return _build_related(data_cfg, split, seq_len, eval_len, max_windows, kw)
    if isinstance(tok, DnaTokenizer):
        _check_bases(split.train, "data.train", "there is nothing to learn")
        train = WindowSampler(split.train, seq_len, reverse_complement=data_cfg.reverse_complement, **kw)
        unit, score_ids = "base", ACGT_IDS
    else:
        train = WindowSampler(_hf_records(split.train, tok, data_cfg.reverse_complement), seq_len, **kw)
        heldout = {g: _hf_records(recs, tok, False) for g, recs in heldout.items()}
        unit, score_ids = "token", None
    has_eval_len = eval_cfg is not None and eval_cfg.seq_len
    setting = "eval.seq_len" if has_eval_len else "data.seq_len (eval.seq_len unset)"
    windows = {g: heldout_windows(recs, eval_len, max_windows, setting) for g, recs in heldout.items()}
    if unit == "base":
        for g, ws in windows.items():
            _check_bases(ws, f"data.heldout ({g})", "its report would score 0 bases", window=True)
    return Data(train, windows, tok, unit, score_ids, split.train if unit == "base" else [])


def _check_bases(records: Any, setting: str, why: str, window: bool = False) -> None:
    """Refuse DNA with no A/C/G/T (all N: nothing is scored); warn when fewer than half the bases are."""
    counts = sum((np.bincount(r.tokens, minlength=DNA_VOCAB_SIZE) for r in records), np.zeros(DNA_VOCAB_SIZE))
    acgt, total = float(counts[list(ACGT_IDS)].sum()), float(counts.sum())
    where = sorted({getattr(r, "source", "") or getattr(r, "id", "") for r in records} - {""})
    named = f" ({', '.join(where[:3])})" if where and not window else ""
    if acgt == 0:
        what = "held-out windows" if window else "sequences"
        raise ValueError(f"{setting}{named}: the {what} hold no A, C, G or T (all N or padding), so {why}; "
                         "give sequences with bases" + (" or another held-out file" if window else ""))
    if acgt < 0.5 * total:
        warnings.warn(f"{setting}{named}: only {acgt / total:.0%} of the bases are A/C/G/T (the rest N); only "
                      "A/C/G/T are scored", stacklevel=3)


def _build_related(data_cfg: Any, split: DnaSplit, seq_len: int, eval_len: int, max_windows: int,
                   kw: dict[str, Any]) -> Data:
    """``data.related``: windows of homologous regions of several strains (``data.related``); each held-out
    file scored after its training relatives, or alone when its species has too few training strains."""
    from megaseq.data.related import RelatedWindowSampler, heldout_related_windows

    related = data_cfg.related
    train = RelatedWindowSampler(split.train, seq_len, related, reverse_complement=data_cfg.reverse_complement,
                                 jitter=data_cfg.related_jitter, **kw)
    windows = {}
    for group, recs in split.heldout.items():
        found, alone = heldout_related_windows(recs, train.strains, eval_len, related, max_windows)
        if found:
            windows[f"{group} (after {related - 1} training relatives)"] = found
            windows[f"{group} (after its own preceding bases)"] = alone
        else:
            windows[f"{group} (alone: too few training strains of its species)"] = heldout_windows(
                recs, eval_len, max_windows, "eval.seq_len")
    return Data(train, windows, build_tokenizer(data_cfg), "base", ACGT_IDS, split.train)


def _build_text(data_cfg: Any, tok: Any, seq_len: int, eval_len: int, max_windows: int,
                kw: dict[str, Any]) -> Data:
    if data_cfg.reverse_complement:
        raise ValueError("data.reverse_complement applies to DNA only; set it false for data.kind=text")
    if not data_cfg.train:
        raise ValueError("data.kind=text needs data.train: .jsonl or .txt files")
    from megaseq.data.sources import data_paths, is_columnar

    if any(is_columnar(p) for p in data_paths(list(data_cfg.train) + list(data_cfg.heldout), "data.train")):
        from megaseq.data.text_stream import build_text_stream

        return Data(**build_text_stream(data_cfg, tok, seq_len, eval_len, max_windows, kw))
    if getattr(data_cfg, "shuffle_buffer", 0):
        raise ValueError("data.shuffle_buffer orders streamed documents (text in parquet, Arrow or datasets "
                         "directories); text from .jsonl / .txt is held in memory and its windows drawn at random "
                         "already: leave it 0")
    field_name = getattr(data_cfg, "column", "") or data_cfg.text_field
    packed = load_text(list(data_cfg.train), tok, field_name, _txt(data_cfg), setting="data.train")
    train = WindowSampler([packed], seq_len, **kw)
    heldout = {}
    for path in data_cfg.heldout:
        stream = load_text([path], tok, field_name, _txt(data_cfg), setting="data.heldout")
        heldout[stream.source] = heldout_windows([stream], eval_len, max_windows, "eval.seq_len")
    return Data(train, heldout, tok)


def _txt(data_cfg: Any) -> str:
    return getattr(data_cfg, "txt_docs", "file")


def resolve_heldout_tail(data_cfg: Any) -> float:
    """``data.heldout_tail``; its -1 means 0.1 for the built-in genome with nothing else held out, else 0."""
    tail = getattr(data_cfg, "heldout_tail", 0.0)
    if tail != -1.0:
        return tail
    default_job = not data_cfg.train and not data_cfg.heldout and not data_cfg.heldout_records
    return 0.1 if default_job and data_cfg.kind == "fasta" else 0.0

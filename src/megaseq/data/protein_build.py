"""The training stream and held-out windows of protein families (``data.alphabet protein``).

Training families are the files of ``data.train`` less the records named by ``data.heldout_records``;
a held-out family is a file of ``data.heldout`` (or the held-out records of a training file), never
trained on. Each is packed as ``protein.pack_families`` describes, and windows are cut from the stream
as for text. With the built-in tokenizer the report is in bits per residue, over the 25 residue letters
(not gaps, not separators); with a checkpoint's own tokenizer it is per token of that tokenizer.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from megaseq.data.fasta import FastaRecord, load_dna_split
from megaseq.data.protein import RESIDUE_IDS, ProteinTokenizer, pack_families, read_family
from megaseq.data.sources import is_columnar
from megaseq.data.windows import WindowSampler, heldout_windows


def _by_file(records: list[FastaRecord]) -> list[list[FastaRecord]]:
    groups: dict[str, list[FastaRecord]] = defaultdict(list)
    for r in records:
        groups[r.source].append(r)
    return list(groups.values())


def _check(data_cfg: Any, heldout_tail: float) -> None:
    if not data_cfg.train:
        raise ValueError("data.alphabet protein needs data.train: FASTA or A3M files of protein families "
                         "(the built-in genome is DNA)")
    if data_cfg.reverse_complement:
        raise ValueError("data.reverse_complement applies to DNA only; set it false for data.alphabet protein")
    if heldout_tail > 0:
        raise ValueError("data.heldout_tail cuts the tail of every record, which splits proteins: hold out a "
                         "family file (data.heldout) or whole proteins (data.heldout_records) instead, and set "
                         "--data.heldout_tail 0")


def _read(path: Path, data_cfg: Any) -> list[FastaRecord]:
    """A family file: FASTA / A3M, or a parquet / Arrow file with a residue string per row (data.column)."""
    if is_columnar(path):
        from megaseq.data.columnar import read_sequences

        return read_sequences(path, data_cfg.column or "sequence", ProteinTokenizer(data_cfg.gaps), "data.train")
    return read_family(path, data_cfg.gaps)


def _encoder(tok: Any) -> tuple[Any, int]:
    """(residue ids -> the tokenizer's ids, or None for the built-in ids; the separator id)."""
    if isinstance(tok, ProteinTokenizer):
        return None, tok.sep_id
    if tok.eos_id is None:
        raise ValueError(f"data.tokenizer {tok.path}: names no end-of-sequence token to separate proteins; set "
                         "eos_token in its tokenizer_config.json, or use --data.tokenizer protein")
    letters = ProteinTokenizer().decode
    return (lambda ids: tok.encode(letters(ids))), tok.eos_id


def build_protein(data_cfg: Any, tok: Any, seq_len: int, eval_len: int, max_windows: int, kw: dict[str, Any],
                  heldout_tail: float = 0.0) -> dict[str, Any]:
    """The fields of ``data.Data`` for protein families."""
    _check(data_cfg, heldout_tail)
    split = load_dna_split(data_cfg, 0.0, reader=lambda p: _read(Path(p), data_cfg))
    encode, sep = _encoder(tok)
    docs = data_cfg.protein_docs
    train = pack_families(_by_file(split.train), sep, docs, "data.train proteins", encode)
    sampler = WindowSampler([train], seq_len, **kw)
    windows = {}
    for group, recs in split.heldout.items():
        packed = pack_families(_by_file(recs), sep, docs, group, encode)
        windows[group] = heldout_windows([packed], eval_len, max_windows, "eval.seq_len")
    builtin = encode is None
    return {"train": sampler, "heldout": windows, "tokenizer": tok, "unit": "residue" if builtin else "token",
            "score_ids": RESIDUE_IDS if builtin else None}

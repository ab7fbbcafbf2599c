"""Protein families: FASTA or A3M files of homologs, one residue per token, packed into one long sequence.

Protein ids (``data.alphabet protein``; ``PROTEIN_VOCAB_SIZE = 32``), fixed so a run's ids never move::

    0 pad   1 bos   2 eos   3 sep (after every protein)
    4-23  A C D E F G H I K L M N P Q R S T V W Y   (the 20 amino acids)
    24-28 B Z X U O   (ambiguity codes: D/N, E/Q, unknown; selenocysteine, pyrrolysine)
    29 '-' (gap)   30-31 unused

Reading (FASTA and A3M alike): letters of either case are residues (A3M's lower case marks insertions
relative to the query: the residues are kept, upper-cased, so every homolog is its whole sequence);
'.' (A3M/A2M padding of insertion columns) and '*' (a stop) are skipped; '-' is a gap token, or skipped
with ``data.gaps drop`` (unaligned homologs); '#' lines (A3M headers) are skipped. Anything else is an
error naming the file, record, line and character.

Packing: a family file is ``protein 1, sep, protein 2, sep, ...``. With ``data.protein_docs family``
(the default) the family is one document: every protein attends to the homologs before it, the
long-context signal a family carries. With ``protein`` each protein (with its separator) is its own
document. Either way ``windows.make_batch`` applies the packing rules of text: no token attends across a
document boundary and a document's last token (its separator) predicts nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from megaseq.data.fasta import FastaRecord, iter_fasta
from megaseq.data.text import PackedText
from megaseq.data.tokenizer import BOS_ID, EOS_ID, ILLEGAL, PAD_ID, SEP_ID, SKIP, _check_vocab

AMINO_ACIDS = "ACDEFGHIKLMNPQRSTVWY"
AMBIGUITY = "BZXUO"
GAP = "-"
LETTERS = AMINO_ACIDS + AMBIGUITY + GAP
FIRST_RESIDUE_ID = 4
GAP_ID = FIRST_RESIDUE_ID + len(AMINO_ACIDS) + len(AMBIGUITY)  # 29
RESIDUE_IDS = tuple(range(FIRST_RESIDUE_ID, GAP_ID))  # the 25 letters scored as residues (not the gap)
PROTEIN_VOCAB_SIZE = 32
_SPECIAL_NAMES = {PAD_ID: "<pad>", BOS_ID: "<bos>", EOS_ID: "<eos>", SEP_ID: "<sep>"}


def protein_lut(gaps: str = "keep") -> np.ndarray:
    """Byte -> protein id table ``[256]`` uint8: letters (either case) -> ids, '-' -> gap (or skipped with
    ``gaps='drop'``), whitespace '.' '*' -> SKIP, anything else -> ILLEGAL."""
    if gaps not in ("keep", "drop"):
        raise ValueError(f"data.gaps must be keep or drop, got {gaps!r}")
    lut = np.full(256, ILLEGAL, dtype=np.uint8)
    lut[list(b" \t\r\n\v\f.*")] = SKIP
    for i, ch in enumerate(LETTERS):
        lut[ord(ch)] = lut[ord(ch.lower())] = FIRST_RESIDUE_ID + i
    if gaps == "drop":
        lut[ord(GAP)] = SKIP
    return lut


class ProteinTokenizer:
    """One token per residue over the fixed 32-id protein vocabulary above."""

    kind = "protein"
    vocab_size = PROTEIN_VOCAB_SIZE
    pad_id, bos_id, eos_id, sep_id = PAD_ID, BOS_ID, EOS_ID, SEP_ID

    def __init__(self, gaps: str = "keep") -> None:
        self.gaps = gaps
        self.lut = protein_lut(gaps)

    def encode(self, text: str) -> np.ndarray:
        """Residues -> uint8 ids ``[L]`` (skipped characters dropped); an illegal character raises ValueError."""
        raw = np.frombuffer(text.encode("ascii", errors="replace"), dtype=np.uint8)
        ids = self.lut[raw]
        bad = np.flatnonzero(ids == ILLEGAL)
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"protein sequence position {i}: illegal character {chr(raw[i])!r}; residues are "
                             f"{AMINO_ACIDS}, {AMBIGUITY} and '-' (X: an unknown residue)")
        return ids[ids != SKIP]

    def decode(self, ids: Any, skip_special: bool = True) -> str:
        out = []
        for i in np.asarray(ids).astype(np.int64).ravel().tolist():
            if FIRST_RESIDUE_ID <= i <= GAP_ID:
                out.append(LETTERS[i - FIRST_RESIDUE_ID])
            elif not skip_special:
                out.append(_SPECIAL_NAMES.get(i, f"<{i}>"))
        return "".join(out)

    def vocab(self) -> dict[str, int]:
        """Token -> id, the whole declared vocabulary (specials and letters)."""
        return {**{name: i for i, name in _SPECIAL_NAMES.items()},
                **{ch: FIRST_RESIDUE_ID + k for k, ch in enumerate(LETTERS)}}

    def check_vocab(self, model_vocab_size: int) -> None:
        _check_vocab("protein", GAP_ID + 1, model_vocab_size)


def read_family(path: str | Path, gaps: str = "keep") -> list[FastaRecord]:
    """The proteins of one FASTA or A3M file (uint8 protein ids; see the module docstring)."""
    return list(iter_fasta(path, lut=protein_lut(gaps), alphabet="protein"))


def pack_family(records: list[FastaRecord], separator: int, docs: str = "family", name: str = "family",
                encode: Any = None, first_doc: int = 0) -> PackedText:
    """``protein, sep, protein, sep, ...`` with doc ids: one per family (``docs='family'``) or one per protein
    (``'protein'``); ``encode``: residue ids -> another tokenizer's ids (a checkpoint's own)."""
    if docs not in ("family", "protein"):
        raise ValueError(f"data.protein_docs must be family or protein, got {docs!r}")
    sep = np.array([separator], dtype=np.int32)
    parts, lengths = [], []
    for r in records:
        ids = r.tokens if encode is None else encode(r.tokens)
        if len(ids) == 0:
            continue
        parts += [ids.astype(np.int32), sep]
        lengths.append(len(ids) + 1)
    tokens = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    if docs == "protein":
        doc_ids = np.repeat(np.arange(first_doc, first_doc + len(lengths), dtype=np.int32), lengths)
    else:
        doc_ids = np.full(len(tokens), first_doc, dtype=np.int32)
    source = ", ".join(sorted({r.source for r in records if r.source}))
    return PackedText(name, tokens, doc_ids, source, len(lengths) if docs == "protein" else int(bool(lengths)))


def pack_families(families: list[list[FastaRecord]], separator: int, docs: str, name: str,
                  encode: Any = None) -> PackedText:
    """Several families in one stream; doc ids keep rising, so no family attends to another."""
    packed, first = [], 0
    for recs in families:
        p = pack_family(recs, separator, docs, name, encode, first)
        if len(p):
            packed.append(p)
            first = int(p.doc_ids[-1]) + 1
    if not packed:
        return PackedText(name, np.zeros(0, np.int32), np.zeros(0, np.int32), "", 0)
    return PackedText(name, np.concatenate([p.tokens for p in packed]), np.concatenate([p.doc_ids for p in packed]),
                      ", ".join(p.source for p in packed), sum(p.num_docs for p in packed))

"""The single-nucleotide DNA tokenizer written as a Hugging Face tokenizer, so a DNA run's export loads with
``AutoTokenizer.from_pretrained(RUN/hf)`` and tokenizes as the run did.

The vocabulary is the run's 16 ids (``data.tokenizer``: ``<pad> <bos> <eos> <sep> A C G T N`` and 7 unused
ids). The normalizer is the run's byte table (``tokenizer.byte_lut`` with the run's ``data.lowercase`` and
``data.non_acgt``): whitespace dropped, soft-masked bases upper-cased (or read as N), IUPAC ambiguity codes read
as N; the pre-tokenizer splits every character, and a WordLevel model maps each to its id (``data/char_hf.py``,
shared with the protein tokenizer). One difference: a character the run refuses (an illegal byte, or an
ambiguity code under ``data.non_acgt error``) becomes ``<unk>`` (the first unused id) instead of an error, as a
tokenizer cannot refuse its input.
"""

from __future__ import annotations

from pathlib import Path

from megaseq.data.char_hf import CharVocab, char_tokenizer_json, lut_replacements, write_hf_char_tokenizer
from megaseq.data.tokenizer import _SPECIAL_NAMES, A_ID, DNA_VOCAB_SIZE, N_ID, DnaTokenizer, byte_lut

UNK_ID = N_ID + 1  # the first unused id


def dna_vocab() -> dict[str, int]:
    """token -> id over the whole 16-id vocabulary."""
    vocab = {name: i for i, name in _SPECIAL_NAMES.items()}
    vocab.update({ch: A_ID + k for k, ch in enumerate("ACGTN")})
    vocab["<unk>"] = UNK_ID
    vocab.update({f"<unused{i}>": i for i in range(UNK_ID + 1, DNA_VOCAB_SIZE)})
    return vocab


def _replacements(tok: DnaTokenizer) -> list[tuple[str, str]]:
    """(character, what it reads as) for every byte the run's table does not read as itself."""
    return lut_replacements(byte_lut(tok.lowercase, tok.non_acgt), {A_ID + k: ch for k, ch in enumerate("ACGTN")})


def dna_char_vocab(tok: DnaTokenizer) -> CharVocab:
    return CharVocab(dna_vocab(), {**_SPECIAL_NAMES, UNK_ID: "<unk>"}, _replacements(tok))


def dna_tokenizer_json(tok: DnaTokenizer) -> dict[str, object]:
    """``tokenizer.json`` of ``tok`` (written without the ``tokenizers`` package: a base install has none)."""
    return char_tokenizer_json(dna_char_vocab(tok))


def write_hf_dna_tokenizer(tok: DnaTokenizer, out_dir: str | Path) -> list[str]:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (a fast tokenizer, no special tokens added on
    encode: the run adds none to its windows) into ``out_dir``; returns the names written."""
    return write_hf_char_tokenizer(dna_char_vocab(tok), out_dir)

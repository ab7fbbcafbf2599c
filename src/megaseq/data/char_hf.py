"""A one-character-per-token vocabulary written as a Hugging Face tokenizer, so a run's export loads with
``AutoTokenizer.from_pretrained(RUN/hf)`` (or the LoRA adapter directory) and tokenizes as the run did.

The built-in tokenizers (single-nucleotide DNA, ``data/dna_hf.py``; single-residue protein, here) read text
through a byte table: each byte is a token id, or skipped, or refused. Written as a ``tokenizer.json``: the
normalizer replaces every character the table reads as another (``a`` as ``A``) or skips (whitespace);
the pre-tokenizer splits every character, and a WordLevel model maps each to its id. Special tokens
(``<pad> <bos> <eos> <sep>``) keep the run's ids and are never added on encode: the run adds none to its
windows. One difference: a character the run refuses becomes ``<unk>`` (an id the run never uses) instead of
an error, as a tokenizer cannot refuse its input.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megaseq.data.protein import _SPECIAL_NAMES, FIRST_RESIDUE_ID, GAP_ID, LETTERS, PROTEIN_VOCAB_SIZE, ProteinTokenizer
from megaseq.data.tokenizer import SKIP

FILES = ["tokenizer.json", "tokenizer_config.json"]


@dataclass(frozen=True)
class CharVocab:
    """A character-level vocabulary: ``vocab`` token -> id over every id; ``specials`` id -> name of the
    special tokens (``<unk>`` among them); ``replacements`` (character, what it reads as: a letter, or '' when
    skipped) for every character that does not read as itself."""

    vocab: dict[str, int]
    specials: dict[int, str]
    replacements: list[tuple[str, str]]
    unk: str = "<unk>"


def lut_replacements(lut: np.ndarray, letters: dict[int, str]) -> list[tuple[str, str]]:
    """(character, what it reads as) for every ASCII byte the table ``lut`` (byte -> id or SKIP) skips or reads
    as another letter; ``letters``: id -> its character. Bytes the table refuses are left out (they become
    ``<unk>``)."""
    out = []
    for b in range(128):
        ch, target = chr(b), int(lut[b])
        if target == SKIP:
            out.append((ch, ""))
        elif target in letters and letters[target] != ch:
            out.append((ch, letters[target]))
    return out


def _added(i: int, name: str) -> dict[str, object]:
    return {"id": i, "content": name, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
            "special": True}


def char_tokenizer_json(v: CharVocab) -> dict[str, object]:
    """``tokenizer.json`` of ``v`` (the format of the ``tokenizers`` package, written without it: a base install
    has no ``tokenizers``)."""
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [_added(i, name) for i, name in sorted(v.specials.items())],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Replace", "pattern": {"String": a}, "content": b} for a, b in v.replacements]},
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "."}, "behavior": "Isolated", "invert": False},
        "post_processor": None,
        "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": v.vocab, "unk_token": v.unk},
    }


def write_hf_char_tokenizer(v: CharVocab, out_dir: str | Path) -> list[str]:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (a fast tokenizer, no special tokens added on
    encode) into ``out_dir``; returns the names written."""
    out = Path(out_dir)
    (out / "tokenizer.json").write_text(json.dumps(char_tokenizer_json(v), indent=2) + "\n")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "bos_token": "<bos>",
              "eos_token": "<eos>", "sep_token": "<sep>", "unk_token": v.unk, "add_bos_token": False,
              "add_eos_token": False, "model_max_length": 1 << 40, "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return list(FILES)


# ---- protein (data.tokenizer protein: protein.ProteinTokenizer) ---------------------------------------------
def protein_char_vocab(tok: ProteinTokenizer) -> CharVocab:
    """The 32 protein ids (``data/protein.py``): ``<pad> <bos> <eos> <sep>``, the 25 residue letters, the gap,
    ``<unk>`` (id 30, unused by the run) and ``<unused31>``; the table is the run's (``data.gaps``)."""
    unk_id = GAP_ID + 1
    vocab = {**tok.vocab(), "<unk>": unk_id, **{f"<unused{i}>": i for i in range(unk_id + 1, PROTEIN_VOCAB_SIZE)}}
    letters = {FIRST_RESIDUE_ID + k: ch for k, ch in enumerate(LETTERS)}
    return CharVocab(vocab, {**_SPECIAL_NAMES, unk_id: "<unk>"}, lut_replacements(tok.lut, letters))


def write_hf_protein_tokenizer(tok: ProteinTokenizer, out_dir: str | Path) -> list[str]:
    """The protein tokenizer ``tok`` (a ``ProteinTokenizer``) as HF tokenizer files in ``out_dir``."""
    return write_hf_char_tokenizer(protein_char_vocab(tok), out_dir)

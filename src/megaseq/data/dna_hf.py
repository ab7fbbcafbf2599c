"""The single-nucleotide DNA tokenizer written as a Hugging Face tokenizer, so a DNA run's export loads with
``AutoTokenizer.from_pretrained(RUN/hf)`` and tokenizes as the run did.

The vocabulary is the run's 16 ids (``data.tokenizer``: ``<pad> <bos> <eos> <sep> A C G T N`` and 7 unused
ids). The normalizer is the run's byte table (``tokenizer.byte_lut`` with the run's ``data.lowercase`` and
``data.non_acgt``): whitespace dropped, soft-masked bases upper-cased (or read as N), IUPAC ambiguity codes read
as N; the pre-tokenizer splits every character, and a WordLevel model maps each to its id. One difference: a
character the run refuses (an illegal byte, or an ambiguity code under ``data.non_acgt error``) becomes
``<unk>`` (the first unused id) instead of an error, as a tokenizer cannot refuse its input.
"""

from __future__ import annotations

import json
from pathlib import Path

from megaseq.data.tokenizer import _SPECIAL_NAMES, A_ID, DNA_VOCAB_SIZE, N_ID, SKIP, DnaTokenizer, byte_lut

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
    lut, letters = byte_lut(tok.lowercase, tok.non_acgt), {A_ID + k: ch for k, ch in enumerate("ACGTN")}
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


def dna_tokenizer_json(tok: DnaTokenizer) -> dict[str, object]:
    """``tokenizer.json`` of ``tok`` (the format of the ``tokenizers`` package, written without it: a base install
    has no ``tokenizers``)."""
    specials = sorted({**_SPECIAL_NAMES, UNK_ID: "<unk>"}.items())
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [_added(i, name) for i, name in specials],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Replace", "pattern": {"String": a}, "content": b} for a, b in _replacements(tok)]},
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "."}, "behavior": "Isolated", "invert": False},
        "post_processor": None,
        "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": dna_vocab(), "unk_token": "<unk>"},
    }


def write_hf_dna_tokenizer(tok: DnaTokenizer, out_dir: str | Path) -> list[str]:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (a fast tokenizer, no special tokens added on
    encode: the run adds none to its windows) into ``out_dir``; returns the names written."""
    out = Path(out_dir)
    (out / "tokenizer.json").write_text(json.dumps(dna_tokenizer_json(tok), indent=2) + "\n")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "bos_token": "<bos>",
              "eos_token": "<eos>", "sep_token": "<sep>", "unk_token": "<unk>", "add_bos_token": False,
              "add_eos_token": False, "model_max_length": 1 << 40, "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return ["tokenizer.json", "tokenizer_config.json"]

"""Tokenizers: single-nucleotide DNA ids, and a thin wrapper over a local Hugging Face tokenizer.json.

DNA ids (``megaseq.models.presets.DNA_VOCAB_SIZE = 16`` is this vocabulary)::

    0 pad   1 bos   2 eos   3 sep (document separator)   4 A   5 C   6 G   7 T   8 N   9-15 unused

FASTA files are stored as uint8 arrays of these ids (``megaseq.data.fasta``), so a training
window becomes model input with one dtype cast; no genome is ever held as a Python string.
``HfTokenizer`` lets text, or DNA, go through a model's own tokenizer (``tokenizers`` package,
imported lazily: it comes with the ``hf`` extra).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

PAD_ID, BOS_ID, EOS_ID, SEP_ID = 0, 1, 2, 3
A_ID, C_ID, G_ID, T_ID, N_ID = 4, 5, 6, 7, 8
ACGT_IDS = (A_ID, C_ID, G_ID, T_ID)
DNA_VOCAB_SIZE = 16
IUPAC_AMBIGUITY = "RYSWKMBDHVU"  # IUPAC nucleotide codes other than A C G T N (U: uracil)

# Markers in the byte lookup table; all >= DNA_VOCAB_SIZE so they never collide with an id.
SKIP, ILLEGAL, AMBIGUOUS = 255, 254, 253
_WHITESPACE = b" \t\r\n\v\f"
_SPECIAL_NAMES = {PAD_ID: "<pad>", BOS_ID: "<bos>", EOS_ID: "<eos>", SEP_ID: "<sep>"}
# Common end-of-document spellings, tried when tokenizer_config.json does not name one.
_EOS_GUESSES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>")


def byte_lut(lowercase: str = "upper", non_acgt: str = "n") -> np.ndarray:
    """Byte -> DNA id table ``[256]`` uint8; whitespace -> SKIP, illegal bytes -> ILLEGAL.

    ``lowercase``: 'upper' reads soft-masked bases as bases, 'n' reads them as N.
    ``non_acgt``: 'n' maps IUPAC ambiguity codes to N, 'error' marks them AMBIGUOUS (rejected).
    """
    if lowercase not in ("upper", "n"):
        raise ValueError(f"data.lowercase must be 'upper' or 'n', got {lowercase!r}")
    if non_acgt not in ("n", "error"):
        raise ValueError(f"data.non_acgt must be 'n' or 'error', got {non_acgt!r}")
    lut = np.full(256, ILLEGAL, dtype=np.uint8)
    lut[list(_WHITESPACE)] = SKIP
    ambiguous = N_ID if non_acgt == "n" else AMBIGUOUS
    for ch in IUPAC_AMBIGUITY:
        lut[ord(ch)] = ambiguous
        lut[ord(ch.lower())] = N_ID if lowercase == "n" else ambiguous  # soft-masked: as N
    for ch, idx in zip("ACGTN", (A_ID, C_ID, G_ID, T_ID, N_ID)):
        lut[ord(ch)] = idx
        lut[ord(ch.lower())] = idx if lowercase == "upper" else N_ID
    return lut


def complement_lut() -> np.ndarray:
    """DNA id -> id of the complementary base ``[256]`` uint8 (A<->T, C<->G; N and specials fixed)."""
    lut = np.arange(256, dtype=np.uint8)
    lut[[A_ID, C_ID, G_ID, T_ID]] = [T_ID, G_ID, C_ID, A_ID]
    return lut


def reverse_complement(ids: np.ndarray) -> np.ndarray:
    """The reverse complement of a DNA id array (a new array)."""
    return complement_lut()[ids[::-1]]


def _letters() -> np.ndarray:
    table = np.full(256, ord("?"), dtype=np.uint8)
    table[[A_ID, C_ID, G_ID, T_ID, N_ID]] = list(b"ACGTN")
    return table


class DnaTokenizer:
    """Single-nucleotide tokenizer over the fixed 16-id DNA vocabulary above."""

    kind = "dna"
    vocab_size = DNA_VOCAB_SIZE
    pad_id, bos_id, eos_id, sep_id = PAD_ID, BOS_ID, EOS_ID, SEP_ID

    def __init__(self, lowercase: str = "upper", non_acgt: str = "n") -> None:
        self.lowercase, self.non_acgt = lowercase, non_acgt
        self.lut = byte_lut(lowercase, non_acgt)

    def encode(self, text: str | bytes, add_bos: bool = False, add_eos: bool = False) -> np.ndarray:
        """Bases -> uint8 ids ``[L]`` (whitespace dropped); an illegal character raises ValueError."""
        raw = text.encode("ascii", errors="replace") if isinstance(text, str) else bytes(text)
        ids = self.lut[np.frombuffer(raw, dtype=np.uint8)]
        bad = np.flatnonzero((ids >= AMBIGUOUS) & (ids != SKIP))
        if bad.size:
            i = int(bad[0])
            what = "illegal character"
            if ids[i] == AMBIGUOUS:
                what = "IUPAC ambiguity code (data.non_acgt=error)"
            raise ValueError(f"DNA text position {i}: {what} {chr(raw[i])!r}")
        ids = ids[ids != SKIP]
        parts = ([np.array([BOS_ID], np.uint8)] if add_bos else []) + [ids]
        parts += [np.array([EOS_ID], np.uint8)] if add_eos else []
        return np.concatenate(parts) if len(parts) > 1 else ids

    def decode(self, ids: Any, skip_special: bool = True) -> str:
        """ids -> bases; special ids are dropped (or spelled ``<bos>`` etc. with skip_special=False)."""
        arr = np.asarray(ids).astype(np.int64).ravel()
        if skip_special:
            arr = arr[(arr >= A_ID) & (arr <= N_ID)]
            return _letters()[arr].tobytes().decode("ascii")
        return "".join(_SPECIAL_NAMES.get(int(i), "ACGTN"[i - A_ID] if A_ID <= i <= N_ID else f"<{i}>")
                       for i in arr)

    def bases(self, ids: np.ndarray) -> str:
        """A uint8 id array of bases (no specials) -> its string, vectorized (for HF re-tokenization)."""
        return _letters()[ids].tobytes().decode("ascii")

    def check_vocab(self, model_vocab_size: int) -> None:
        _check_vocab("dna", N_ID + 1, model_vocab_size)


def _check_vocab(name: str, num_ids: int, model_vocab_size: int) -> None:
    if num_ids > model_vocab_size:
        raise ValueError(
            f"tokenizer {name} uses ids up to {num_ids - 1} but the model's vocabulary has only "
            f"{model_vocab_size} entries: set data.tokenizer to the model's own tokenizer, or use a model "
            f"whose vocab_size is at least {num_ids} (DNA presets use {DNA_VOCAB_SIZE})")


def _import_tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise ImportError("a Hugging Face tokenizer needs the `tokenizers` package: "
                          "pip install 'megaseq[hf]'") from None
    return tokenizers


def _token_name(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HfTokenizer:
    """A local ``tokenizer.json`` (or a checkpoint directory holding one), through ``tokenizers``.

    The end-of-document token comes from ``eos_token`` if given, else ``tokenizer_config.json``
    beside the file, else the first of a few common spellings the vocabulary holds (or None).
    """

    kind = "hf"

    def __init__(self, path: str | Path, eos_token: str | None = None) -> None:
        p = Path(path).expanduser()
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise ValueError(
                f"data.tokenizer: {file} not found; give 'dna', a tokenizer.json, or a checkpoint directory "
                f"holding tokenizer.json (a slow-only tokenizer can be converted with transformers' "
                f"AutoTokenizer.from_pretrained(dir).save_pretrained(dir))")
        self.path = file
        self._tok = _import_tokenizers().Tokenizer.from_file(str(file))
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.num_ids = max(vocab.values()) + 1
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        config = _read_json(file.parent / "tokenizer_config.json")
        self.eos_id = self._special_id(eos_token or _token_name(config.get("eos_token")), _EOS_GUESSES, vocab)
        self.bos_id = self._special_id(_token_name(config.get("bos_token")), (), vocab)
        self.pad_id = self._special_id(_token_name(config.get("pad_token")), (), vocab)

    @staticmethod
    def _special_id(name: str | None, guesses: tuple[str, ...], vocab: dict[str, int]) -> int | None:
        for candidate in ((name,) if name else ()) + guesses:
            if candidate in vocab:
                return vocab[candidate]
        return None

    def encode(self, text: str) -> np.ndarray:
        """Text -> int32 ids ``[L]`` (no special tokens added)."""
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        out = self._tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in out]

    def decode(self, ids: Any, skip_special: bool = True) -> str:
        return self._tok.decode([int(i) for i in np.asarray(ids).ravel()], skip_special_tokens=skip_special)

    def encode_dna(self, base_ids: np.ndarray, chunk_bases: int = 1 << 16) -> np.ndarray:
        """DNA ids -> this tokenizer's ids, in chunks of ``chunk_bases`` bases.

        Chunking keeps BPE from merging over one multi-megabase "word" (slow); a token never spans
        a chunk boundary, so the result can differ from tokenizing the whole record at once.
        """
        letters = DnaTokenizer().bases
        texts = [letters(base_ids[i:i + chunk_bases]) for i in range(0, len(base_ids), chunk_bases)]
        parts = self.encode_batch(texts) if texts else []
        return np.concatenate(parts) if parts else np.zeros(0, np.int32)

    def check_vocab(self, model_vocab_size: int) -> None:
        _check_vocab(str(self.path), self.num_ids, model_vocab_size)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}

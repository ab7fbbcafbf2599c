"""Text documents (JSONL or .txt) tokenized with a Hugging Face tokenizer and packed into one stream.

Documents:
- ``.jsonl`` (optionally .gz/.xz): one JSON object per line, text in field ``data.text_field``.
- ``.txt``: the whole file is one document (``txt_docs="file"``, the default: long-context data
  such as a book or a lab record is one document), or each blank-line-separated paragraph is one
  (``txt_docs="paragraph"``).

Packing: documents are tokenized, each followed by the tokenizer's end-of-document token when it
has one (``HfTokenizer.eos_id``), and concatenated into one stream with a document id per token.
Windows of ``seq_len + 1`` tokens are cut from the stream by ``windows.WindowSampler``; the
``doc_ids`` of a window keep every token-mixing layer inside its document, and the label of a
document's last token (its eos), which would predict the next document's first token, is -100.
A document's first token is therefore never a label: nothing in its document precedes it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megaseq.data.fasta import expand_paths, open_maybe_compressed

_TOKENIZE_BATCH = 256  # documents per encode_batch call: bounded memory, parallel inside tokenizers


@dataclass
class PackedText:
    """Token stream ``tokens`` [T] int32 with ``doc_ids`` [T] int32 (increasing, one per document)."""

    id: str
    tokens: np.ndarray
    doc_ids: np.ndarray
    source: str
    num_docs: int

    def __len__(self) -> int:
        return len(self.tokens)


def _kind(path: Path) -> str:
    name = path.name.lower()
    for suffix in (".gz", ".xz"):
        name = name.removesuffix(suffix)
    if name.endswith(".jsonl"):
        return "jsonl"
    if name.endswith(".txt"):
        return "txt"
    raise ValueError(f"text file {path}: expected .jsonl or .txt (optionally .gz/.xz) for data.kind=text")


def _read_text(path: Path) -> str:
    with open_maybe_compressed(path) as fh:
        return fh.read().decode("utf-8", errors="replace")


def read_documents(path: str | Path, text_field: str = "text", txt_docs: str = "file") -> Iterator[str]:
    """The documents of one file (empty ones skipped); see the module docstring for the formats."""
    path = Path(path)
    if txt_docs not in ("file", "paragraph"):
        raise ValueError(f"txt_docs must be 'file' or 'paragraph', got {txt_docs!r}")
    if _kind(path) == "txt":
        text = _read_text(path)
        docs = [text] if txt_docs == "file" else re.split(r"\n(?:[ \t\r\f\v]*\n)+", text)
        yield from (d for d in docs if d.strip())
        return
    with open_maybe_compressed(path) as fh:
        for num, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"text file {path} line {num}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or text_field not in obj:
                keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
                raise ValueError(f"text file {path} line {num}: no field {text_field!r} (found {keys}); "
                                 f"set data.text_field to the field holding the document text")
            if not isinstance(obj[text_field], str):
                raise ValueError(f"text file {path} line {num}: field {text_field!r} holds "
                                 f"{type(obj[text_field]).__name__}, expected a string")
            if obj[text_field].strip():
                yield obj[text_field]


def _batched(items: Iterator[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def pack_documents(token_docs: Sequence[np.ndarray], eos_id: int | None, name: str = "text",
                   source: str = "") -> PackedText:
    """Concatenate tokenized documents (eos after each when ``eos_id`` is set) with per-token doc ids."""
    eos = np.array([] if eos_id is None else [eos_id], dtype=np.int32)
    parts, lengths = [], []
    for doc in token_docs:
        if len(doc) == 0:
            continue
        parts += [doc.astype(np.int32, copy=False), eos]
        lengths.append(len(doc) + len(eos))
    tokens = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    doc_ids = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)
    return PackedText(name, tokens, doc_ids, source, len(lengths))


def load_text(paths: list[str], tokenizer: Any, text_field: str = "text", txt_docs: str = "file",
              setting: str = "data.train") -> PackedText:
    """Read, tokenize and pack the files named by ``setting`` into one stream."""
    if getattr(tokenizer, "kind", None) != "hf":
        raise ValueError("data.kind=text needs a Hugging Face tokenizer: set data.tokenizer to a "
                         "tokenizer.json or a checkpoint directory holding one")
    files = expand_paths(paths, setting)
    if not files:
        raise ValueError(f"{setting} is empty: data.kind=text needs .jsonl or .txt files")
    token_docs: list[np.ndarray] = []
    for f in files:
        _kind(f)
        for batch in _batched(read_documents(f, text_field, txt_docs), _TOKENIZE_BATCH):
            token_docs.extend(tokenizer.encode_batch(batch))
    packed = pack_documents(token_docs, tokenizer.eos_id, name=f"{setting} text",
                            source=", ".join(f.name for f in files))
    if packed.num_docs == 0:
        raise ValueError(f"{setting} files ({packed.source}) hold no non-empty documents")
    return packed

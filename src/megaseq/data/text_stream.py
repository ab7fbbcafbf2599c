"""Text from columnar files (``data.kind text`` with parquet, Arrow or ``datasets`` directories), streamed.

The documents of ``data.column`` (default ``data.text_field``) are tokenized a record batch at a time and
cut into consecutive windows (``columnar.text_windows``) as training asks for them
(``packing.StreamWindows``): the corpus is never held in memory. The packing rules are those of
``data.text``: an end-of-document token after each document, no attention or label across documents.
Held-out files give their first ``eval.max_windows`` windows (0: all).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from megaseq.data.columnar import text_windows
from megaseq.data.packing import StreamWindows, eval_windows
from megaseq.data.sources import data_paths, is_columnar


def build_text_stream(data_cfg: Any, tok: Any, seq_len: int, eval_len: int, max_windows: int,
                      kw: dict[str, Any]) -> dict[str, Any]:
    """The fields of ``data.Data`` for text in columnar files."""
    if getattr(tok, "kind", None) != "hf":
        raise ValueError("data.kind=text needs a Hugging Face tokenizer: set data.tokenizer to a tokenizer.json "
                         "or a checkpoint directory holding one")
    column = data_cfg.column or data_cfg.text_field
    paths = {s: data_paths(list(getattr(data_cfg, s)), f"data.{s}") for s in ("train", "heldout")}
    for setting, files in paths.items():
        other = [str(p) for p in files if not is_columnar(p)]
        if other:
            raise ValueError(f"data.{setting}: {other} mixed with columnar files; give parquet, Arrow or datasets "
                             "directories only (or convert the JSONL) in one run")

    def stream() -> Iterator[Any]:
        return text_windows(paths["train"], tok, column, seq_len, "data.train")

    if next(stream(), None) is None:
        raise ValueError(f"data.train holds fewer than data.seq_len + 1 = {seq_len + 1} tokens of text in column "
                         f"{column!r}; lower data.seq_len or add data")
    heldout = {p.name: eval_windows(text_windows([p], tok, column, eval_len, "data.heldout"), max_windows)
               for p in paths["heldout"]}
    for name, windows in heldout.items():
        if not windows:
            raise ValueError(f"data.heldout {name}: fewer than eval.seq_len + 1 = {eval_len + 1} tokens")
    return {"train": StreamWindows(stream, seq_len, what="data.train", **kw), "heldout": heldout, "tokenizer": tok}

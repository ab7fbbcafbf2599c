"""Text from columnar files (``data.kind text`` with parquet, Arrow or ``datasets`` directories), streamed.

The documents of ``data.column`` (default ``data.text_field``) are tokenized a record batch at a time and
cut into consecutive windows (``columnar.text_windows``) as training asks for them
(``packing.StreamWindows``): the corpus is never held in memory. The packing rules are those of
``data.text``: an end-of-document token after each document, no attention or label across documents.
Each data-parallel rank reads and tokenizes only its own share of the rows, in the order of
``data.shuffle_buffer`` (``doc_order.DocOrder``); a resumed run reads from the position its checkpoint saved
(``packing.StreamWindows``), tokenizing from there on. Held-out files give their first ``eval.max_windows`` windows
(0: all).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from megaseq.data.columnar import positioned_text_windows, text_windows
from megaseq.data.doc_order import DocOrder, PassDocs
from megaseq.data.packing import Positioned, StreamPosition, StreamWindows, eval_windows
from megaseq.data.seek import fingerprint, read_share
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

    buffer = getattr(data_cfg, "shuffle_buffer", 0)
    orders = [DocOrder(r, kw["world_size"], buffer, kw["seed"]) for r in range(kw["world_size"])]

    mine = orders[kw["rank"]]

    def read(wanted: Sequence[int], start: int) -> Iterator[tuple[int, Any]]:
        return read_share(paths["train"], column, (), "a JSON object", "data.train", mine, wanted, start)

    def stream(at: StreamPosition) -> Positioned:
        docs = PassDocs(mine, read, at.pass_number, at.order, at.pending)
        return positioned_text_windows(docs, tok, column, seq_len, at)

    for order in orders:  # every rank checks every rank's share, so all fail alike before a model is built
        if next(text_windows(paths["train"], tok, column, seq_len, "data.train", order), None) is None:
            share = f" for each of the {len(orders)} data-parallel ranks" if len(orders) > 1 else ""
            raise ValueError(f"data.train holds fewer than data.seq_len + 1 = {seq_len + 1} tokens of text in column "
                             f"{column!r}{share}; lower data.seq_len (or parallel.dp) or add data")
    heldout = {p.name: eval_windows(text_windows([p], tok, column, eval_len, "data.heldout"), max_windows)
               for p in paths["heldout"]}
    for name, windows in heldout.items():
        if not windows:
            raise ValueError(f"data.heldout {name}: fewer than eval.seq_len + 1 = {eval_len + 1} tokens")
    train = StreamWindows(stream, seq_len, what="data.train", shuffle_buffer=buffer,
                          fingerprint=fingerprint(paths["train"]), **kw)
    return {"train": train, "heldout": heldout, "tokenizer": tok}

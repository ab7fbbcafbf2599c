"""The training stream and held-out windows of conversations (``data.kind chat``).

Conversations are read in file order, rendered (``chat.ChatRenderer``) and packed whole into windows
(``packing.pack_whole``); training streams them (``packing.StreamWindows``), so a corpus larger than
host memory trains. Each data-parallel rank renders and trains on its own share of the conversations, in
the order of ``data.shuffle_buffer`` (``doc_order.DocOrder``). Held-out conversations each fill their own
window, so the report's positions are positions in the conversation, and only target tokens (assistant
turns) are scored.

On a run's first start, before any model is built, the whole training set is read once, on every rank (so
every rank fails alike): a bad record fails there, naming its file and line, and a set with no target token,
or conversations cut by data.seq_len, are reported. A set of at most ``CACHE_TOKENS`` tokens is kept as
rendered then (each rank its own share; rendering a long trace takes seconds); a larger one is rendered again
on each pass. The summary of that read (``summary``: the ``PackStats`` and ``scan_key``) goes into the
training source's state (``StreamWindows.scan``), so every checkpoint carries it.

A resumed run reads its stream from the position its checkpoint saved (``packing.StreamWindows``), rendering
from there on. It reads the set again first only when it cannot trust the first start's read: it trusts it,
and uses the stored summary for the same checks and the report, when the checkpoint's data state holds a
summary and a fingerprint (``seek.fingerprint``: names, sizes, first and last 64 KiB) equal to those of the
``data.train`` files now, and the summary's ``scan_key`` is the same: the files' modification times, and what
renders and packs them (the tokenizer's vocabulary, the template, the mask method, data.loss_roles, data.column,
data.seq_len, the vocabulary size, the pad id). Files moved with their times kept resume without a read; files copied
(new times) or touched are read again. A resume on files whose fingerprint changed (edited in place) is refused
before anything is read (``packing.check_same_files``). A trusted set is not kept in memory, whatever its size: its
windows are rendered as they are read, the same windows bitwise. A checkpoint without the summary resumes
with the full read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from megaseq.data.chat import ROLES, ChatRenderer, check_record, load_chat_tokenizer
from megaseq.data.chat_template import template_sha
from megaseq.data.doc_order import DocOrder, PassDocs
from megaseq.data.packing import (
    PackStats,
    Positioned,
    StreamPosition,
    StreamWindows,
    check_same_files,
    eval_windows,
    pack_docs,
    pack_whole,
)
from megaseq.data.seek import data_files, fingerprint, read_share
from megaseq.data.sources import data_paths, iter_records

CACHE_TOKENS = 1 << 26  # training data up to this many tokens is rendered once and kept (int32 ids + mask bytes)

# the report's words for ``ChatRenderer.method``: where a run's loss mask comes from
MASK_SOURCE = {"prefix": "the rendered prefixes of each turn", "generation": "the template's generation marks",
               "marked form": "the generation marks of the template's known marked form"}


WHAT = "one JSON object with a 'messages' list"
TRUSTED = "data.train: checked at the run's first start (same files); not re-read"


def conversations(paths: list[Path], renderer: ChatRenderer, column: str,
                  setting: str) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(ids, targets) of every conversation of ``paths`` in order."""
    for path in paths:
        for where, record in iter_records(path, column, ("tools",), WHAT, setting):
            yield render_record(renderer, column, where, record)


def render_record(renderer: ChatRenderer, column: str, where: str, record: Any) -> tuple[np.ndarray, np.ndarray]:
    messages, tools = check_record(record, column, where)
    return renderer.render(messages, tools, where)


def _scan(paths: list[Path], renderer: ChatRenderer, column: str, seq_len: int, setting: str,
          order: DocOrder) -> tuple[PackStats, list[Any] | None]:
    """Read and render everything once (every error before the model is built): what packing will do, and this
    rank's share of the rendered conversations when they hold at most ``CACHE_TOKENS`` tokens (else None:
    training streams)."""
    stats = PackStats()
    cache: list[Any] | None = []

    def keep() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        nonlocal cache
        for doc in conversations(paths, renderer, column, setting):
            if cache is not None:
                cache.append(doc)
                if stats.tokens > CACHE_TOKENS:
                    cache = None
            yield doc

    for _ in pack_whole(keep(), seq_len, renderer.pad_id, stats):
        pass
    cache = list(order.share(cache)) if cache is not None else None
    check_stats(stats, renderer, seq_len, setting, order)
    return stats, cache


def check_stats(stats: PackStats, renderer: ChatRenderer, seq_len: int, setting: str, order: DocOrder) -> None:
    """Refuse a set with fewer conversations than data-parallel ranks or no target token; warn of cut ones."""
    if stats.docs < order.world_size:
        raise ValueError(f"{setting} holds {stats.docs} conversations, fewer than the {order.world_size} data-parallel "
                         "ranks, each of which trains on its own share; add conversations or lower parallel.dp")
    if stats.targets == 0:
        raise ValueError(f"{setting}: no token of roles {list(renderer.loss_roles)} in {stats.docs} conversations, "
                         "so there is nothing to learn; set data.loss_roles to roles the data has")
    if stats.split:
        warnings.warn(f"{setting}: {stats.split} of {stats.docs} conversations are longer than data.seq_len + 1 = "
                      f"{seq_len + 1} tokens (the longest {stats.longest}); each is cut into windows that do not see "
                      f"the earlier pieces: raise data.seq_len to at least {stats.longest - 1} to keep them whole",
                      stacklevel=4)


def scan_key(paths: list[Path], renderer: ChatRenderer, column: str, seq_len: int) -> str:
    """What a scan summary holds for besides the files' fingerprint: each file's name and modification time
    (ns), and what renders and packs the conversations: the tokenizer's vocabulary, its chat template, the loss
    roles, the column and the window length."""
    h = hashlib.sha256()
    for f in data_files(paths):
        h.update(f"{f.name}\0{f.stat().st_mtime_ns}\0".encode())
    h.update(vocabulary_sha(renderer.tok).encode())
    h.update(json.dumps([template_sha(renderer.tok.chat_template), renderer.method, list(renderer.loss_roles),
                         column, seq_len, renderer.num_ids, renderer.pad_id]).encode())
    return h.hexdigest()[:16]


def vocabulary_sha(tok: Any) -> str:
    """A fingerprint of what maps text to ids: a fast tokenizer's whole serialized form (vocabulary, merges,
    normalizer, pre-tokenizer), else its vocabulary and added tokens."""
    backend = getattr(tok, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tok.get_vocab().items()))
    return hashlib.sha256(text.encode()).hexdigest()


def summary(stats: PackStats, key: str) -> dict[str, Any]:
    """The scan's summary as a checkpoint keeps it (``StreamWindows.scan``)."""
    return {**dataclasses.asdict(stats), "key": key}


def trusted_stats(resume_state: dict[str, Any] | None, files: str, key: str) -> PackStats | None:
    """The first start's ``PackStats`` from a checkpoint's data state, when it was taken on the same files
    (``files``: their fingerprint now) and its summary's ``key`` is this run's; else None (read the set)."""
    state = resume_state or {}
    scan = state.get("scan")
    if not isinstance(scan, dict) or not files or state.get("fingerprint") != files or scan.get("key") != key:
        return None
    try:
        return PackStats(**{f.name: int(scan[f.name]) for f in dataclasses.fields(PackStats)})
    except (KeyError, TypeError, ValueError):
        return None


def build_chat(data_cfg: Any, seq_len: int, eval_len: int, max_windows: int, kw: dict[str, Any],
               vocab_size: int | None, resume_state: dict[str, Any] | None = None) -> dict[str, Any]:
    """The fields of ``data.Data`` for conversations. ``resume_state``: the data state of the checkpoint a run
    resumes from (its first start's scan summary is used when it holds for these files: the module docstring)."""
    bad = sorted(set(data_cfg.loss_roles) - set(ROLES))
    if bad or not data_cfg.loss_roles:
        raise ValueError(f"data.loss_roles {list(data_cfg.loss_roles)}: give roles among {', '.join(ROLES)}")
    if not data_cfg.train:
        raise ValueError("data.kind chat needs data.train: JSONL files with a 'messages' list per line, or "
                         "parquet / Arrow / datasets directories with a messages column")
    chat_template = getattr(data_cfg, "chat_template", "")
    renderer = ChatRenderer(load_chat_tokenizer(data_cfg.tokenizer, chat_template), tuple(data_cfg.loss_roles))
    if vocab_size is not None:
        renderer.check_vocab(vocab_size)
    column = data_cfg.column or "messages"
    train_paths = data_paths(list(data_cfg.train), "data.train")
    buffer = getattr(data_cfg, "shuffle_buffer", 0)
    order = DocOrder(kw["rank"], kw["world_size"], buffer, kw["seed"])
    files, key = fingerprint(train_paths), scan_key(train_paths, renderer, column, seq_len)
    check_same_files(resume_state, files)  # a resume on other files: refused before the set is read
    stats = trusted_stats(resume_state, files, key)
    trusted, cache = stats is not None, None
    if stats is None:
        stats, cache = _scan(train_paths, renderer, column, seq_len, "data.train", order)
    else:  # the first start's read of the same files: its summary, the same checks
        check_stats(stats, renderer, seq_len, "data.train", order)

    def read(wanted: Sequence[int], start: int) -> Iterator[tuple[int, Any]]:
        if cache is not None:
            return ((p, cache[p]) for p in itertools.chain(wanted, range(start, len(cache))))
        return read_share(train_paths, column, ("tools",), WHAT, "data.train", order, wanted, start)

    def to_doc(doc: Any) -> tuple[np.ndarray, np.ndarray]:
        return doc if cache is not None else render_record(renderer, column, *doc)

    def stream(at: StreamPosition) -> Positioned:
        docs = PassDocs(order, read, at.pass_number, at.order, at.pending)
        return pack_docs(docs, to_doc, seq_len, renderer.pad_id, at)

    train = StreamWindows(stream, seq_len, what="data.train", shuffle_buffer=buffer, fingerprint=files, **kw)
    train.scan = summary(stats, key)
    heldout = {}
    for path in data_paths(list(data_cfg.heldout), "data.heldout"):
        docs = conversations([path], renderer, column, "data.heldout")
        heldout[path.name] = eval_windows(pack_whole(docs, eval_len, renderer.pad_id, one_per_window=True),
                                          max_windows)
    roles = ", ".join(renderer.loss_roles)
    source = f"data.chat_template {chat_template}" if chat_template else "the tokenizer's"
    how = MASK_SOURCE[renderer.method]
    note = (f"Scored: tokens of the {roles} turns only (the mask from {how}; {stats.targets} of "
            f"{stats.tokens} training tokens are targets); a position is a position in the conversation. Chat "
            f"template: {source} (sha256 {template_sha(renderer.tok.chat_template)[:12]}).")
    log = [TRUSTED] if trusted else []
    return {"train": train, "heldout": heldout, "tokenizer": renderer, "notes": [note, *(f"{t}." for t in log)],
            "log": log}

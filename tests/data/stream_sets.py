"""Small streamed data sets for resume tests: conversations (JSONL, parquet) and text (parquet, Arrow, a datasets
directory), written once per module, and the training stream of one data-parallel rank over each."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np

import megaseq.data.chat_build as chat_build
import megaseq.data.columnar as columnar
from chat_helpers import make_chat_tokenizer, write_jsonl
from megaseq.config import DataConfig
from megaseq.data import build_data

N = 30  # documents
CHAT_SEQ_LEN, TEXT_SEQ_LEN = 31, 7
TEXT_BATCH = 3  # documents tokenized at a time
# conversation i: 1 to 4 exchanges; every 7th has 12 (96 tokens: cut into 3 windows of 32)
CONVS = [[m for j in range(12 if i % 7 == 3 else 1 + i % 4)
          for m in ({"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{j}"})]
         for i in range(N)]
TEXTS = [" ".join(f"w{(i * 7 + j) % 50}" for j in range(1 + (i * 5) % 13)) for i in range(N)]
FORMATS = ["chat.jsonl", "chat.parquet", "chat kept", "text.parquet", "text.datasets"]


def write_sets(root: Path) -> dict[str, Path]:
    """Every format of the module docstring under ``root``, with the tokenizers."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, models, pre_tokenizers

    out = {"chat tok": make_chat_tokenizer(root / "chat_tok", conversations=[(c, None) for c in CONVS])}
    out["chat.jsonl"] = write_jsonl(root / "chat.jsonl", [{"messages": c} for c in CONVS])
    out["chat.parquet"] = root / "chat.parquet"
    pq.write_table(pa.table({"messages": CONVS}), str(out["chat.parquet"]), row_group_size=4)
    tk = Tokenizer(models.WordLevel({"<eos>": 0} | {f"w{i}": i + 1 for i in range(50)}, unk_token="<eos>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    (root / "text_tok").mkdir()
    tk.save(str(root / "text_tok" / "tokenizer.json"))
    (root / "text_tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    out["text tok"] = root / "text_tok" / "tokenizer.json"
    out["text.parquet"] = root / "text.parquet"
    pq.write_table(pa.table({"text": TEXTS}), str(out["text.parquet"]), row_group_size=4)
    folder = root / "text_ds"
    folder.mkdir()
    table = pa.table({"text": TEXTS, "n": list(range(N))})
    with pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb") as sink:
        writer = pa.ipc.new_stream(sink, table.schema)
        for batch in table.to_batches(max_chunksize=3):
            writer.write_batch(batch)
        writer.close()
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    out["text.datasets"] = folder
    return out


def data_config(sets: dict[str, Path], fmt: str, buffer: int, seed: int = 3) -> DataConfig:
    if fmt.startswith("chat"):
        path = sets["chat.parquet" if fmt == "chat.parquet" else "chat.jsonl"]
        return DataConfig(kind="chat", tokenizer=str(sets["chat tok"]), train=[str(path)], seq_len=CHAT_SEQ_LEN,
                          shuffle_buffer=buffer, seed=seed)
    return DataConfig(kind="text", tokenizer=str(sets["text tok"]), train=[str(sets[fmt])], seq_len=TEXT_SEQ_LEN,
                      shuffle_buffer=buffer, seed=seed)


def build_train(sets: dict[str, Path], fmt: str, rank: int, world: int, buffer: int, batch_size: int = 0,
                monkeypatch=None):
    """The training stream of rank ``rank`` of ``world`` (``batch_size`` 0: 4 windows a step on one rank, else 2:
    a pass is 7 to 8 steps); conversations are read from the file on every pass (``CACHE_TOKENS`` 0) unless
    ``fmt`` is 'chat kept', and text is tokenized ``TEXT_BATCH`` documents at a time (so windows are cut while
    the shuffle buffer is still full)."""
    batch_size = batch_size or (4 if world == 1 else 2)
    if fmt.startswith("chat.") and monkeypatch is not None:
        monkeypatch.setattr(chat_build, "CACHE_TOKENS", 0)
    if fmt.startswith("text") and monkeypatch is not None:
        monkeypatch.setattr(columnar, "BATCH_ROWS", TEXT_BATCH)
    data = build_data(data_config(sets, fmt, buffer), vocab_size=256, batch_size=batch_size, rank=rank,
                      world_size=world)
    return data.train


def run(train, steps: int) -> tuple[list[list], list[dict]]:
    """The windows of ``steps`` steps, and the state a checkpoint keeps after each (JSON and back)."""
    windows, states = [], []
    for _ in range(steps):
        windows.append(train.next_windows())
        states.append(json.loads(json.dumps(train.state_dict())))
    return windows, states


def resumed(fresh, state: dict):
    """A copy of the unread stream ``fresh`` resumed from ``state``."""
    again = copy.copy(fresh)
    again.load_state_dict(state)
    return again


def assert_same_windows(got: list[list], want: list[list]) -> None:
    assert len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want)):
        for wa, wb in zip(a, b, strict=True):
            for name, x, y in zip(("tokens", "doc_ids", "targets"), wa, wb):
                assert x.dtype == y.dtype and np.array_equal(x, y), f"step {step}: {name} differ"

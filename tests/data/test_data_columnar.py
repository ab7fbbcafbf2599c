"""Parquet, Arrow and datasets directories: exact ids and masks per format, streamed a record batch at a time."""

import json

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pytest.importorskip("tokenizers")
import pyarrow.parquet as pq  # noqa: E402

import megaseq.data.columnar as columnar  # noqa: E402
from megaseq.config import DataConfig  # noqa: E402
from megaseq.data import build_data, make_batch  # noqa: E402
from megaseq.data.columnar import iter_rows, text_windows  # noqa: E402
from megaseq.data.tokenizer import HfTokenizer  # noqa: E402

EOS, A, B, C, D, E = 0, 1, 2, 3, 4, 5
TEXTS = ["a b", "c d e", "a"]
IGN = -100
# written out: the stream a b <eos> c d e <eos> a <eos> cut into windows of 4 tokens sharing one token
WINDOWS = [([A, B, EOS, C], [0, 0, 0, 1]), ([C, D, E, EOS], [1, 1, 1, 1]), ([EOS, A, EOS], None)]
LABELS = [[B, EOS, IGN], [D, E, EOS]]  # <eos> ends a document: it predicts nothing


@pytest.fixture
def tok(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel({"<|endoftext|>": EOS, "a": A, "b": B, "c": C, "d": D, "e": E},
                                    unk_token="<|endoftext|>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.save(str(tmp_path / "tokenizer.json"))
    return HfTokenizer(tmp_path / "tokenizer.json")


def write_parquet(path, columns: dict, row_group_size: int = 2):
    pq.write_table(pa.table(columns), str(path), row_group_size=row_group_size)
    return path


def write_arrow(path, columns: dict, stream: bool):
    table = pa.table(columns)
    with pa.OSFile(str(path), "wb") as sink:
        writer = pa.ipc.new_stream(sink, table.schema) if stream else pa.ipc.new_file(sink, table.schema)
        for batch in table.to_batches(max_chunksize=1):
            writer.write_batch(batch)
        writer.close()
    return path


def write_datasets_dir(folder, columns: dict):
    """The layout ``datasets.Dataset.save_to_disk`` writes: Arrow stream shards listed in state.json."""
    folder.mkdir()
    write_arrow(folder / "data-00000-of-00001.arrow", columns, stream=True)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (folder / "dataset_info.json").write_text("{}")
    return folder


def check_text_windows(windows) -> None:
    assert [w[0].tolist() for w in windows] == [w for w, _ in WINDOWS[:2]]
    assert [w[1].tolist() for w in windows] == [d for _, d in WINDOWS[:2]]
    labels = [make_batch([w[0]], [w[1]])["labels"][0].tolist() for w in windows]
    assert labels == LABELS


@pytest.mark.parametrize("fmt", ["parquet", "arrow-file", "arrow-stream", "datasets"])
def test_text_windows_exact_per_format(tmp_path, tok, fmt):
    cols = {"text": TEXTS, "other": [1, 2, 3]}
    path = {"parquet": lambda: write_parquet(tmp_path / "t.parquet", cols),
            "arrow-file": lambda: write_arrow(tmp_path / "t.arrow", cols, stream=False),
            "arrow-stream": lambda: write_arrow(tmp_path / "t.arrow", cols, stream=True),
            "datasets": lambda: write_datasets_dir(tmp_path / "ds", cols)}[fmt]()
    check_text_windows(list(text_windows([path], tok, "text", 3, "data.train")))


def test_document_separator_leaking_fails(tmp_path, tok):
    """Broken variant: each <eos> counted in the next document."""
    path = write_parquet(tmp_path / "t.parquet", {"text": TEXTS})
    windows = [(t, np.concatenate([d[:1], d[:-1]]), m) for t, d, m in text_windows([path], tok, "text", 3, "x")]
    with pytest.raises(AssertionError):
        check_text_windows(windows)


def test_rows_stream_one_record_batch_at_a_time(tmp_path, monkeypatch):
    path = write_parquet(tmp_path / "t.parquet", {"text": [str(i) for i in range(100)]}, row_group_size=10)
    monkeypatch.setattr(columnar, "BATCH_ROWS", 10)
    decoded = []
    real = columnar._batches

    def counting(*args):
        for batch in real(*args):
            decoded.append(batch.num_rows)
            yield batch

    monkeypatch.setattr(columnar, "_batches", counting)
    rows = iter_rows(path, "text")
    assert [next(rows)[1]["text"] for _ in range(12)] == [str(i) for i in range(12)]
    assert decoded == [10, 10]  # two batches of 10 rows for 12 rows, not the file's 100


def test_build_data_text_from_parquet_trains_and_resumes(tmp_path, tok):
    train = write_parquet(tmp_path / "train.parquet", {"body": TEXTS * 4})
    held = write_parquet(tmp_path / "held.parquet", {"body": TEXTS})
    cfg = DataConfig(kind="text", tokenizer=str(tmp_path / "tokenizer.json"), train=[str(train)],
                     heldout=[str(held)], column="body", seq_len=3)
    data = build_data(cfg, vocab_size=8)
    first = data.train.next_batch()
    assert first["input_ids"][0].tolist() == [A, B, EOS] and first["labels"][0].tolist() == LABELS[0]
    assert len(data.heldout["held.parquet"]) == 2
    state = data.train.state_dict()
    again = build_data(cfg, vocab_size=8).train
    again.load_state_dict(state)
    assert again.next_batch()["input_ids"].equal(data.train.next_batch()["input_ids"])


def test_missing_column_names_file_columns_and_fix(tmp_path, tok):
    path = write_parquet(tmp_path / "t.parquet", {"content": TEXTS})
    with pytest.raises(ValueError) as e:
        list(iter_rows(path, "text"))
    for word in ("t.parquet", "no column 'text'", "columns: content", "--data.column"):
        assert word in str(e.value)


def test_chat_messages_column_equals_jsonl(tmp_path):
    """A messages column (structs; absent fields read back as null) renders exactly as the JSONL records."""
    pytest.importorskip("transformers")
    from chat_helpers import CONVERSATION, SHORT, TOOLS, make_chat_tokenizer, write_jsonl

    folder = make_chat_tokenizer(tmp_path / "tok")
    parquet = write_parquet(tmp_path / "c.parquet", {"messages": [CONVERSATION, SHORT], "tools": [TOOLS, None]})
    jsonl = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION, "tools": TOOLS}, {"messages": SHORT}])
    base = {"kind": "chat", "tokenizer": str(folder), "seq_len": 127}
    from_parquet = build_data(DataConfig(**base, train=[str(parquet)]), vocab_size=64).train.next_batch()
    from_jsonl = build_data(DataConfig(**base, train=[str(jsonl)]), vocab_size=64).train.next_batch()
    assert from_parquet["input_ids"].equal(from_jsonl["input_ids"])
    assert from_parquet["labels"].equal(from_jsonl["labels"])
    assert int((from_parquet["labels"] != IGN).sum()) == 22 + 6 + 3 + 3


def test_protein_sequence_column(tmp_path):
    path = write_parquet(tmp_path / "fam.parquet", {"id": ["p1", "p2"], "sequence": ["MKVla", "M-KX"]})
    held = write_parquet(tmp_path / "held.parquet", {"sequence": ["MKV"] * 4})
    data = build_data(DataConfig(alphabet="protein", train=[str(path)], heldout=[str(held)], seq_len=10),
                      vocab_size=32)
    assert data.train.records[0].tokens.tolist() == [14, 12, 21, 13, 4, 3, 14, 29, 12, 26, 3]
    bad = write_parquet(tmp_path / "bad.parquet", {"sequence": ["MKV", "MJ"]})
    with pytest.raises(ValueError, match="bad.parquet row 1: protein sequence position 1: illegal character 'J'"):
        build_data(DataConfig(alphabet="protein", train=[str(bad)], seq_len=4), vocab_size=32)

"""Text: JSONL and .txt documents, tokenized with a tiny tokenizer built here, packed with doc bounds."""

import gzip
import json

import numpy as np
import pytest
import torch

from megaseq.config import DataConfig, EvalConfig
from megaseq.data import build_data
from megaseq.data.text import load_text, pack_documents, read_documents
from megaseq.data.tokenizer import HfTokenizer

pytest.importorskip("tokenizers")

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()


@pytest.fixture
def tok_dir(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "<|endoftext|>"])
    tok.train_from_iterator([" ".join(WORDS)], trainer)
    d = tmp_path / "tok"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return d


def random_docs(n, seed=0):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 15)))) for _ in range(n)]


def write_jsonl(path, docs, field="text", opener=open):
    with opener(path, "wt") as fh:
        for d in docs:
            fh.write(json.dumps({field: d, "id": 1}) + "\n")
        fh.write("\n")  # blank lines are skipped
    return path


def test_read_jsonl_and_txt(tmp_path):
    docs = random_docs(5)
    assert list(read_documents(write_jsonl(tmp_path / "a.jsonl", docs))) == docs
    assert list(read_documents(write_jsonl(tmp_path / "b.jsonl.gz", docs, "body", gzip.open), "body")) == docs
    (tmp_path / "c.txt").write_text("para one\nstill one\n\n  \npara two\n\n\n")
    assert list(read_documents(tmp_path / "c.txt")) == ["para one\nstill one\n\n  \npara two\n\n\n"]
    paragraphs = list(read_documents(tmp_path / "c.txt", txt_docs="paragraph"))
    assert paragraphs == ["para one\nstill one", "para two"]


def test_read_errors(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "ok"}\n{"body": "x"}\n')
    with pytest.raises(ValueError) as e:
        list(read_documents(tmp_path / "a.jsonl"))
    for word in ("a.jsonl line 2", "no field 'text'", "['body']", "data.text_field"):
        assert word in str(e.value)
    (tmp_path / "b.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(ValueError, match="b.jsonl line 2: not valid JSON"):
        list(read_documents(tmp_path / "b.jsonl"))
    (tmp_path / "c.jsonl").write_text('{"text": 3}\n')
    with pytest.raises(ValueError, match="holds int, expected a string"):
        list(read_documents(tmp_path / "c.jsonl"))
    (tmp_path / "d.parquet").write_text("x")
    with pytest.raises(ValueError, match="expected .jsonl or .txt"):
        list(read_documents(tmp_path / "d.parquet"))


def test_pack_documents():
    docs = [np.array([5, 6, 7]), np.array([], dtype=np.int64), np.array([8]), np.array([9, 9])]
    p = pack_documents(docs, eos_id=1)
    assert p.tokens.tolist() == [5, 6, 7, 1, 8, 1, 9, 9, 1]
    assert p.doc_ids.tolist() == [0, 0, 0, 0, 1, 1, 2, 2, 2]
    assert p.num_docs == 3
    q = pack_documents(docs, eos_id=None)
    assert q.tokens.tolist() == [5, 6, 7, 8, 9, 9] and q.doc_ids.tolist() == [0, 0, 0, 1, 2, 2]


def test_packed_windows_keep_documents_apart(tmp_path, tok_dir):
    docs = random_docs(60, seed=1)
    tok = HfTokenizer(tok_dir)
    stream = load_text([str(write_jsonl(tmp_path / "train.jsonl", docs))], tok)
    expected = []
    for d in docs:
        expected += tok.encode(d).tolist() + [tok.eos_id]
    assert stream.tokens.tolist() == expected and stream.num_docs == 60
    data = build_data(DataConfig(kind="text", train=[str(tmp_path / "train.jsonl")], tokenizer=str(tok_dir),
                                 seq_len=37, seed=3), batch_size=3)
    for _ in range(10):
        b = data.train.next_batch()
        ids, labels, doc = b["input_ids"], b["labels"], b["doc_ids"]
        assert doc.shape == ids.shape == (3, 37) and doc.dtype == torch.int32
        assert (doc[:, 0] == 0).all() and (doc.diff(dim=1) >= 0).all()
        for row in range(3):
            # find the window in the stream from its first token and check labels against doc ids there
            start = _locate(stream.tokens, ids[row].numpy())
            nxt_doc = stream.doc_ids[start + 1:start + 38]
            cross = nxt_doc != stream.doc_ids[start:start + 37]
            want = np.where(cross, -100, stream.tokens[start + 1:start + 38])
            assert labels[row].tolist() == want.tolist()
            assert (ids[row][torch.from_numpy(cross)] == tok.eos_id).all()  # a document's last token is eos


def _locate(stream: np.ndarray, window: np.ndarray) -> int:
    for s in range(len(stream) - len(window) + 1):
        if np.array_equal(stream[s:s + len(window)], window):
            return s
    raise AssertionError("window not found in stream")


def test_text_build_data_heldout_and_errors(tmp_path, tok_dir):
    train = write_jsonl(tmp_path / "train.jsonl", random_docs(30))
    (tmp_path / "held.txt").write_text(" ".join(random_docs(40, seed=2)))
    cfg = DataConfig(kind="text", train=[str(train)], heldout=[str(tmp_path / "held.txt")],
                     tokenizer=str(tok_dir), seq_len=16)
    data = build_data(cfg, EvalConfig(max_windows=2), vocab_size=64)
    assert data.unit == "token" and data.score_ids is None and list(data.heldout) == ["held.txt"]
    assert len(data.heldout["held.txt"]) == 2
    with pytest.raises(ValueError, match="needs a Hugging Face tokenizer"):
        build_data(DataConfig(kind="text", train=[str(train)]))
    with pytest.raises(ValueError, match="data.seq_len=100000 needs sequences of at least 100001 tokens"):
        build_data(DataConfig(kind="text", train=[str(train)], tokenizer=str(tok_dir), seq_len=100000))
    with pytest.raises(ValueError, match="DNA only"):
        build_data(DataConfig(kind="text", train=[str(train)], tokenizer=str(tok_dir),
                              reverse_complement=True))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no non-empty documents"):
        build_data(DataConfig(kind="text", train=[str(tmp_path / "empty.jsonl")], tokenizer=str(tok_dir)))


def test_fasta_through_hf_tokenizer(tmp_path):
    """DNA through a model's own (BPE) tokenizer: windows are of its tokens, k-mer baseline is off."""
    from tokenizers import Tokenizer, models, trainers

    rng = np.random.default_rng(0)
    bpe = Tokenizer(models.BPE())
    bpe.train_from_iterator(["".join(rng.choice(list("ACGT"), 400)) for _ in range(10)],
                            trainers.BpeTrainer(vocab_size=30, initial_alphabet=list("ACGT")))
    bpe.save(str(tmp_path / "tokenizer.json"))
    data = build_data(DataConfig(tokenizer=str(tmp_path), seq_len=256, reverse_complement=True),
                      heldout_tail=0.1)
    assert data.unit == "token" and data.train_records == []
    ids = data.train.next_batch()["input_ids"]
    assert ids.shape == (1, 256) and int(ids.max()) < bpe.get_vocab_size()
    assert any(r.id.endswith(":rc") for r in data.train.records)

"""Training windows (reproducible, resumable, uniform, reverse complement), held-out windows, random
tokens, and build_data's checks."""

import numpy as np
import pytest
import torch

from megaseq.config import DataConfig, EvalConfig
from megaseq.data import build_data
from megaseq.data.fasta import FastaRecord, default_genome_path, read_fasta
from megaseq.data.tokenizer import DnaTokenizer
from megaseq.data.windows import (
    EvalBatches,
    RandomTokens,
    WindowSampler,
    heldout_windows,
    make_batch,
)


def numbered_records(lengths, base=0):
    """Records whose every token says where it is: record r, offset i -> r * 100000 + i (int32)."""
    return [FastaRecord(f"r{r}", (r * 100_000 + np.arange(n)).astype(np.int32), "mem")
            for r, n in enumerate(lengths, start=base)]


def dna_records(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [FastaRecord(f"d{i}", rng.integers(4, 8, size=n).astype(np.uint8), "mem")
            for i, n in enumerate(lengths)]


def take(sampler, n):
    return [sampler.next_batch() for _ in range(n)]


def same(batches_a, batches_b):
    return all(torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
               for a, b in zip(batches_a, batches_b))


def test_windows_are_contiguous_slices_with_next_token_labels():
    recs = numbered_records([50, 13, 200, 7])
    s = WindowSampler(recs, seq_len=11, batch_size=3, seed=5)
    for batch in take(s, 20):
        assert batch["input_ids"].shape == batch["labels"].shape == (3, 11)
        assert batch["input_ids"].dtype == batch["labels"].dtype == torch.int64 and batch["doc_ids"] is None
        w = torch.cat([batch["input_ids"], batch["labels"][:, -1:]], dim=1)
        assert torch.equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])
        assert (w.diff(dim=1) == 1).all()  # contiguous inside one record
        assert not ((w // 100_000) == 3).any()  # the 7-token record is too short for 12 tokens


def test_reproducible_and_resumable():
    recs = numbered_records([300, 120])
    a = WindowSampler(recs, 9, batch_size=2, seed=3)
    full = take(a, 7)
    b = WindowSampler(recs, 9, batch_size=2, seed=3)
    take(b, 3)
    state = b.state_dict()
    c = WindowSampler(recs, 9, batch_size=2, seed=999)  # the seed comes back from the state
    c.load_state_dict(state)
    assert same(take(c, 4), full[3:])
    assert not same(take(WindowSampler(recs, 9, batch_size=2, seed=4), 7), full)
    with pytest.raises(ValueError, match="seq_len was 9 in the checkpoint and is 10 now"):
        WindowSampler(recs, 10, batch_size=2).load_state_dict(state)


def test_uniform_over_start_positions():
    recs = numbered_records([1000, 250, 40])
    s = WindowSampler(recs, 39, seed=0)
    draws = np.array([s.window(n)[:2] for n in range(6000)])
    starts_per_record = np.array([1000 - 39, 250 - 39, 40 - 39])
    freq = np.bincount(draws[:, 0], minlength=3) / len(draws)
    np.testing.assert_allclose(freq, starts_per_record / starts_per_record.sum(), atol=0.02)
    first = draws[draws[:, 0] == 0, 1]
    assert first.min() >= 0 and first.max() <= 1000 - 40
    assert abs(first.mean() - (1000 - 40) / 2) < 25  # uniform within the record
    assert set(draws[draws[:, 0] == 2, 1].tolist()) == {0}  # a record of exactly 40 tokens has one start


def test_reverse_complement_windows():
    tok = DnaTokenizer()
    recs = dna_records([500])
    text = tok.decode(recs[0].tokens)
    s = WindowSampler(recs, 30, batch_size=4, seed=1, reverse_complement=True)
    strands = set()
    for batch in take(s, 10):
        for ids, labels in zip(batch["input_ids"], batch["labels"]):
            w = tok.decode(torch.cat([ids, labels[-1:]]).numpy())
            rc = w[::-1].translate(str.maketrans("ACGT", "TGCA"))
            if w in text:
                strands.add("+")
            else:
                assert rc in text, "window is neither a slice nor the reverse complement of one"
                strands.add("-")
    assert strands == {"+", "-"}


def test_forward_window_is_a_view():
    recs = dna_records([1000])
    w, docs = WindowSampler(recs, 100).tokens(0)
    assert np.shares_memory(w, recs[0].tokens) and docs is None


def test_data_parallel_ranks_partition_the_single_rank_stream():
    recs = numbered_records([400])
    single = take(WindowSampler(recs, 8, batch_size=4, seed=2), 3)
    ranks = [take(WindowSampler(recs, 8, batch_size=2, seed=2, rank=r, world_size=2), 3) for r in range(2)]
    for step in range(3):
        joined = torch.cat([ranks[0][step]["input_ids"], ranks[1][step]["input_ids"]])
        assert torch.equal(joined, single[step]["input_ids"])


def test_all_records_too_short():
    recs = numbered_records([10, 64, 30])
    with pytest.raises(ValueError) as e:
        WindowSampler(recs, 64)
    for word in ("data.seq_len=64", "at least 65 tokens", "longest is 64 tokens", "'r1'"):
        assert word in str(e.value)


def test_heldout_windows_even_nonoverlapping():
    recs = numbered_records([95, 5, 40])  # windows of 10: 9 + 0 + 4 = 13 slots
    every = heldout_windows(recs, 9, max_windows=0)
    assert [(w.record_id, w.start) for w in every] == [("r0", 10 * i) for i in range(9)] + \
        [("r2", 10 * i) for i in range(4)]
    for w in every:
        assert (np.diff(w.tokens) == 1).all() and len(w.tokens) == 10
    picked = heldout_windows(recs, 9, max_windows=4)
    slots = [(w.record_id, w.start) for w in every]
    assert [slots.index((w.record_id, w.start)) for w in picked] == [0, 4, 8, 12]
    with pytest.raises(ValueError, match="eval.seq_len=95 needs sequences of at least 96"):
        heldout_windows(recs, 95)


def test_eval_batches_reiterable():
    windows = heldout_windows(numbered_records([100]), 9)
    batches = EvalBatches(windows, batch_size=4)
    first, second = list(batches), list(batches)
    assert len(batches) == len(first) == 3 and [b["input_ids"].shape[0] for b in first] == [4, 4, 2]
    assert same(first, second)


def test_make_batch_document_bounds():
    w = np.arange(10, 20)
    docs = np.array([5, 5, 5, 6, 6, 7, 7, 7, 7, 8])
    b = make_batch([w], [docs])
    assert b["doc_ids"].dtype == torch.int32
    assert b["doc_ids"][0].tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2]
    expected = [11, 12, -100, 14, -100, 16, 17, 18, -100]  # label at a document's last token ignored
    assert b["labels"][0].tolist() == expected


def test_random_tokens():
    a = RandomTokens(16, 33, batch_size=2, seed=1)
    full = take(a, 4)
    assert full[0]["input_ids"].shape == (2, 33)
    assert all(int(b["input_ids"].min()) >= 0 and int(b["input_ids"].max()) < 16 for b in full)
    b = RandomTokens(16, 33, batch_size=2, seed=1)
    take(b, 2)
    c = RandomTokens(16, 33, batch_size=2, seed=7)
    c.load_state_dict(b.state_dict())
    assert same(take(c, 2), full[2:])
    with pytest.raises(ValueError, match="vocab_size"):
        RandomTokens(0, 8)


def test_build_data_default_genome():
    data = build_data(DataConfig(seq_len=1000), EvalConfig(seq_len=2000, max_windows=3), batch_size=2,
                      vocab_size=16, heldout_tail=0.2)
    assert data.unit == "base" and set(data.score_ids) == {4, 5, 6, 7}
    (group,) = data.heldout.values()
    assert len(group) == 3 and all(len(w.tokens) == 2001 for w in group)
    assert data.train.next_batch()["input_ids"].shape == (2, 1000)
    assert sum(len(r) for r in data.train_records) == int(48502 * 0.8)


def test_build_data_errors(tmp_path):
    with pytest.raises(ValueError, match="vocabulary has only 8 entries"):
        build_data(DataConfig(), vocab_size=8)
    with pytest.raises(ValueError, match="data.seq_len=65536 needs sequences of at least 65537"):
        build_data(DataConfig(seq_len="64K"))
    with pytest.raises(ValueError, match="eval.seq_len=40000 needs"):
        build_data(DataConfig(seq_len=100), EvalConfig(seq_len=40000), heldout_tail=0.5)
    with pytest.raises(ValueError, match="vocab_size"):
        build_data(DataConfig(kind="random"))
    rand = build_data(DataConfig(kind="random", seq_len=64), vocab_size=151)
    assert rand.heldout == {} and rand.train.next_batch()["input_ids"].max() < 151


def test_build_data_reverse_complement_and_records():
    lam = read_fasta(default_genome_path())[0]
    assert lam.id.startswith("gi|")
    data = build_data(DataConfig(seq_len=500, reverse_complement=True, heldout_tail=0.0))
    assert data.train.complement is not None and data.heldout == {}
    # the default (-1) holds out the last tenth of the built-in genome when nothing else is held out
    default = build_data(DataConfig(seq_len=500))
    (held,) = default.heldout.values()
    assert sum(len(w.tokens) for w in held) > 0
    assert abs(sum(len(r.tokens) for r in default.train_records) - 0.9 * len(lam.tokens)) <= 1

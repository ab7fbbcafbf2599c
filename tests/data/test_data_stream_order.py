"""Streamed data: each data-parallel rank reads its own share of the documents (together the stream, each
document once), through a seeded shuffle buffer, and a resume reads the batches an uninterrupted run would."""

import itertools

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import megaseq.data.chat_build as chat_build  # noqa: E402
import megaseq.data.doc_order as doc_order  # noqa: E402
from chat_helpers import make_chat_tokenizer, write_jsonl  # noqa: E402
from megaseq.config import DataConfig  # noqa: E402
from megaseq.data import build_data  # noqa: E402
from megaseq.data.doc_order import DocOrder, shuffled  # noqa: E402

N = 11  # conversations, each with its own words q<i> / a<i>
CONVS = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}] for i in range(N)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    folder = make_chat_tokenizer(root / "tok", conversations=[(c, None) for c in CONVS])
    return folder, write_jsonl(root / "train.jsonl", [{"messages": c} for c in CONVS])


def build(files, rank=0, world=1, buffer=0, seed=0):
    folder, path = files
    cfg = DataConfig(kind="chat", tokenizer=str(folder), train=[str(path)], seq_len=31, shuffle_buffer=buffer,
                     seed=seed)
    return build_data(cfg, vocab_size=64, rank=rank, world_size=world)


def conversations_in(data, windows) -> list[int]:
    """The numbers of the conversations in ``windows``, in order (each has one word q<i>)."""
    names = data.tokenizer.tok.convert_ids_to_tokens([int(t) for w in windows for t in w[0]])
    return [int(n[1:]) for n in names if n.startswith("q")]


def check_shares(shares: list[list[int]]) -> None:
    flat = [i for share in shares for i in share]
    assert len(flat) == len(set(flat)), "a conversation read by more than one rank"
    assert sorted(flat) == list(range(N)), "a conversation read by no rank"


def shares(files, world, buffer=0, pass_number=0) -> list[list[int]]:
    out = []
    for rank in range(world):
        data = build(files, rank, world, buffer)
        out.append(conversations_in(data, data.train.make_stream(pass_number)))
    return out


@pytest.mark.parametrize("world, buffer", [(1, 0), (3, 0), (3, 4), (4, 2)])
def test_ranks_shares_are_the_stream_each_document_once(files, world, buffer):
    got = shares(files, world, buffer)
    check_shares(got)
    if buffer == 0:
        assert got == [list(range(r, N, world)) for r in range(world)]  # written out: round robin, in file order
    if world == 3 and buffer == 4:
        assert got != shares(files, world)  # shuffled
        check_shares(shares(files, world, buffer, pass_number=1))
        assert shares(files, world, buffer, pass_number=1) != got  # each pass its own order


def test_every_rank_reading_everything_fails(files, monkeypatch):
    """Broken variant: every rank reads the whole stream (as before shares): the check fails."""
    monkeypatch.setattr(DocOrder, "share", lambda self, items: iter(items))
    with pytest.raises(AssertionError, match="more than one rank"):
        check_shares(shares(files, 2))


def test_shuffle_buffer_is_a_seeded_bounded_permutation():
    items = list(range(50))
    assert list(shuffled(items, 0, (0,))) == items and list(shuffled(items, 1, (0,))) == items
    out = list(shuffled(items, 8, (3, 0, 0)))
    assert sorted(out) == items and out != items and out == list(shuffled(items, 8, (3, 0, 0)))
    assert out != list(shuffled(items, 8, (3, 1, 0)))
    # no item is read more than buffer places before its turn (the buffer holds at most 8)
    assert all(pos >= i - 8 for pos, i in enumerate(out))


def take(train, steps: int) -> list:
    return [train.next_batch() for _ in range(steps)]


def check_resume(make, stop: int, steps: int = 14) -> None:
    """Stop after ``stop`` steps, resume from the state a checkpoint keeps: the same batches as one run."""
    whole = take(make(), steps)
    first = make()
    take(first, stop)
    again = make()
    again.load_state_dict(dict(first.state_dict()))
    for a, b in zip(take(again, steps - stop), whole[stop:]):
        assert a["input_ids"].equal(b["input_ids"]) and a["labels"].equal(b["labels"])


@pytest.mark.parametrize("stop", [0, 3, 7])
def test_resume_reads_what_an_uninterrupted_run_reads(files, stop):
    check_resume(lambda: build(files, rank=1, world=2, buffer=3).train, stop)  # 14 steps: several passes


def test_resume_with_an_unseeded_shuffle_fails(files, monkeypatch):
    """Broken variant: the buffer's generator is not a function of (seed, pass, rank): a resume reads other data."""
    calls = itertools.count()
    monkeypatch.setattr(doc_order, "shuffled", lambda items, buffer, seed: shuffled(items, buffer, (next(calls),)))
    with pytest.raises(AssertionError):
        check_resume(lambda: build(files, rank=1, world=2, buffer=3).train, 3)


def test_streamed_shares_equal_the_kept_ones(files, monkeypatch):
    """A set larger than the cache is rendered again on each pass, only the rank's share: the same batches."""
    kept = take(build(files, rank=2, world=3, buffer=2).train, 6)
    monkeypatch.setattr(chat_build, "CACHE_TOKENS", 0)
    streamed = take(build(files, rank=2, world=3, buffer=2).train, 6)
    assert all(a["input_ids"].equal(b["input_ids"]) for a, b in zip(kept, streamed))


def test_columnar_text_rows_are_shared(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from megaseq.data.columnar import text_windows

    class Digits:  # one token per row: the row's number
        eos_id = None

        def encode_batch(self, texts):
            return [np.asarray([int(t)]) for t in texts]

    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": [str(i) for i in range(N)]}), str(path), row_group_size=4)
    got = [[int(t) for w in text_windows([path], Digits(), "text", 1, "data.train", DocOrder(r, 3, 2, 5))
            for t in w[0][:-1]] for r in range(3)]
    flat = [i for share in got for i in share]
    assert len(flat) == len(set(flat)) and set(flat) <= set(range(N))  # windows of 2 share a token: the last
    assert all(i % 3 == r for r, share in enumerate(got) for i in share)


def test_settings_that_cannot_apply_are_refused(files, tmp_path):
    folder, path = files
    with pytest.raises(ValueError, match="fewer than the 12 data-parallel ranks"):
        build(files, rank=0, world=12)
    with pytest.raises(ValueError, match="data.shuffle_buffer orders streamed documents"):
        DataConfig(kind="fasta", shuffle_buffer=4)
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": "q1 a1"}])
    with pytest.raises(ValueError, match="held in memory"):
        build_data(DataConfig(kind="text", tokenizer=str(folder), train=[str(text)], seq_len=3, shuffle_buffer=4),
                   vocab_size=64)
    train = build(files, rank=0, world=2, buffer=3).train
    with pytest.raises(ValueError, match="shuffle_buffer was 3 in the checkpoint and is 0 now"):
        build(files, rank=0, world=2).train.load_state_dict(train.state_dict())

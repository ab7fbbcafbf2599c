"""A streamed run resumed at any step reads the uninterrupted run's windows bitwise (tokens, document ids,
targets), for each format, with and without a shuffle buffer, on 1 and 3 data-parallel ranks, across pass
boundaries and inside conversations cut over several windows; and it starts from the saved position."""

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from stream_sets import FORMATS, TEXTS, assert_same_windows, build_train, resumed, run, write_sets  # noqa: E402

import megaseq.data.doc_order as doc_order  # noqa: E402
import megaseq.data.packing as packing  # noqa: E402
from megaseq.data.packing import merge_positions  # noqa: E402
from megaseq.data.tokenizer import HfTokenizer  # noqa: E402

STEPS = 14
pytestmark = pytest.mark.filterwarnings("ignore:data.train.*longer than data.seq_len")


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    return write_sets(tmp_path_factory.mktemp("sets"))


def check_every_stop(sets, fmt, rank, world, buffer, monkeypatch) -> list[dict]:
    """Resume after every step of a ``STEPS``-step run; returns the saved positions of this rank."""
    whole, states = run(build_train(sets, fmt, rank, world, buffer, monkeypatch=monkeypatch), STEPS)
    fresh = build_train(sets, fmt, rank, world, buffer, monkeypatch=monkeypatch)
    for stop in range(1, STEPS):
        again = resumed(fresh, states[stop - 1])
        assert_same_windows([again.next_windows() for _ in range(stop, STEPS)], whole[stop:])
    return [s["positions"][rank] for s in states]


@pytest.mark.parametrize("world, buffer", [(1, 0), (1, 4), (3, 0), (3, 4)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_resume_at_every_step_reads_the_uninterrupted_windows(sets, fmt, world, buffer, monkeypatch):
    for rank in range(world):
        positions = check_every_stop(sets, fmt, rank, world, buffer, monkeypatch)
        assert all(p is not None for p in positions)  # every checkpoint holds this rank's position
        passes = {p["pass"] for p in positions}
        assert {0, 1} <= passes, "the run never crossed a pass boundary"
        if fmt.startswith("chat"):  # a resume inside a conversation cut over windows
            assert any(p["offset"] > 0 for p in positions)
        if buffer:
            assert any(p["order"] and p["order"]["held"] for p in positions)


def test_the_ranks_positions_join_into_one_checkpoint(sets, monkeypatch):
    """Each rank saves its own position; joined, every rank resumes from the one checkpoint."""
    runs = [run(build_train(sets, "chat.jsonl", r, 3, 4, monkeypatch=monkeypatch), 9) for r in range(3)]
    stop = 5
    joined = {**runs[0][1][stop - 1], "positions": merge_positions([s[stop - 1]["positions"] for _, s in runs])}
    assert all(p is not None for p in joined["positions"])
    for rank, (whole, _) in enumerate(runs):
        again = resumed(build_train(sets, "chat.jsonl", rank, 3, 4, monkeypatch=monkeypatch), joined)
        assert_same_windows([again.next_windows() for _ in range(stop, 9)], whole[stop:])


def test_dropping_the_piece_offset_fails(sets, monkeypatch):
    """Broken variant: a resume inside a cut conversation starts at its first piece again."""
    real = packing.pack_docs
    monkeypatch.setattr(packing, "pack_docs", lambda docs, to_doc, seq_len, pad_id, at: real(
        docs, to_doc, seq_len, pad_id, packing.StreamPosition(at.pass_number, at.order, at.pending)))
    import megaseq.data.chat_build as chat_build

    monkeypatch.setattr(chat_build, "pack_docs", packing.pack_docs)
    with pytest.raises(AssertionError, match="differ"):
        check_every_stop(sets, "chat.jsonl", 0, 1, 0, monkeypatch)


def test_a_buffer_refilled_without_the_generator_state_fails(sets, monkeypatch):
    """Broken variant: the buffer is refilled but its generator starts again from its seed."""
    real = doc_order.Shuffle.restore

    def restore(self, state, fetched, rest):
        rng = self.rng.bit_generator.state
        real(self, state, fetched, rest)
        self.rng.bit_generator.state = rng
        return self

    monkeypatch.setattr(doc_order.Shuffle, "restore", restore)
    with pytest.raises(AssertionError, match="differ"):
        check_every_stop(sets, "text.parquet", 1, 3, 4, monkeypatch)


def test_a_checkpoint_without_positions_resumes_by_replay(sets, monkeypatch):
    """A checkpoint holding only (seed, index) and the settings resumes by replaying the rank's passes."""
    whole, states = run(build_train(sets, "chat.jsonl", 2, 3, 4, monkeypatch=monkeypatch), 10)
    old = {k: v for k, v in states[6].items() if k not in ("positions", "fingerprint")}
    again = resumed(build_train(sets, "chat.jsonl", 2, 3, 4, monkeypatch=monkeypatch), old)
    assert again.state_dict()["positions"] == [None, None, None]  # nothing to save until it has replayed
    assert_same_windows([again.next_windows() for _ in range(7, 10)], whole[7:])
    assert again.state_dict()["positions"][2] == states[9]["positions"][2]


def test_changed_settings_are_still_refused(sets, monkeypatch):
    _, states = run(build_train(sets, "text.parquet", 0, 1, 4, monkeypatch=monkeypatch), 2)
    for key, value in (("shuffle_buffer", 2), ("seq_len", 9), ("global_batch", 8), ("shards", 2)):
        with pytest.raises(ValueError, match=f"cannot resume the data stream: {key} was {value}"):
            resumed(build_train(sets, "text.parquet", 0, 1, 4, monkeypatch=monkeypatch), {**states[1], key: value})


def text_shares(sets, buffer, monkeypatch) -> list[list[str]]:
    """The documents each of 3 ranks tokenizes in its first pass over the text parquet."""
    seen: list[str] = []
    real = HfTokenizer.encode_batch
    monkeypatch.setattr(HfTokenizer, "encode_batch", lambda self, texts: (seen.extend(texts), real(self, texts))[1])
    shares = []
    for rank in range(3):
        train = build_train(sets, "text.parquet", rank, 3, buffer, monkeypatch=monkeypatch)
        seen.clear()
        list(train.make_stream(0))
        shares.append(sorted(seen))
    return shares


@pytest.mark.parametrize("buffer", [0, 4])
def test_each_rank_tokenizes_its_own_share_of_text(sets, buffer, monkeypatch):
    assert text_shares(sets, buffer, monkeypatch) == [sorted(TEXTS[r::3]) for r in range(3)]


def test_every_rank_reading_every_row_fails(sets, monkeypatch):
    """Broken variant: every rank reads the whole stream: the check fails."""
    monkeypatch.setattr(doc_order.DocOrder, "share", lambda self, items: iter(items))
    with pytest.raises(AssertionError):
        test_each_rank_tokenizes_its_own_share_of_text(sets, 4, monkeypatch)

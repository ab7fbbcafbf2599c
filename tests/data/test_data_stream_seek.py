"""A resumed stream does the work of its saved position only: it renders or tokenizes the shuffle buffer and one
step's documents at most (a replay of the passes before does more, and fails the same check), decodes only the
records it needs, skips whole parquet row groups, and refuses files that changed since the checkpoint."""

import shutil

import numpy as np
import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import pyarrow.parquet as pq  # noqa: E402
from stream_sets import TEXT_BATCH, build_train, resumed, run, write_sets  # noqa: E402

import megaseq.data.sources as sources  # noqa: E402
from megaseq.data.chat import ChatRenderer  # noqa: E402
from megaseq.data.tokenizer import HfTokenizer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:data.train.*longer than data.seq_len")
BUFFER = 4


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    return write_sets(tmp_path_factory.mktemp("sets"))


class Counter:
    """Counts the calls (or documents) of a method while ``on``."""

    def __init__(self, monkeypatch, owner, name, size=lambda *a: 1):
        self.n, self.on, real = 0, False, getattr(owner, name)

        def counted(*args, **kw):
            if self.on:
                self.n += size(*args)
            return real(*args, **kw)

        monkeypatch.setattr(owner, name, counted)


def docs_in(windows) -> int:
    """Documents (pieces) in a step's windows, the padding counted as one."""
    return sum(len(np.unique(w[1])) for w in windows)


def resume_work(sets, fmt, counter, monkeypatch, stop=13, drop_positions=False) -> tuple[int, int]:
    """(documents rendered or tokenized to resume after step ``stop`` and read one step, documents in that step)
    on rank 1 of 3 with a shuffle buffer."""
    _, states = run(build_train(sets, fmt, 1, 3, BUFFER, monkeypatch=monkeypatch), stop)
    state = states[-1]
    if drop_positions:  # what a replay does: the checkpoint without its positions
        state = {k: v for k, v in state.items() if k != "positions"}
    fresh = build_train(sets, fmt, 1, 3, BUFFER, monkeypatch=monkeypatch)
    counter.on = True
    windows = resumed(fresh, state).next_windows()
    counter.on = False
    return counter.n, docs_in(windows)


def check_bounded(work: int, step_docs: int, extra: int = 0) -> None:
    bound = BUFFER + step_docs + 1 + extra
    assert work <= bound, f"the resume processed {work} documents, more than the buffer and one step's ({bound})"


@pytest.mark.parametrize("fmt", ["chat.jsonl", "chat.parquet"])
def test_a_resumed_conversation_stream_renders_one_steps_conversations(sets, fmt, monkeypatch):
    renders = Counter(monkeypatch, ChatRenderer, "render")
    work, step_docs = resume_work(sets, fmt, renders, monkeypatch)
    assert work > 0
    check_bounded(work, step_docs)


def test_a_resumed_conversation_stream_parses_only_the_records_it_needs(sets, monkeypatch):
    parsed = Counter(monkeypatch, sources, "_parse_line")
    work, step_docs = resume_work(sets, "chat.jsonl", parsed, monkeypatch)
    check_bounded(work, step_docs, extra=BUFFER)  # the buffer's records are parsed again, not rendered


@pytest.mark.parametrize("fmt", ["text.parquet", "text.datasets"])
def test_a_resumed_text_stream_tokenizes_one_steps_documents(sets, fmt, monkeypatch):
    tokenized = Counter(monkeypatch, HfTokenizer, "encode_batch", size=lambda self, texts: len(texts))
    work, step_docs = resume_work(sets, fmt, tokenized, monkeypatch)
    assert work > 0
    check_bounded(work, step_docs, extra=TEXT_BATCH)  # documents are tokenized TEXT_BATCH at a time


@pytest.mark.parametrize("fmt, method, owner", [("chat.jsonl", "render", ChatRenderer),
                                                ("text.parquet", "encode_batch", HfTokenizer)])
def test_a_replay_fails_the_bound(sets, fmt, method, owner, monkeypatch):
    """Broken variant: resuming by replaying the passes (a checkpoint without positions) renders or tokenizes
    every document before the position: the check fails."""
    counter = Counter(monkeypatch, owner, method, size=(lambda self, texts: len(texts)) if method == "encode_batch"
                      else (lambda *a: 1))
    work, step_docs = resume_work(sets, fmt, counter, monkeypatch, drop_positions=True)
    with pytest.raises(AssertionError, match="more than the buffer"):
        check_bounded(work, step_docs, extra=TEXT_BATCH if fmt.startswith("text") else 0)


def test_a_resume_skips_parquet_row_groups(sets, monkeypatch):
    """In file order (no shuffle buffer), a resume late in a pass decodes only the row groups from its position."""
    groups: list[int] = []
    real = pq.ParquetFile.iter_batches

    def iter_batches(self, *args, row_groups=None, **kw):
        groups.extend(row_groups or range(self.num_row_groups))
        return real(self, *args, row_groups=row_groups, **kw)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", iter_batches)
    _, states = run(build_train(sets, "text.parquet", 0, 1, 0, monkeypatch=monkeypatch), 6)
    fresh = build_train(sets, "text.parquet", 0, 1, 0, monkeypatch=monkeypatch)
    groups.clear()
    resumed(fresh, states[-1]).next_windows()
    total = pq.ParquetFile(str(sets["text.parquet"])).num_row_groups
    assert groups and min(groups) >= total // 2 and len(groups) <= 3, (groups, total)


def test_files_changed_since_the_checkpoint_are_refused(sets, tmp_path, monkeypatch):
    path = shutil.copy(sets["chat.jsonl"], tmp_path / "chat.jsonl")
    mine = {**sets, "chat.jsonl": path}
    _, states = run(build_train(mine, "chat.jsonl", 0, 1, BUFFER, monkeypatch=monkeypatch), 3)
    moved = tmp_path / "moved"
    moved.mkdir()
    same = {**sets, "chat.jsonl": shutil.copy(path, moved / "chat.jsonl")}  # the same files elsewhere: resumes
    resumed(build_train(same, "chat.jsonl", 0, 1, BUFFER, monkeypatch=monkeypatch), states[-1]).next_windows()
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[1:] + lines[:1]))  # the same size, another order
    with pytest.raises(ValueError, match="files of data.train changed since the checkpoint.*the run trained on"):
        resumed(build_train(mine, "chat.jsonl", 0, 1, BUFFER, monkeypatch=monkeypatch), states[-1])

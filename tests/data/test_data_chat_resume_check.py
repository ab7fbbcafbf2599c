"""A resumed conversation stream trusts its first start's read of the same files: it renders no conversation to
build (the buffer and one step's to read the next step), reads the uninterrupted run's windows bitwise (a set the
first start kept in memory is streamed, the same windows), and uses the stored summary for the checks and the
report. A first start reads everything and refuses a bad record by file and line; files whose modification
times changed, and a checkpoint without the summary or the files' fingerprint, are read again; files whose
fingerprint changed are refused before anything is rendered. Broken variants (the read skipped on a first start,
or whatever the fingerprint or the times; the fingerprints compared only after the read) fail these checks."""

import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from stream_sets import N, assert_same_windows, build_train, data_config, resumed, run, write_sets  # noqa: E402

import megaseq.data.chat_build as chat_build  # noqa: E402
from megaseq.data import build_data  # noqa: E402
from megaseq.data.chat import ChatRenderer  # noqa: E402
from megaseq.data.packing import PackStats  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:data.train.*longer than data.seq_len")
BUFFER, STEPS, STOP = 4, 12, 9


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    return write_sets(tmp_path_factory.mktemp("sets"))


@pytest.fixture
def renders(monkeypatch):
    """The number of conversations rendered so far (``ChatRenderer.render`` calls)."""
    count = [0]
    real = ChatRenderer.render

    def counted(self, *args, **kw):
        count[0] += 1
        return real(self, *args, **kw)

    monkeypatch.setattr(ChatRenderer, "render", counted)
    return count


def build(sets, fmt, rank, world, state, monkeypatch, renders):
    """(the data of rank ``rank`` of ``world`` resumed with ``state``, conversations rendered to build it)."""
    before = renders[0]
    batch_size = 4 if world == 1 else 2
    if fmt.startswith("chat.") and monkeypatch is not None:
        monkeypatch.setattr(chat_build, "CACHE_TOKENS", 0)
    data = build_data(data_config(sets, fmt, BUFFER), vocab_size=256, batch_size=batch_size, rank=rank,
                      world_size=world, resume_state=state)
    return data, renders[0] - before


def check_trusted_resume(sets, fmt, rank, world, monkeypatch, renders) -> None:
    """A resume after step ``STOP`` with the same files: nothing rendered to build, the buffer and one step's
    conversations to read the next step, the uninterrupted run's windows."""
    whole, states = run(build_train(sets, fmt, rank, world, BUFFER, monkeypatch=monkeypatch), STEPS)
    assert states[STOP - 1]["scan"]["docs"] == N  # the first start's read is in every state
    data, built = build(sets, fmt, rank, world, states[STOP - 1], monkeypatch, renders)
    assert built == 0, f"the resume rendered {built} conversations to build"
    assert data.log == [chat_build.TRUSTED]
    train = resumed(data.train, states[STOP - 1])
    before = renders[0]
    first = train.next_windows()
    step_docs = sum(len(set(w[1].tolist())) for w in first)
    assert renders[0] - before <= BUFFER + step_docs + 1, "the resume rendered more than the buffer and one step"
    assert_same_windows([first] + [train.next_windows() for _ in range(STOP + 1, STEPS)], whole[STOP:])
    assert train.state_dict()["scan"] == states[-1]["scan"]  # and its checkpoints keep the summary


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("fmt", ["chat.jsonl", "chat.parquet", "chat kept"])
def test_a_resume_on_the_same_files_reads_no_conversation_before_its_first_step(sets, fmt, world, monkeypatch,
                                                                               renders):
    for rank in range(world):
        check_trusted_resume(sets, fmt, rank, world, monkeypatch, renders)


def test_a_resume_that_reads_the_set_again_fails_the_check(sets, monkeypatch, renders):
    """Broken variant: the resume ignores the stored summary: it renders the whole set to build."""
    monkeypatch.setattr(chat_build, "trusted_stats", lambda state, files, key: None)
    with pytest.raises(AssertionError, match="rendered 30 conversations to build"):
        check_trusted_resume(sets, "chat.jsonl", 0, 1, monkeypatch, renders)


def test_the_stored_summary_gives_the_checks_and_the_report(sets, monkeypatch, renders):
    first, built = build(sets, "chat kept", 0, 1, None, monkeypatch, renders)
    assert built == N and first.log == []
    state = first.train.state_dict()
    again, _ = build(sets, "chat kept", 0, 1, state, monkeypatch, renders)
    assert again.notes == [first.notes[0], chat_build.TRUSTED + "."]
    with pytest.raises(ValueError, match="no token of roles"):
        build(sets, "chat kept", 0, 1, {**state, "scan": {**state["scan"], "targets": 0}}, monkeypatch, renders)
    with pytest.warns(UserWarning, match="4 of 30 conversations are longer than data.seq_len"):
        build(sets, "chat kept", 0, 1, state, monkeypatch, renders)


def bad_set(sets, tmp_path: Path) -> dict:
    """The conversations with line 5 broken (a message of an unknown role)."""
    lines = sets["chat.jsonl"].read_text().splitlines(keepends=True)
    lines[4] = lines[4].replace('"user"', '"human"', 1)
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(lines))
    return {**sets, "chat.jsonl": path}


def test_a_first_start_reads_everything_and_refuses_a_bad_record(sets, tmp_path, monkeypatch, renders):
    _, built = build(sets, "chat.jsonl", 0, 1, None, monkeypatch, renders)
    assert built == N
    with pytest.raises(ValueError, match=r"bad.jsonl line 5: message 0 has role 'human'"):
        build(bad_set(sets, tmp_path), "chat.jsonl", 0, 1, None, monkeypatch, renders)


def test_skipping_the_read_on_a_first_start_fails(sets, tmp_path, monkeypatch, renders):
    """Broken variant: a summary is trusted with no checkpoint: the bad record is not refused."""
    monkeypatch.setattr(chat_build, "trusted_stats", lambda state, files, key: PackStats(N, 0, 96, 100, 1000))
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        test_a_first_start_reads_everything_and_refuses_a_bad_record(sets, tmp_path, monkeypatch, renders)


def first_state(sets, tmp_path: Path, monkeypatch) -> tuple[dict, Path]:
    """The state after 3 steps of a run on a copy of the conversations, and the copy."""
    path = Path(shutil.copy(sets["chat.jsonl"], tmp_path / "chat.jsonl"))
    _, states = run(build_train({**sets, "chat.jsonl": path}, "chat.jsonl", 0, 1, BUFFER, monkeypatch=monkeypatch), 3)
    return states[-1], path


def test_files_edited_in_place_are_refused_before_they_are_read(sets, tmp_path, monkeypatch, renders):
    """Line 5 broken in place, the size and the modification time kept: the fingerprint differs, so the resume is
    refused, naming data.train, before a conversation is rendered (and before a model is built)."""
    state, path = first_state(sets, tmp_path, monkeypatch)
    stat = path.stat()
    lines = path.read_text().splitlines(keepends=True)
    lines[4] = lines[4].replace('"user"', '"USER"', 1)  # the same size
    path.write_text("".join(lines))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns
    before = renders[0]
    with pytest.raises(ValueError, match=r"the files of data.train changed since the checkpoint"):
        build({**sets, "chat.jsonl": path}, "chat.jsonl", 0, 1, state, monkeypatch, renders)
    assert renders[0] == before, f"{renders[0] - before} conversations rendered before the refusal"


def test_refusing_other_files_only_after_reading_them_fails(sets, tmp_path, monkeypatch, renders):
    """Broken variant: the builder does not compare the fingerprints (the stream's resume still would, later): the
    edited set is read and rendered before anything refuses it."""
    monkeypatch.setattr(chat_build, "check_same_files", lambda *a, **k: None)
    with pytest.raises((pytest.fail.Exception, AssertionError)):
        test_files_edited_in_place_are_refused_before_they_are_read(sets, tmp_path, monkeypatch, renders)


def test_a_summary_without_the_files_fingerprint_is_not_trusted(sets, tmp_path, monkeypatch, renders):
    """A state holding the summary but not the files' fingerprint (nothing to compare): the set is read again."""
    state, path = first_state(sets, tmp_path, monkeypatch)
    state = {k: v for k, v in state.items() if k != "fingerprint"}
    data, built = build({**sets, "chat.jsonl": path}, "chat.jsonl", 0, 1, state, monkeypatch, renders)
    assert built == N and data.log == [], "a summary without the files' fingerprint was trusted"


def test_trusting_a_summary_whatever_the_fingerprint_fails(sets, tmp_path, monkeypatch, renders):
    """Broken variant: the summary is trusted whatever the fingerprint: a state without one is trusted."""
    real = chat_build.trusted_stats
    monkeypatch.setattr(chat_build, "trusted_stats",
                        lambda state, files, key: real(state and {**state, "fingerprint": files}, files, key))
    with pytest.raises(AssertionError, match="without the files' fingerprint was trusted"):
        test_a_summary_without_the_files_fingerprint_is_not_trusted(sets, tmp_path, monkeypatch, renders)


def test_files_copied_or_touched_are_read_again_and_moved_ones_are_not(sets, tmp_path, monkeypatch, renders):
    state, path = first_state(sets, tmp_path, monkeypatch)
    (tmp_path / "moved").mkdir()
    moved = Path(shutil.copy2(path, tmp_path / "moved" / "chat.jsonl"))  # the same times
    data, built = build({**sets, "chat.jsonl": moved}, "chat.jsonl", 0, 1, state, monkeypatch, renders)
    assert built == 0 and data.log == [chat_build.TRUSTED]
    stat = moved.stat()
    os.utime(moved, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touched: the same bytes, a new time
    data, built = build({**sets, "chat.jsonl": moved}, "chat.jsonl", 0, 1, state, monkeypatch, renders)
    assert built == N and data.log == [], "a touched file was not read again"
    resumed(data.train, state).next_windows()  # and the run resumes (the fingerprint is the same)
    data, built = build({**sets, "chat.jsonl": moved}, "chat.jsonl", 0, 1, data.train.state_dict(), monkeypatch,
                        renders)
    assert built == 0, "the summary of the read again was not kept"


def test_a_key_without_the_times_fails(sets, tmp_path, monkeypatch, renders):
    """Broken variant: the summary's key leaves out the modification times: a touched file is not read again."""
    real = chat_build.scan_key
    monkeypatch.setattr(chat_build, "scan_key", lambda paths, *a: real([], *a))
    with pytest.raises(AssertionError, match="touched file was not read again"):
        test_files_copied_or_touched_are_read_again_and_moved_ones_are_not(sets, tmp_path, monkeypatch, renders)


@pytest.mark.parametrize("fmt", ["chat.jsonl", "chat kept"])
def test_a_checkpoint_without_the_summary_resumes_with_the_full_read(sets, fmt, monkeypatch, renders):
    whole, states = run(build_train(sets, fmt, 1, 3, BUFFER, monkeypatch=monkeypatch), STEPS)
    older = {k: v for k, v in states[STOP - 1].items() if k != "scan"}
    data, built = build(sets, fmt, 1, 3, older, monkeypatch, renders)
    assert built == N and data.log == []
    train = resumed(data.train, older)
    assert_same_windows([train.next_windows() for _ in range(STOP, STEPS)], whole[STOP:])
    assert train.state_dict()["scan"] == states[-1]["scan"]


def test_another_template_or_length_reads_again(sets, monkeypatch, renders):
    """The summary holds for what renders and packs the set: another data.loss_roles or data.seq_len reads again."""
    first, _ = build(sets, "chat.jsonl", 0, 1, None, monkeypatch, renders)
    key = first.train.state_dict()["scan"]["key"]
    renderer = first.tokenizer
    paths = [sets["chat.jsonl"]]
    assert chat_build.scan_key(paths, renderer, "messages", 31) == key
    assert chat_build.scan_key(paths, renderer, "messages", 63) != key
    renderer.loss_roles = ("assistant", "tool")
    assert chat_build.scan_key(paths, renderer, "messages", 31) != key


def test_another_vocabulary_reads_again(sets, monkeypatch, renders):
    """A data.tokenizer whose vocabulary changed (here one added token; the renderer's id count stays) reads again."""
    first, _ = build(sets, "chat.jsonl", 0, 1, None, monkeypatch, renders)
    key = first.train.state_dict()["scan"]["key"]
    renderer, paths = first.tokenizer, [sets["chat.jsonl"]]
    assert chat_build.scan_key(paths, renderer, "messages", 31) == key
    renderer.tok.add_tokens(["<a token added after the first start>"])
    assert chat_build.scan_key(paths, renderer, "messages", 31) != key

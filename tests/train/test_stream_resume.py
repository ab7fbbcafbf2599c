"""A conversation run (data.kind chat, streamed from its JSONL through a shuffle buffer) stopped after a
checkpoint and resumed continues on the uninterrupted run's loss curve bitwise, starting from the position the
checkpoint holds; resumed at another position (a broken variant) the curve differs. With the same files it
renders no conversation before its first step but the buffer and that step's (the first start's read of the set is
trusted; a set the first start kept in memory is streamed, on the same curve); a checkpoint without the first
start's summary resumes with the whole set read, on the same curve."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import megaseq.data as data_pkg  # noqa: E402
import megaseq.data.chat_build as chat_build  # noqa: E402
import megaseq.train.step as step_mod  # noqa: E402
from conftest import agent_trace_checkpoint, run_as_of_step  # noqa: E402
from megaseq.config import load_config  # noqa: E402
from megaseq.data.chat import ChatRenderer  # noqa: E402
from megaseq.data.packing import StreamPosition, StreamWindows  # noqa: E402
from megaseq.parallel.env import ParallelEnv  # noqa: E402
from megaseq.parallel.launch import spawn_local  # noqa: E402
from megaseq.train import checkpoint as ckpt  # noqa: E402
from megaseq.train.trainer import run_training  # noqa: E402

torch.set_num_threads(2)
STEPS, STOP = 4, 2
pytestmark = pytest.mark.filterwarnings("ignore:data.train.*longer than data.seq_len")


def _config(folder: Path, run: str, resume: bool = False, extra: tuple[str, ...] = ()):
    return load_config(folder / "recipe.yaml", [*extra,
        f"train.run_dir={folder / run}", f"train.steps={STEPS}", "train.save_every=1", "train.keep_checkpoints=10",
        f"train.resume={str(resume).lower()}", "train.eval_every=0", "train.eval_after=false",
        "train.export_hf=false", "data.seq_len=128", "data.shuffle_buffer=3", "data.heldout=[]",
        "log.progress=false", "log.tensorboard=false"])


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted run, its conversations read from the file on each pass."""
    folder = tmp_path_factory.mktemp("chat_run")
    agent_trace_checkpoint(folder)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(chat_build, "CACHE_TOKENS", 0)
        run_training(_config(folder, "whole"))
    return folder


def _resume(folder: Path, run: str, monkeypatch) -> list[float]:
    run_as_of_step(folder / "whole", folder / run, STOP)
    monkeypatch.setattr(chat_build, "CACHE_TOKENS", 0)
    result = run_training(_config(folder, run, resume=True))
    assert len(result.losses) == STEPS - STOP
    return _losses(folder / run)


def test_a_resumed_conversation_run_continues_the_loss_curve(whole, monkeypatch):
    meta = ckpt.read_meta(whole / "whole" / ckpt.CKPT_DIR / f"step_{STOP:06d}")
    position = meta["data"]["positions"][0]
    assert position is not None and position["order"]["held"], "the checkpoint holds no stream position"
    replayed: list[int] = []  # windows asked for with no position to read them from: a replay
    monkeypatch.setattr(StreamWindows, "_window", _watch(StreamWindows._window, replayed))
    got = _resume(whole, "resumed", monkeypatch)
    np.testing.assert_array_equal(got, _losses(whole / "whole"))
    assert replayed == [], "the resume replayed the stream from its start"


def _watch(real, replayed: list[int]):
    """``StreamWindows._window`` noting each window it replays the stream from its start for."""

    def window(self, n):
        if self._it is None and self._after is None:
            replayed.append(n)
        return real(self, n)

    return window


def test_a_resume_at_another_position_changes_the_curve(whole, monkeypatch):
    """Broken variant: the resume starts the next pass instead of the saved position: the check fails."""
    real = StreamWindows.load_state_dict

    def load(self, state):
        real(self, state)
        self._after = StreamPosition(self._after.pass_number + 1)

    monkeypatch.setattr(StreamWindows, "load_state_dict", load)
    got = _resume(whole, "elsewhere", monkeypatch)
    with pytest.raises(AssertionError):
        np.testing.assert_array_equal(got, _losses(whole / "whole"))


def _train_rank(rank: int, folder: Path, run: str, resume: bool) -> None:
    torch.set_num_threads(1)
    chat_build.CACHE_TOKENS = 0  # a forked rank: read the file on each pass
    run_training(_config(folder, run, resume, ["parallel.dp=2", "parallel.backend=gloo", "train.device=cpu"]))


def test_two_ranks_save_both_positions_and_resume_from_them(whole):
    """Each data-parallel rank reads its own share: the checkpoint (written by rank 0) holds both ranks'
    positions, gathered, and a two-rank resume continues the two-rank curve bitwise."""
    spawn_local(_train_rank, 2, args=(whole, "two", False))
    meta = ckpt.read_meta(whole / "two" / ckpt.CKPT_DIR / f"step_{STOP:06d}")
    first, second = meta["data"]["positions"]
    assert first is not None and second is not None and first != second
    run_as_of_step(whole / "two", whole / "two_resumed", STOP)
    spawn_local(_train_rank, 2, args=(whole, "two_resumed", True))
    np.testing.assert_array_equal(_losses(whole / "two_resumed"), _losses(whole / "two"))


N_TRACES, BUFFER = 64, 3  # the recipe's training traces; data.shuffle_buffer above


class Watch:
    """Conversations rendered before the first optimizer step, the documents of that step's windows, and the
    run's log lines."""

    def __init__(self, monkeypatch) -> None:
        self.rendered, self.step_docs = 0, 0
        self.before_first: int | None = None
        self.lines: list[str] = []
        render, step, windows, log = (ChatRenderer.render, step_mod.train_step, StreamWindows.next_windows,
                                      ParallelEnv.log)

        def counted_render(renderer, *args, **kw):
            self.rendered += 1
            return render(renderer, *args, **kw)

        def first_step(state, batches, **kw):
            if self.before_first is None:
                self.before_first = self.rendered
            return step(state, batches, **kw)

        def seen_windows(train):
            got = windows(train)
            if self.before_first is None:
                self.step_docs += sum(len(set(w[1].tolist())) for w in got)
            return got

        def logged(env, msg):
            self.lines.append(msg)
            return log(env, msg)

        monkeypatch.setattr(ChatRenderer, "render", counted_render)
        monkeypatch.setattr(step_mod, "train_step", first_step)
        monkeypatch.setattr(StreamWindows, "next_windows", seen_windows)
        monkeypatch.setattr(ParallelEnv, "log", logged)

    def check_trusted(self) -> None:
        bound = BUFFER + self.step_docs + 1
        assert self.before_first is not None and self.before_first <= bound, (
            f"the resume rendered {self.before_first} conversations before its first step, more than the buffer "
            f"and one step's ({bound})")
        assert chat_build.TRUSTED in self.lines


def _resume_watched(folder: Path, src: str, run: str, monkeypatch, kept: bool = False) -> tuple[list[float], Watch]:
    run_as_of_step(folder / src, folder / run, STOP)
    if not kept:
        monkeypatch.setattr(chat_build, "CACHE_TOKENS", 0)
    watch = Watch(monkeypatch)
    run_training(_config(folder, run, resume=True))
    return _losses(folder / run), watch


def test_a_resume_on_the_same_files_renders_only_what_its_first_step_reads(whole, monkeypatch):
    got, watch = _resume_watched(whole, "whole", "trusted", monkeypatch)
    np.testing.assert_array_equal(got, _losses(whole / "whole"))
    watch.check_trusted()
    meta = ckpt.read_meta(whole / "trusted" / ckpt.CKPT_DIR / f"step_{STEPS:06d}")
    first = ckpt.read_meta(whole / "whole" / ckpt.CKPT_DIR / f"step_{STOP:06d}")
    assert meta["data"]["scan"] == first["data"]["scan"] and first["data"]["scan"]["docs"] == N_TRACES


def test_a_resume_given_no_checkpoint_data_fails_the_check(whole, monkeypatch):
    """Broken variant: the trainer builds the data of a resume as a first start's: it renders the whole set."""
    real = data_pkg.build_data
    monkeypatch.setattr(data_pkg, "build_data", lambda *a, resume_state=None, **kw: real(*a, **kw))
    got, watch = _resume_watched(whole, "whole", "untrusted", monkeypatch)
    np.testing.assert_array_equal(got, _losses(whole / "whole"))
    assert watch.before_first >= N_TRACES
    with pytest.raises(AssertionError, match="more than the buffer and one step's"):
        watch.check_trusted()


def test_a_kept_set_resumed_streams_on_the_same_curve(whole, monkeypatch):
    """The first start keeps the (small) set rendered in memory; the resume trusts its read and streams."""
    run_training(_config(whole, "kept"))  # chat_build.CACHE_TOKENS as it is
    np.testing.assert_array_equal(_losses(whole / "kept"), _losses(whole / "whole"))
    got, watch = _resume_watched(whole, "kept", "kept_resumed", monkeypatch, kept=True)
    np.testing.assert_array_equal(got, _losses(whole / "kept"))
    watch.check_trusted()


def test_a_checkpoint_without_the_summary_resumes_with_the_whole_read(whole, monkeypatch):
    run_as_of_step(whole / "whole", whole / "older_src", STOP)
    meta_path = whole / "older_src" / ckpt.CKPT_DIR / f"step_{STOP:06d}" / ckpt.META
    meta = json.loads(meta_path.read_text())
    del meta["data"]["scan"]
    meta_path.write_text(json.dumps(meta))
    got, watch = _resume_watched(whole, "older_src", "older", monkeypatch)
    np.testing.assert_array_equal(got, _losses(whole / "whole"))
    assert watch.before_first >= N_TRACES and chat_build.TRUSTED not in watch.lines
    assert "scan" in ckpt.read_meta(whole / "older" / ckpt.CKPT_DIR / f"step_{STEPS:06d}")["data"]

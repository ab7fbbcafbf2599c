"""A conversation run (data.kind chat, streamed from its JSONL through a shuffle buffer) stopped after a
checkpoint and resumed continues on the uninterrupted run's loss curve bitwise, starting from the position the
checkpoint holds; resumed at another position (a broken variant) the curve differs."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import megaseq.data.chat_build as chat_build  # noqa: E402
from conftest import agent_trace_checkpoint, run_as_of_step  # noqa: E402
from megaseq.config import load_config  # noqa: E402
from megaseq.data.packing import StreamPosition, StreamWindows  # noqa: E402
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

"""The context ablation and the copy oracle: a copy model that reads far back, a real model, broken variants."""

import math

import numpy as np
import pytest
import torch

import megaseq.eval.ablation as ablation
from megaseq.data.tokenizer import A_ID
from megaseq.data.windows import make_batch
from megaseq.eval.ablation import ablation_block, score_ablation
from megaseq.eval.copy_oracle import copy_oracle, far_copy
from megaseq.eval.spread import beyond_noise

PERIOD, S, WIDTH = 48, 192, 32  # windows of 4 repeats of a random 48-mer; buckets of 32


def repeat_windows(num: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num):
        block = rng.integers(A_ID, A_ID + 4, size=PERIOD)
        out.append(make_batch([np.tile(block, S // PERIOD + 1)[:S + 1]]))
    return out


def copy_model(period: int = PERIOD):
    """Per-token loss of a model that copies the token ``period`` back: label t (token t + 1) is predicted from
    input t + 1 - period when the batch holds it (probability 0.97), else uniformly over A/C/G/T."""
    def fn(batch):
        ids, labels = batch["input_ids"], batch["labels"]
        T = ids.shape[1]
        loss = torch.full(labels.shape, math.log(4), dtype=torch.float64)
        if T >= period:
            src = ids[:, : T - period + 1]  # inputs feeding labels period-1 .. T-1
            hit = src == labels[:, period - 1:]
            loss[:, period - 1:] = torch.where(hit, -math.log(0.97), -math.log(0.01))
        return loss
    return fn


def test_cut_context_loses_the_far_copy():
    full, cut, chosen = score_ablation(copy_model(), repeat_windows(6), WIDTH, cut_to=16, chunk=8)
    block = ablation_block(full, cut, chosen, 16, 8, "copy")
    assert block["buckets"] == [0, 1, 2, 3, 4, 5]  # every bucket holds a position with more than 16 before it
    late = [j for j, b in enumerate(chosen) if b * WIDTH >= PERIOD]
    for j in late:  # past the first repeat the full arm copies, the cut arm (16 + 7 < 48 back) cannot
        assert block["bits_per_base_full"][j] < 0.1 and abs(block["bits_per_base_cut"][j] - 2.0) < 1e-9
        assert beyond_noise(block["context_gain"][j], block["context_gain_se"][j]) or \
            block["context_gain_se"][j] == 0.0
    assert "uses context from further back" in block["words"]
    # exactly the same tokens in both arms
    assert block["bucket_tokens"] == [int(v) for v in cut.arrays()[1].sum(axis=0)]


def test_cut_at_least_the_window_changes_nothing():
    full, cut, chosen = score_ablation(copy_model(), repeat_windows(3), WIDTH, cut_to=S, chunk=7,
                                       buckets=range(6))
    np.testing.assert_array_equal(full.arrays()[0], cut.arrays()[0])


def test_cut_long_enough_to_reach_the_copy_keeps_it():
    full, cut, _ = score_ablation(copy_model(), repeat_windows(3), WIDTH, cut_to=PERIOD, chunk=5)
    np.testing.assert_allclose(full.arrays()[0], cut.arrays()[0])


@pytest.mark.parametrize("broken", ["leak", "short"])
def test_broken_cut_scoring_is_caught(monkeypatch, broken):
    """A cut arm that leaks the whole context (start 0), or one that cuts one token too many, fails the checks."""
    if broken == "leak":
        monkeypatch.setattr(ablation, "context_start", lambda c, cut_to: 0)
        with pytest.raises(AssertionError):
            test_cut_context_loses_the_far_copy()
    else:
        monkeypatch.setattr(ablation, "context_start", lambda c, cut_to: max(0, c + 2 - cut_to))
        with pytest.raises(AssertionError):
            test_cut_long_enough_to_reach_the_copy_keeps_it()


def test_cut_to_past_the_window_is_refused():
    with pytest.raises(ValueError, match="ablation_cut_to"):
        score_ablation(copy_model(), repeat_windows(1), WIDTH, cut_to=S, chunk=8)


def test_real_model_cut_against_full_context():
    """A tiny Qwen3-MoE in float64: cut_to past the window gives the full arm's loss; a short cut changes it."""
    from megaseq.eval.loss import per_token_loss_fn
    from megaseq.models.build import build_model
    from megaseq.models.presets import resolve_spec
    from megaseq.train.parallel_env import ParallelEnv

    model = build_model(resolve_spec("qwen3-moe-tiny"), dtype=torch.float64, seed=0).eval()
    fn = per_token_loss_fn(model, ParallelEnv(torch.device("cpu")), None, 64)
    windows = repeat_windows(2, seed=3)
    full, cut, _ = score_ablation(fn, windows, WIDTH, cut_to=S, chunk=24, buckets=range(6))
    np.testing.assert_allclose(full.arrays()[0], cut.arrays()[0], rtol=1e-10)
    full, cut, chosen = score_ablation(fn, windows, WIDTH, cut_to=8, chunk=8)
    assert not np.allclose(full.arrays()[0][:, chosen[1:]], cut.arrays()[0][:, chosen[1:]])


def test_far_copy_against_brute_force():
    rng = np.random.default_rng(1)
    tokens = rng.integers(A_ID, A_ID + 4, size=300)
    tokens[150:220] = tokens[10:80]
    tokens[100] = 0  # a non-base breaks the k-mers through it
    k, dist = 6, 40
    got = far_copy(tokens, k, dist)
    for p in range(len(tokens)):
        want = -1
        if p >= k - 1 and all(A_ID <= t < A_ID + 4 for t in tokens[p - k + 1:p + 1]):
            for q in range(p - dist - 1, k - 2, -1):
                if q + 1 < len(tokens) and np.array_equal(tokens[q - k + 1:q + 1], tokens[p - k + 1:p + 1]) and \
                        all(A_ID <= t < A_ID + 4 for t in tokens[q - k + 1:q + 1]):
                    want = int(tokens[q + 1])
                    break
        assert got[p] == want, p


def test_copy_oracle_by_bucket():
    o = copy_oracle(repeat_windows(2), WIDTH, k=8, min_distance=PERIOD - 2)
    assert o["share_with_copy"][0] == 0.0 and o["share_with_copy"][-1] == 1.0
    assert o["accuracy"] == 1.0 and o["bits_per_base"][0] == 2.0 and o["bits_per_base"][-1] < 0.01
    none = copy_oracle(repeat_windows(2), WIDTH, k=8, min_distance=S)
    assert none["overall_share_with_copy"] == 0.0 and none["overall_bits_per_base"] == 2.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_ablation_on_gpu_with_the_protocol_model():
    """The protocol's GLM-5 DNA model on the GPU in bf16 (fla's KDA, the sparse MLA kernels, the indexer): a cut
    past the window scores as the full context does; a cut to 1K does not, on a 4K window with a 2K repeat."""
    from pathlib import Path

    from megaseq.eval.loss import per_token_loss_fn
    from megaseq.models.build import build_model
    from megaseq.models.presets import resolve_spec
    from megaseq.train.parallel_env import ParallelEnv

    spec = resolve_spec(str(Path(__file__).resolve().parents[2] / "recipes" / "long-context" / "glm5-dna.json"))
    model = build_model(spec, dtype=torch.float32, device="cuda", seed=0).eval()
    fn = per_token_loss_fn(model, ParallelEnv(torch.device("cuda")), torch.bfloat16, 4096)
    rng = np.random.default_rng(0)
    block = rng.integers(A_ID, A_ID + 4, size=2048)
    windows = [make_batch([np.concatenate([block, block, block[:1]])])]
    full, cut, _ = score_ablation(fn, windows, 1024, cut_to=8192, chunk=512, buckets=range(4))
    np.testing.assert_allclose(full.arrays()[0], cut.arrays()[0], rtol=2e-2)
    full, cut, chosen = score_ablation(fn, windows, 1024, cut_to=1024, chunk=512)
    assert not np.allclose(full.arrays()[0][:, chosen[1:]], cut.arrays()[0][:, chosen[1:]], rtol=1e-3)

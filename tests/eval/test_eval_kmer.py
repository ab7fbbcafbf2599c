"""The k-mer Markov baseline against a plain-Python reference, and its behaviour on known sequences."""

import math
from collections import Counter

import numpy as np
import pytest
import torch

import megaseq.eval.kmer as kmer_mod
from megaseq.data.fasta import default_genome_path, read_fasta
from megaseq.data.tokenizer import DnaTokenizer, reverse_complement
from megaseq.data.windows import make_batch
from megaseq.eval.kmer import KmerModel, _fit_lambdas

TOK = DnaTokenizer()
LN2 = math.log(2)


def rand_dna(n, seed, alphabet="ACGT"):
    return "".join(np.random.default_rng(seed).choice(list(alphabet), size=n))


def ref_counts(seqs, k):
    """counts[j][(context, base)] over every target whose j previous bases and itself are A/C/G/T."""
    counts = [Counter() for _ in range(k + 1)]
    for s in seqs:
        for t, x in enumerate(s):
            for j in range(k + 1):
                if t - j >= 0 and all(c in "ACGT" for c in s[t - j:t + 1]):
                    counts[j][(s[t - j:t], x)] += 1
    return counts


def ref_loss(counts, k, seq, smoothing, lambdas=None, alpha=1.0):
    """Loss (nats) of seq[1:], each from the clean context before it inside seq; NaN for non-ACGT."""
    out = []
    for t in range(1, len(seq)):
        if seq[t] not in "ACGT":
            out.append(float("nan"))
            continue
        m = 0
        while m < min(k, t) and seq[t - m - 1] in "ACGT":
            m += 1
        p = 0.25
        for j in range(m + 1):
            ctx = seq[t - j:t]
            n_cx = counts[j][(ctx, seq[t])]
            n_c = sum(counts[j][(ctx, b)] for b in "ACGT")
            if smoothing == "add_alpha":
                p = (n_cx + alpha) / (n_c + 4 * alpha)
            elif n_c > 0:
                lam = lambdas[j][int(math.floor(math.log2(n_c)))]
                p = lam * n_cx / n_c + (1 - lam) * p
        out.append(-math.log(p))
    return np.array(out)


@pytest.fixture(scope="module")
def small_data():
    train = [rand_dna(700, 0, "ACGTTA") + "N" + rand_dna(300, 1), "AC" * 40 + "NNACGT" + rand_dna(200, 2)]
    test = rand_dna(50, 3, "ACGTA") + "NA" + "ACACACAC" + rand_dna(80, 4) + "R"
    return train, test.replace("R", "N")


@pytest.mark.parametrize("smoothing", ["interpolated", "add_alpha"])
def test_matches_reference(small_data, smoothing):
    train, test = small_data
    k = 5
    m = KmerModel(k, smoothing=smoothing, alpha=0.7).fit([TOK.encode(s) for s in train])
    want = ref_loss(ref_counts(train, k), k, test, smoothing, m.lambdas, alpha=0.7)
    got = m.token_loss(TOK.encode(test))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got[~np.isnan(got)], want[~np.isnan(want)], rtol=1e-12, atol=0)
    assert m.num_bases == sum(sum(c in "ACGT" for c in s) for s in train)


def test_sparse_orders_and_chunks_match_dense(small_data, monkeypatch):
    train, test = small_data
    ids = [TOK.encode(s) for s in train]
    dense = KmerModel(6).fit(ids)
    sparse = KmerModel(6, dense_max_order=2).fit(ids)
    monkeypatch.setattr(kmer_mod, "_CHUNK", 37)  # chunk boundaries inside records and inside the test
    chunked = KmerModel(6, dense_max_order=3).fit(ids)
    want = dense.token_loss(TOK.encode(test))
    for other in (sparse, chunked):
        np.testing.assert_allclose(other.token_loss(TOK.encode(test)), want, rtol=1e-12, equal_nan=True)
        np.testing.assert_array_equal(other.lambdas, dense.lambdas)


def test_both_strands_counts(small_data):
    train, _ = small_data
    ids = [TOK.encode(s) for s in train]
    both = KmerModel(4).fit(ids, reverse_complement_too=True)
    explicit = KmerModel(4).fit(ids + [reverse_complement(i) for i in ids])
    for a, b in zip(both.counts, explicit.counts):
        np.testing.assert_array_equal(a.table, b.table)
    assert both.num_bases == explicit.num_bases


@pytest.mark.parametrize("smoothing", ["interpolated", "add_alpha"])
def test_periodic_sequence_reaches_zero_bits(smoothing):
    motif = rand_dna(7, 5)
    m = KmerModel(8, smoothing=smoothing, alpha=0.5).fit([TOK.encode(motif * 3000)])
    held = TOK.encode((motif * 200)[3:])  # another phase
    assert m.bits_per_base([held]) < 0.02


@pytest.mark.parametrize("smoothing, k", [("interpolated", 10), ("add_alpha", 3)])
def test_uniform_random_is_two_bits(smoothing, k):
    m = KmerModel(k, smoothing=smoothing).fit([TOK.encode(rand_dna(200_000, 6))])
    assert abs(m.bits_per_base([TOK.encode(rand_dna(30_000, 7))]) - 2.0) < 0.01


def test_fit_lambdas_against_grid():
    rng = np.random.default_rng(0)
    n = 5000
    bucket = rng.integers(0, 4, size=n)
    lower = rng.uniform(0.1, 0.6, size=n)
    ml = np.where(rng.random(n) < np.array([0.9, 0.5, 0.2, 0.0])[bucket], 1.0, rng.uniform(0, 0.3, n))
    lam = _fit_lambdas(ml, lower, bucket, iters=30)
    grid = np.linspace(0, kmer_mod._LAM_MAX, 2001)
    for b in range(4):
        sel = bucket == b
        obj = [np.log(g * ml[sel] + (1 - g) * lower[sel]).sum() for g in grid]
        assert abs(lam[b] - grid[int(np.argmax(obj))]) < 2e-3
    assert np.all(lam[4:] == lam[3])  # empty buckets take the nearest fitted one


def test_batch_loss_masks_and_checks():
    m = KmerModel(3).fit([TOK.encode(rand_dna(2000, 8))])
    w1, w2 = TOK.encode(rand_dna(20, 9)), TOK.encode(rand_dna(9, 10) + "N" + rand_dna(10, 11))
    batch = make_batch([w1, w2])
    batch["labels"][0, 4] = -100
    out = m.batch_loss(batch)
    assert out.shape == (2, 19) and out.dtype == torch.float64
    want0 = m.token_loss(w1)
    want0[4] = np.nan
    np.testing.assert_array_equal(out[0].numpy(), want0)
    assert np.isnan(out[1, 8].item()) and np.isfinite(out[1, 9].item())  # target N unscored; the next base is
    bad = make_batch([w1])
    bad["labels"][0, 2] = 5 if int(bad["labels"][0, 2]) != 5 else 6
    with pytest.raises(ValueError, match="next-token labels"):
        m.batch_loss(bad)


def test_arguments():
    with pytest.raises(ValueError, match="eval.kmer_k"):
        KmerModel(31)
    with pytest.raises(ValueError, match="smoothing"):
        KmerModel(3, smoothing="kn")
    assert KmerModel(8).name == "kmer-k8"


def test_lambda_phage_beats_uniform():
    """Real DNA: the first 80% of the phage genome predicts the rest better than 2 bits per base."""
    seq = read_fasta(default_genome_path())[0].tokens
    cut = int(len(seq) * 0.8)
    bits = KmerModel(6).fit([seq[:cut]], reverse_complement_too=True).bits_per_base([seq[cut:]])
    assert 1.8 < bits < 1.99

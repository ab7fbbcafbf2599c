"""Windows of related strains: anchors place a region's homolog exactly (both strands), windows are a pure
function of (seed, n), held-out genomes are scored only after their training relatives."""

from pathlib import Path

import numpy as np
import pytest

import megaseq.data.related as related
from megaseq.config import DataConfig, EvalConfig
from megaseq.data import build_data
from megaseq.data.fasta import FastaRecord
from megaseq.data.tokenizer import SEP_ID, complement_lut

ACGT = np.frombuffer(b"ACGT", np.uint8)
CUT = 15_000  # where strain B carries an insertion


def _ids(rng, n):
    return rng.integers(4, 8, size=n).astype(np.uint8)


def _strains(seed=0, n=30_000):
    """Strain a; b = a with 1% substitutions and a 50-base insertion at CUT, stored reverse-complemented;
    c = a with 2% substitutions."""
    rng = np.random.default_rng(seed)
    a = _ids(rng, n)

    def mutate(x, rate):
        x = x.copy()
        hit = rng.random(len(x)) < rate
        x[hit] = 4 + (x[hit] - 4 + rng.integers(1, 4, size=int(hit.sum()))) % 4
        return x

    b = np.concatenate([mutate(a[:CUT], 0.01), _ids(rng, 50), mutate(a[CUT:], 0.01)])
    b = complement_lut()[b[::-1]]
    return a, b, mutate(a, 0.02)


def _write(path: Path, ids: np.ndarray) -> str:
    path.write_text(">chr\n" + (ACGT[ids.astype(np.int64) - 4]).tobytes().decode() + "\n")
    return str(path)


def test_kmer_index_finds_unique_kmers_only():
    rng = np.random.default_rng(1)
    x = _ids(rng, 5000)
    x[3000:3016] = x[100:116]  # a repeated 16-mer
    idx = related.KmerIndex(x)
    codes, ok = related._codes(x)
    assert ok.all()
    assert idx.find(codes[[7, 2500]]).tolist() == [7, 2500]
    assert idx.find(codes[[100, 3000]]).tolist() == [-1, -1]


def test_place_finds_the_homolog_on_either_strand():
    a, b, c = _strains()
    L = 2000
    for p in (0, 4000, CUT - L - 100):  # before the insertion: b's coordinates are known exactly
        start, reverse = related.place(a[p:p + L], related.KmerIndex(b))
        assert reverse and start == len(b) - p - L
        np.testing.assert_array_equal(start, len(b) - p - L)
        start, reverse = related.place(a[p:p + L], related.KmerIndex(c))
        assert (start, reverse) == (p, False)
    assert related.place(_ids(np.random.default_rng(9), L), related.KmerIndex(b)) is None  # unrelated


def test_broken_reverse_strand_is_caught(monkeypatch):
    """The check above must fail for a placement that ignores the reverse strand."""
    a, b, _ = _strains()
    monkeypatch.setattr(related, "complement_lut", lambda: np.arange(256, dtype=np.uint8))
    with pytest.raises((AssertionError, TypeError)):
        start, reverse = related.place(a[4000:6000], related.KmerIndex(b))
        assert reverse and start == len(b) - 6000


def _records(tmp_path):
    a, b, c = _strains()
    paths = [_write(tmp_path / f"sp_{n}.fa", x) for n, x in (("A", a), ("B", b), ("C", c))]
    return a, b, c, [FastaRecord("chr", x, p) for x, p in zip((a, b, c), paths)]


def test_windows_hold_homologous_regions_in_one_orientation(tmp_path):
    a, b, c, recs = _records(tmp_path)
    s = related.RelatedWindowSampler(recs, 3 * 1000 + 2, 3, seed=3)
    assert s.lengths == [1000, 1000, 1001]
    for n in range(6):
        w = s.tokens(n)
        assert len(w) == s.seq_len + 1 and (w == SEP_ID).sum() == 2
        segs = np.split(w, np.flatnonzero(w == SEP_ID))
        first, second = segs[0], segs[1][1:]
        # homologs: about 98% identical position by position (1-2% substitutions, no indel inside)
        assert (first[:len(second)] == second[:len(first)]).mean() > 0.9 or \
            (first[:500] == second[:500]).mean() > 0.9
    again = related.RelatedWindowSampler(recs, 3 * 1000 + 2, 3, seed=3)
    np.testing.assert_array_equal(again.tokens(4), s.tokens(4))  # a pure function of (seed, n)
    s.next_batch()
    resumed = related.RelatedWindowSampler(recs, 3 * 1000 + 2, 3, seed=3)
    resumed.load_state_dict(s.state_dict())
    np.testing.assert_array_equal(resumed.next_batch()["input_ids"], s.next_batch()["input_ids"])
    with pytest.raises(ValueError, match="related"):
        resumed.load_state_dict({**s.state_dict(), "related": 2})


def test_one_strain_species_falls_back_to_plain_windows(tmp_path):
    a, _, _, recs = _records(tmp_path)
    s = related.RelatedWindowSampler(recs[:1], 2000, 2)
    w = s.tokens(0)
    assert len(w) == 2001 and (w == SEP_ID).sum() == 0 and s.single == 1


def test_heldout_genome_is_scored_after_its_relatives(tmp_path):
    a, b, c, recs = _records(tmp_path)
    held = _write(tmp_path / "sp_D.fa", c)
    cfg = DataConfig(train=[r.source for r in recs[:2]], heldout=[held], seq_len=2001, related=2)
    data = build_data(cfg, EvalConfig(max_windows=3, by_position=500))
    (group, windows), (group_alone, alone) = data.heldout.items()
    assert group == "sp_D.fa (after 1 training relatives)" and len(windows) == 3
    assert group_alone == "sp_D.fa (after its own preceding bases)" and len(alone) == 3
    for w, w_alone in zip(windows, alone):
        assert w.score_from == 1001 and w.tokens[1000] == SEP_ID
        np.testing.assert_array_equal(w.tokens[w.score_from:], c[w.start:w.start + 1001])
        # the same scored bases, after the genome's own 1001 preceding bases instead of a relative's region
        assert w_alone.start == w.start and w_alone.score_from == 1001
        np.testing.assert_array_equal(w_alone.tokens, c[w.start - 1001:w.start + 1001])
    batch = next(iter(next(iter(data.heldout_batches().values()))))
    assert (batch["labels"][0, :1000] == -100).all() and (batch["labels"][0, 1000:] != -100).all()
    with pytest.raises(ValueError, match="data.related must be 0"):
        build_data(DataConfig(train=cfg.train, seq_len=2000, related=1))


def test_related_needs_the_dna_tokenizer(tmp_path):
    _, _, _, recs = _records(tmp_path)
    with pytest.raises(ValueError, match="single-nucleotide"):
        build_data(DataConfig(train=[recs[0].source], seq_len=100, related=2, tokenizer="/nonexistent/tok.json"))


def test_jittered_region_lengths_fill_the_window_and_vary():
    rng = np.random.default_rng(0)
    assert related.jittered_lengths(3002, 3, 0.0, rng) == related.segment_lengths(3002, 3)
    seen = set()
    for _ in range(50):
        lengths = related.jittered_lengths(4099, 4, 0.5, rng)
        assert sum(lengths) == 4099 - 3 and min(lengths) >= 512  # at least half of an equal share (1024)
        seen.add(tuple(lengths))
    assert len(seen) > 40


def test_jittered_windows_move_the_offset_between_homologs(tmp_path):
    """data.related_jitter: the separators fall at different places in different windows (so no fixed offset
    predicts the homologous base), each region still the homolog of the first from its start, windows still a
    pure function of (seed, n), and a resume with another jitter refused."""
    *_, recs = _records(tmp_path)
    s = related.RelatedWindowSampler(recs, 3 * 1000 + 2, 3, seed=3, jitter=0.5)
    cuts = set()
    for n in range(8):
        w = s.tokens(n)
        assert len(w) == s.seq_len + 1 and (w == SEP_ID).sum() == 2
        cuts.add(tuple(np.flatnonzero(w == SEP_ID)))
        segs = np.split(w, np.flatnonzero(w == SEP_ID))
        first, second = segs[0], segs[1][1:]
        m = min(len(first), len(second), 400)
        assert (first[:m] == second[:m]).mean() > 0.9 or (first[-m:] == second[-m:]).mean() > 0.9
    assert len(cuts) >= 6
    again = related.RelatedWindowSampler(recs, 3 * 1000 + 2, 3, seed=3, jitter=0.5)
    np.testing.assert_array_equal(again.tokens(5), s.tokens(5))
    plain = related.RelatedWindowSampler(recs, 3 * 1000 + 2, 3, seed=3)
    with pytest.raises(ValueError, match="related_jitter"):
        plain.load_state_dict(s.state_dict())


def test_jitter_without_related_windows_is_refused():
    with pytest.raises(ValueError, match="data.related_jitter 0.5 varies the regions of related windows"):
        DataConfig(related_jitter=0.5)
    assert DataConfig(related=3, related_jitter=0.5).related_jitter == 0.5

"""FASTA reading (plain, gzip, xz), lower case and N handling, bad inputs, train/held-out splits."""

import gzip
import lzma
from pathlib import Path

import numpy as np
import pytest

import megaseq.data.fasta as fasta
from megaseq.config import DataConfig
from megaseq.data.fasta import default_genome_path, expand_paths, load_dna_split, read_fasta
from megaseq.data.tokenizer import A_ID, C_ID, G_ID, N_ID, T_ID

GENOMES = Path(__file__).resolve().parents[3] / "shared" / "data" / "genomes"  # shared/ beside the repo
# an independent spelling of the id table, for comparing against the vectorized reader
IDS = {"A": A_ID, "C": C_ID, "G": G_ID, "T": T_ID, "N": N_ID}


def ids_of(text: str) -> np.ndarray:
    return np.array([IDS[c] for c in text], dtype=np.uint8)


def write(path: Path, text: str) -> Path:
    raw = text.encode()
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(raw))
    elif path.name.endswith(".xz"):
        path.write_bytes(lzma.compress(raw))
    else:
        path.write_bytes(raw)
    return path


def random_bases(n: int, seed: int) -> str:
    return "".join(np.random.default_rng(seed).choice(list("ACGT"), size=n))


def fasta_text(records: dict[str, str], width: int = 61, newline: str = "\n") -> str:
    out = []
    for header, seq in records.items():
        out.append(f">{header}")
        out += [seq[i:i + width] for i in range(0, len(seq), width)]
    return newline.join(out) + newline


@pytest.mark.parametrize("name", ["g.fa", "g.fa.gz", "g.fasta.xz", "misnamed.txt"])
def test_formats_and_multiple_records(tmp_path, name):
    recs = {"chr1 first record": random_bases(1000, 0), "chr2": random_bases(333, 1), "plasmid x y": "ACGTN"}
    out = read_fasta(write(tmp_path / name, fasta_text(recs)))
    assert [r.id for r in out] == ["chr1", "chr2", "plasmid"]
    assert out[0].description == "first record" and out[2].description == "x y"
    for r, seq in zip(out, recs.values()):
        assert r.tokens.dtype == np.uint8
        np.testing.assert_array_equal(r.tokens, ids_of(seq))
        assert r.source.endswith(name)


def test_small_blocks_crlf_and_no_final_newline(tmp_path, monkeypatch):
    """Blocks that cut lines and headers anywhere give the same records as one big block."""
    recs = {f"r{i}": random_bases(97 * i + 5, i) for i in range(1, 6)}
    text = fasta_text(recs, width=13, newline="\r\n").rstrip("\r\n")
    path = write(tmp_path / "g.fa", text)
    monkeypatch.setattr(fasta, "_BLOCK_BYTES", 7)
    small = read_fasta(path)
    assert [r.id for r in small] == list(recs)
    for r, seq in zip(small, recs.values()):
        np.testing.assert_array_equal(r.tokens, ids_of(seq))


@pytest.mark.parametrize("lowercase, expect", [("upper", "ACGTACGTN"), ("n", "ACGTNNNNN")])
def test_lowercase(tmp_path, lowercase, expect):
    path = write(tmp_path / "g.fa", ">s\nACGTacgtn\n")
    np.testing.assert_array_equal(read_fasta(path, lowercase=lowercase)[0].tokens, ids_of(expect))


def test_iupac_codes(tmp_path):
    path = write(tmp_path / "g.fa", ">s\nACRYKMSWBDHVUGT\nac\n>t\nrya\n")
    out = read_fasta(path, non_acgt="n")
    np.testing.assert_array_equal(out[0].tokens, ids_of("AC" + "N" * 11 + "GTAC"))
    np.testing.assert_array_equal(out[1].tokens, ids_of("NNA"))
    with pytest.raises(ValueError) as e:
        read_fasta(path, non_acgt="error")
    for word in ("IUPAC", "'R'", "record 's'", "line 2", "data.non_acgt=n", "g.fa"):
        assert word in str(e.value)


@pytest.mark.parametrize("block", [7, 1 << 23])
def test_illegal_character_names_file_record_line_char(tmp_path, monkeypatch, block):
    monkeypatch.setattr(fasta, "_BLOCK_BYTES", block)
    path = write(tmp_path / "bad.fa.gz", ">first\nACGT\nACGT\n>second desc\nACGT\nAC-GT\n")
    with pytest.raises(ValueError) as e:
        read_fasta(path)
    for word in ("bad.fa.gz", "record 'second'", "line 6", "illegal character '-'"):
        assert word in str(e.value)


@pytest.mark.parametrize("text, words", [
    ("", ["is empty"]),
    ("\n\n  \n", ["no FASTA records"]),
    ("ACGT\n>s\nACGT\n", ["line 1", "before the first '>' header"]),
    (">s\nACGT\n>s\nAC\n", ["record id 's'", "line 3", "unique"]),
    (">\nACGT\n", ["line 1", "empty header"]),
])
def test_bad_files(tmp_path, text, words):
    path = write(tmp_path / "x.fa", text)
    with pytest.raises(ValueError) as e:
        read_fasta(path)
    for word in words:
        assert word in str(e.value)


def test_missing_file_and_truncated_gzip(tmp_path):
    with pytest.raises(ValueError, match="nope.fa not found"):
        read_fasta(tmp_path / "nope.fa")
    full = gzip.compress(fasta_text({"s": random_bases(50_000, 0)}).encode())
    (tmp_path / "cut.fa.gz").write_bytes(full[: len(full) // 2])
    with pytest.raises(ValueError, match="could not decompress"):
        read_fasta(tmp_path / "cut.fa.gz")


def test_default_genome_is_lambda_phage():
    """The packaged asset, checked against a plain-Python count of its bases."""
    path = default_genome_path()
    recs = read_fasta(path)
    assert len(recs) == 1 and "NC_001416" in recs[0].id
    with gzip.open(path, "rt") as fh:
        seq = "".join(line.strip() for line in fh if not line.startswith(">")).upper()
    assert len(recs[0]) == len(seq) == 48502  # the README's figure
    for base, idx in IDS.items():
        assert int((recs[0].tokens == idx).sum()) == seq.count(base)


@pytest.mark.skipif(not (GENOMES / "klebsiella_MGH78578.fa.gz").is_file(), reason="shared genomes absent")
def test_shared_multi_record_genome():
    recs = read_fasta(GENOMES / "klebsiella_MGH78578.fa.gz")
    assert len(recs) == 6  # chromosome + 5 plasmids, per the genomes README
    assert sum(len(r) for r in recs) == 5_694_894


def _cfg(**kw) -> DataConfig:
    return DataConfig(**kw)


def test_split_by_file_and_by_record(tmp_path):
    a = write(tmp_path / "a.fa", fasta_text({"chr1": random_bases(500, 0), "chr2": random_bases(300, 1)}))
    b = write(tmp_path / "b.fa.gz", fasta_text({"other": random_bases(400, 2)}))
    split = load_dna_split(_cfg(train=[str(a)], heldout=[str(b)], heldout_records=["chr2"]))
    assert [r.id for r in split.train] == ["chr1"]
    assert {g: [r.id for r in rs] for g, rs in split.heldout.items()} == {
        "a.fa (held-out records)": ["chr2"], "b.fa.gz": ["other"]}


def test_split_errors(tmp_path):
    a = write(tmp_path / "a.fa", fasta_text({"chr1": "ACGT" * 10}))
    with pytest.raises(ValueError) as e:
        load_dna_split(_cfg(train=[str(a)], heldout_records=["chr1"]))
    for word in ("data.heldout_records", "no training data", "data.train"):
        assert word in str(e.value)
    with pytest.raises(ValueError, match=r"\['chrX'\] not found in data.train"):
        load_dna_split(_cfg(train=[str(a)], heldout_records=["chrX"]))
    with pytest.raises(ValueError, match="both data.train and data.heldout"):
        load_dna_split(_cfg(train=[str(a)], heldout=[str(a)]))
    with pytest.raises(ValueError, match="data.heldout: file .*missing.fa not found"):
        load_dna_split(_cfg(train=[str(a)], heldout=[str(tmp_path / "missing.fa")]))


def test_globs_default_and_tail(tmp_path):
    for i in range(3):
        write(tmp_path / f"g{i}.fa", fasta_text({f"s{i}": random_bases(100, i)}))
    found = expand_paths([str(tmp_path / "g*.fa")], "data.train")
    assert [p.name for p in found] == ["g0.fa", "g1.fa", "g2.fa"]
    with pytest.raises(ValueError, match="matches no file"):
        expand_paths([str(tmp_path / "*.fasta")], "data.train")
    with pytest.raises(ValueError, match="is a directory"):
        expand_paths([str(tmp_path)], "data.train")
    split = load_dna_split(_cfg(), heldout_tail=0.25)  # the packaged lambda genome, last quarter held out
    (head,), (tail,) = split.train, next(iter(split.heldout.values()))
    whole = read_fasta(default_genome_path())[0].tokens
    np.testing.assert_array_equal(np.concatenate([head.tokens, tail.tokens]), whole)
    assert len(tail) == len(whole) - int(len(whole) * 0.75)

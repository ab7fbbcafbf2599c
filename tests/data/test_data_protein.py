"""Protein families: exact ids of FASTA and A3M, separators and document bounds, splits, errors."""

from pathlib import Path

import numpy as np
import pytest

import megaseq.data.protein as protein
from megaseq.config import DataConfig
from megaseq.data import build_data, make_batch
from megaseq.data.fasta import read_fasta
from megaseq.data.protein import ProteinTokenizer, pack_family, read_family

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "protein-family-tiny"
# written out by hand from the table in megaseq.data.protein: 0 pad 1 bos 2 eos 3 sep, A=4 C=5 D=6 ... Y=23,
# B=24 Z=25 X=26 U=27 O=28, '-'=29
M, K, V, L, A, X, GAP, SEP = 14, 12, 21, 13, 4, 26, 29, 3
FAMILY_FA = ">p1 first protein\nMKV\nla\n>p2\nM-KX*\n"
STREAM = [M, K, V, L, A, SEP, M, GAP, K, X, SEP]
IGN = -100


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_letter_ids_are_the_declared_table():
    tok = ProteinTokenizer()
    assert tok.vocab()["A"] == 4 and tok.vocab()["Y"] == 23 and tok.vocab()["O"] == 28 and tok.vocab()["-"] == 29
    assert tok.vocab()["<sep>"] == SEP and len(tok.vocab()) == 30
    np.testing.assert_array_equal(tok.encode("mkvLA-x"), [M, K, V, L, A, GAP, X])
    assert tok.decode([M, K, SEP, GAP]) == "MK-"


def test_fasta_records_and_family_stream(tmp_path):
    recs = read_family(write(tmp_path, "fam.fa", FAMILY_FA))
    assert [r.id for r in recs] == ["p1", "p2"] and recs[0].description == "first protein"
    np.testing.assert_array_equal(recs[0].tokens, [M, K, V, L, A])
    np.testing.assert_array_equal(recs[1].tokens, [M, GAP, K, X])  # '*' skipped
    packed = pack_family(recs, SEP, "family")
    np.testing.assert_array_equal(packed.tokens, STREAM)
    np.testing.assert_array_equal(packed.doc_ids, [0] * 11)


def test_a3m_insertions_kept_dots_dropped_and_gaps(tmp_path):
    a3m = "#6\t1\n>query\nMKV-LA\n>hit1 e=1e-5\nMkvV-.La\n"
    recs = read_family(write(tmp_path, "fam.a3m", a3m))
    np.testing.assert_array_equal(recs[0].tokens, [M, K, V, GAP, L, A])
    np.testing.assert_array_equal(recs[1].tokens, [M, K, V, V, GAP, L, A])  # insertions upper-cased, '.' dropped
    dropped = read_family(tmp_path / "fam.a3m", gaps="drop")
    np.testing.assert_array_equal(dropped[1].tokens, [M, K, V, V, L, A])


def family_batch(docs: str, tmp_path: Path) -> dict:
    packed = pack_family(read_family(write(tmp_path, "fam.fa", FAMILY_FA)), SEP, docs)
    return make_batch([packed.tokens], [packed.doc_ids])


# the expectations: in a family every protein is context for the next (the separator predicts the next
# protein's first residue); as separate documents the separator ends its protein and predicts nothing
EXPECTED = {
    "family": {"labels": [K, V, L, A, SEP, M, GAP, K, X, SEP], "doc_ids": [0] * 10},
    "protein": {"labels": [K, V, L, A, SEP, IGN, GAP, K, X, SEP], "doc_ids": [0] * 6 + [1] * 4},
}


def check_batch(batch: dict, docs: str) -> None:
    assert batch["input_ids"][0].tolist() == STREAM[:-1]
    assert batch["labels"][0].tolist() == EXPECTED[docs]["labels"]
    assert batch["doc_ids"][0].tolist() == EXPECTED[docs]["doc_ids"]


@pytest.mark.parametrize("docs", ["family", "protein"])
def test_packed_batch_ids_labels_and_documents(tmp_path, docs):
    check_batch(family_batch(docs, tmp_path), docs)


def test_separator_leaking_into_the_next_protein_fails(tmp_path, monkeypatch):
    """Broken variant: the separator counted in the next protein's document (its doc id shifted by one)."""
    real = pack_family

    def leaky(*args, **kw):
        packed = real(*args, **kw)
        packed.doc_ids = np.concatenate([packed.doc_ids[:1], packed.doc_ids[:-1]])
        return packed

    monkeypatch.setattr(protein, "pack_family", leaky)
    packed = protein.pack_family(read_family(write(tmp_path, "fam.fa", FAMILY_FA)), SEP, "protein")
    with pytest.raises(AssertionError):
        check_batch(make_batch([packed.tokens], [packed.doc_ids]), "protein")


def test_missing_separator_between_proteins_fails(tmp_path):
    """Broken variant: two proteins joined with no separator."""
    recs = read_family(write(tmp_path, "fam.fa", FAMILY_FA))
    joined = np.concatenate([recs[0].tokens, recs[1].tokens, [SEP, SEP]]).astype(np.int32)
    with pytest.raises(AssertionError):
        check_batch(make_batch([joined], [np.zeros(len(joined), np.int32)]), "family")


def test_dna_refuses_a_protein_and_names_the_fix(tmp_path):
    path = write(tmp_path, "hemoglobins.fa", ">hbb human\nMVHLTPEEK\n")
    with pytest.raises(ValueError) as e:
        read_fasta(path)
    for word in ("hemoglobins.fa", "record 'hbb'", "line 2", "'L'", "--data.alphabet protein"):
        assert word in str(e.value)


def test_protein_refuses_a_letter_outside_the_alphabet(tmp_path):
    path = write(tmp_path, "fam.fa", ">a\nMKV\n>b\nMK\nVJL\n")
    with pytest.raises(ValueError) as e:
        read_family(path)
    for word in ("fam.fa", "record 'b'", "line 5", "'J'", "X: an unknown residue"):
        assert word in str(e.value)


def protein_cfg(**kw) -> DataConfig:
    base = {"alphabet": "protein", "train": [str(RECIPE / "famA.fa"), str(RECIPE / "famB.fa")],
            "heldout": [str(RECIPE / "famC.fa")], "seq_len": 256}
    return DataConfig(**{**base, **kw})


def test_build_data_trains_on_families_and_holds_one_out():
    data = build_data(protein_cfg(), vocab_size=32)
    assert data.unit == "residue" and data.score_ids == tuple(range(4, 29))
    assert list(data.heldout) == ["famC.fa"]
    train = data.train.records[0]
    assert train.num_docs == 2 and set(np.unique(train.doc_ids)) == {0, 1}  # one document per family
    assert "famC" not in train.source and "famA.fa" in train.source
    held = {r.id for r in read_family(RECIPE / "famC.fa")}
    seen = {r.id for f in ("famA.fa", "famB.fa") for r in read_family(RECIPE / f)}
    assert not held & seen
    batch = data.train.next_batch()
    assert batch["input_ids"].shape == (1, 256) and int(batch["input_ids"].max()) < 30


def test_build_data_holds_out_records_and_checks_the_model_vocab():
    data = build_data(protein_cfg(heldout=[], heldout_records=["famA_039"], seq_len=64), vocab_size=32)
    assert list(data.heldout) == ["famA.fa (held-out records)"]
    with pytest.raises(ValueError, match="vocabulary has only 16"):
        build_data(protein_cfg(), vocab_size=16)


def test_protein_settings_errors():
    with pytest.raises(ValueError, match="needs data.train"):
        build_data(DataConfig(alphabet="protein"), vocab_size=32)
    with pytest.raises(ValueError, match="data.heldout_tail"):
        build_data(protein_cfg(heldout_tail=0.1), vocab_size=32)
    with pytest.raises(ValueError, match="data.alphabet must be one of"):
        DataConfig(alphabet="rna")
    with pytest.raises(ValueError, match="--data.alphabet protein"):
        DataConfig(tokenizer="protein")


@pytest.mark.parametrize("settings, words", [
    ({"gaps": "drop"}, "data.gaps and data.protein_docs apply to protein"),
    ({"alphabet": "protein", "kind": "text"}, "data.alphabet protein reads FASTA"),
    ({"loss_roles": ["user"]}, "data.loss_roles applies to conversations"),
    ({"column": "seq"}, "data.column names the column"),
])
def test_settings_of_another_kind_are_refused(settings, words):
    with pytest.raises(ValueError, match=words):
        DataConfig(**settings)


def test_a_checkpoints_own_tokenizer_reads_the_family(tmp_path):
    """data.tokenizer DIR: residues through a checkpoint's tokenizer, its eos between proteins, per-token report."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<eos>": 0, **{ch: i + 1 for i, ch in enumerate("ACDEFGHIKLMNPQRSTVWYBZXUO-")}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tk.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<eos>"}')
    fam = write(tmp_path, "fam.fa", FAMILY_FA)
    data = build_data(DataConfig(alphabet="protein", tokenizer=str(tmp_path), train=[str(fam)], seq_len=10),
                      vocab_size=32)
    assert data.unit == "token" and data.score_ids is None
    ids = [vocab[c] for c in "MKVLA"] + [0] + [vocab[c] for c in "M-KX"] + [0]
    assert data.train.records[0].tokens.tolist() == ids

"""DNA tokenizer ids, reverse complement, the HF tokenizer wrapper (a tiny tokenizer built here)."""

import json

import numpy as np
import pytest

from megaseq.config import DataConfig
from megaseq.data import build_tokenizer
from megaseq.data.tokenizer import (
    DNA_VOCAB_SIZE,
    DnaTokenizer,
    HfTokenizer,
    complement_lut,
    reverse_complement,
)
from megaseq.models.presets import DNA_VOCAB_SIZE as PRESET_DNA_VOCAB


def test_dna_ids_and_round_trip():
    tok = DnaTokenizer()
    assert tok.vocab_size == DNA_VOCAB_SIZE == PRESET_DNA_VOCAB == 16
    ids = tok.encode("AC gt\nN")
    assert ids.tolist() == [4, 5, 6, 7, 8]
    assert tok.decode(ids) == "ACGTN"
    assert tok.encode("ACGT", add_bos=True, add_eos=True).tolist() == [tok.bos_id, 4, 5, 6, 7, tok.eos_id]
    assert len({tok.pad_id, tok.bos_id, tok.eos_id, tok.sep_id, 4, 5, 6, 7, 8}) == 9
    assert tok.decode([tok.bos_id, 4, tok.eos_id], skip_special=False) == "<bos>A<eos>"
    assert DnaTokenizer(lowercase="n").decode(DnaTokenizer(lowercase="n").encode("acgTA")) == "NNNTA"


def test_dna_encode_errors():
    with pytest.raises(ValueError, match="position 2: illegal character 'X'"):
        DnaTokenizer().encode("ACXGT")
    with pytest.raises(ValueError, match="IUPAC ambiguity code"):
        DnaTokenizer(non_acgt="error").encode("ACRGT")
    assert DnaTokenizer(non_acgt="n").decode(DnaTokenizer().encode("ACRGT")) == "ACNGT"


def test_reverse_complement_against_strings():
    rng = np.random.default_rng(0)
    seq = "".join(rng.choice(list("ACGTN"), size=101))
    expected = seq[::-1].translate(str.maketrans("ACGTN", "TGCAN"))
    tok = DnaTokenizer()
    assert tok.decode(reverse_complement(tok.encode(seq))) == expected
    lut = complement_lut()
    assert lut[lut].tolist() == list(range(256))  # an involution; specials map to themselves
    assert [int(lut[i]) for i in (tok.pad_id, tok.bos_id, tok.eos_id)] == [tok.pad_id, tok.bos_id, tok.eos_id]


def test_check_vocab():
    DnaTokenizer().check_vocab(16)
    DnaTokenizer().check_vocab(9)
    with pytest.raises(ValueError) as e:
        DnaTokenizer().check_vocab(8)
    for word in ("ids up to 8", "only 8 entries", "data.tokenizer"):
        assert word in str(e.value)


def make_word_tokenizer(tmp_path, words=("the", "cat", "sat", "on", "mat", "a", "dog"), config=True):
    """A WordLevel tokenizer trained in memory and saved as tokenizer.json (no downloads)."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"])
    tok.train_from_iterator([" ".join(words)] * 3, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    if config:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    return tok


def test_hf_tokenizer_from_dir_and_file(tmp_path):
    raw = make_word_tokenizer(tmp_path)
    for where in (tmp_path, tmp_path / "tokenizer.json"):
        tok = HfTokenizer(where)
        ids = tok.encode("the cat sat")
        assert ids.dtype == np.int32 and ids.tolist() == raw.encode("the cat sat").ids
        assert tok.decode(ids) == "the cat sat"
        assert tok.eos_id == raw.token_to_id("</s>")
        assert tok.num_ids == raw.get_vocab_size()
        assert [a.tolist() for a in tok.encode_batch(["a dog", "mat"])] == [raw.encode("a dog").ids,
                                                                           raw.encode("mat").ids]
    with pytest.raises(ValueError, match="only 3 entries"):
        tok.check_vocab(3)
    tok.check_vocab(tok.num_ids)


def test_hf_tokenizer_eos_guess_and_errors(tmp_path):
    make_word_tokenizer(tmp_path, config=False)
    assert HfTokenizer(tmp_path).eos_id == HfTokenizer(tmp_path)._tok.token_to_id("</s>")  # a common spelling
    with pytest.raises(ValueError) as e:
        HfTokenizer(tmp_path / "nowhere")
    for word in ("data.tokenizer", "not found", "tokenizer.json"):
        assert word in str(e.value)


def test_hf_encode_dna_chunks(tmp_path):
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, trainers

    rng = np.random.default_rng(1)
    corpus = ["".join(rng.choice(list("ACGT"), size=500)) for _ in range(20)]
    bpe = Tokenizer(models.BPE())
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=40, initial_alphabet=list("ACGT")))
    bpe.save(str(tmp_path / "tokenizer.json"))
    tok = HfTokenizer(tmp_path)
    bases = DnaTokenizer().encode(corpus[0] + corpus[1])
    ids = tok.encode_dna(bases, chunk_bases=97)
    assert "".join(bpe.id_to_token(int(i)) for i in ids) == corpus[0] + corpus[1]


def test_build_tokenizer(tmp_path):
    assert isinstance(build_tokenizer(DataConfig()), DnaTokenizer)
    assert build_tokenizer(DataConfig(lowercase="n")).lowercase == "n"
    make_word_tokenizer(tmp_path)
    assert isinstance(build_tokenizer(DataConfig(tokenizer=str(tmp_path))), HfTokenizer)

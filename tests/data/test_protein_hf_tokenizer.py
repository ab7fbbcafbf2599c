"""A protein run's Hugging Face export carries its residue tokenizer (``data/char_hf.py``):
``AutoTokenizer.from_pretrained`` loads it and gives the ids the run gave the same file, separators and the
other special tokens included, for both ``data.gaps`` settings; a LoRA run's adapter directory carries it too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import torch_threads
from megaseq.data import char_hf
from megaseq.data.protein import FIRST_RESIDUE_ID, GAP_ID, LETTERS, ProteinTokenizer, pack_family, read_family
from megaseq.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, SEP_ID

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
RECIPES = Path(__file__).resolve().parents[2] / "recipes"
UNK_ID = GAP_ID + 1

# Three globins (hemoglobin alpha and beta, myoglobin) as a FASTA family with wrapped lines, and the same
# family as an A3M alignment: lower-case insertions, '.' padding, '-' gaps, a '#' header, a stop '*', and the
# ambiguity and rare codes B Z X U O.
GLOBINS = """>HBA
MVLSPADKTNVKAAWGKVGAHAGEYGAEALERMFLSFPTTKTYFPHFDLSHGSAQVKGHGKKVADALTNAVAHVDDMPNALSALSDLHAHKL
RVDPVNFKLLSHCLLVTLAAHLPAEFTPAVHASLDKFLASVSTVLTSKYR
>HBB
MVHLTPEEKSAVTALWGKVNVDEVGGEALGRLLVVYPWTQRFFESFGDLSTPDAVMGNPKVKAHGKKVLGAFSDGLAHLDNLKGTFATLSELHCDKL
HVDPENFRLLGNVLVCVLAHHFGKEFTPPVQAAYQKVVAGVANALAHKYH*
>MYG
MVLSEGEWQLVLHVWAKVEADVAGHGQDILIRLFKSHPETLEKFDRFKHLKTEAEMKASEDLKKHGVTVLTALGAILKKKGHHEAELKPLAQSHA
TKHKIPIKYLEFISEAIIHVLHSRHPGDFGADAQGAMNKALELFRKDIAAKYKELGYQG
"""
A3M = """#62 3
>query
MVLSPADKTNVKAAWGKVGAHAGEYGAEALERMF
>hom1
MVLSPAD-TNVKAAWgkvGAHAGEYGAEALERMF
>hom2 with B Z X U O
MV-SPEDktnvKAAW..GAHAGBYGZEXLURMO*
>hom3
--LSPADKTNVKAAWGKVGAHA------ALERMF
"""


def _texts(fasta: str) -> list[str]:
    """Each record's sequence lines as the file holds them (line breaks included)."""
    records = [r for r in fasta.split(">")[1:]]
    return [r.split("\n", 1)[1] for r in records]


def _write(tmp_path: Path, tok: ProteinTokenizer) -> object:
    assert char_hf.write_hf_protein_tokenizer(tok, tmp_path) == ["tokenizer.json", "tokenizer_config.json"]
    return transformers.AutoTokenizer.from_pretrained(str(tmp_path))


def _agree(hf_tok, gaps: str, folder: Path) -> None:
    """The run's ids (the file read, a family packed with its separators) against the HF tokenizer's."""
    tok = ProteinTokenizer(gaps)
    for name, text in (("globins.fa", GLOBINS), ("family.a3m", A3M)):
        path = folder / name
        path.write_text(text)
        records = read_family(path, gaps)
        texts = _texts(text)
        assert len(records) == len(texts) == text.count(">")
        for record, seq in zip(records, texts):
            assert hf_tok(seq)["input_ids"] == record.tokens.tolist() == tok.encode(seq).tolist(), seq
        packed = pack_family(records, SEP_ID)  # protein, sep, protein, sep, ...: what the run trains on
        assert hf_tok("".join(t + "<sep>" for t in texts))["input_ids"] == packed.tokens.tolist()


@pytest.mark.parametrize("gaps", ["keep", "drop"])
def test_the_written_tokenizer_tokenizes_as_the_run(tmp_path, gaps):
    tok = ProteinTokenizer(gaps)
    hf_tok = _write(tmp_path, tok)
    _agree(hf_tok, gaps, tmp_path)
    assert [hf_tok.pad_token_id, hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.sep_token_id,
            hf_tok.unk_token_id] == [PAD_ID, BOS_ID, EOS_ID, SEP_ID, UNK_ID]
    assert hf_tok("<bos>MK<eos><pad>")["input_ids"] == [BOS_ID, 14, 12, EOS_ID, PAD_ID]
    vocab = hf_tok.get_vocab()
    assert {k: vocab[k] for k in tok.vocab()} == tok.vocab() and len(vocab) == tok.vocab_size
    assert hf_tok.decode(hf_tok("MKV-XBZUO<sep>")["input_ids"], skip_special_tokens=True) == (
        "MKV-XBZUO" if gaps == "keep" else "MKVXBZUO")
    # a character the run refuses is <unk>, an id the run never gives
    with pytest.raises(ValueError, match="illegal character 'J'"):
        tok.encode("MKJ")
    assert hf_tok("MKJ1\u00e9")["input_ids"] == [14, 12, UNK_ID, UNK_ID, UNK_ID]
    # the hand-written file is what the tokenizers package reads and writes back unchanged
    text = (tmp_path / "tokenizer.json").read_text()
    assert json.loads(tokenizers.Tokenizer.from_str(text).to_str()) == json.loads(text)


def test_a_vocabulary_shifted_by_one_fails_the_check(tmp_path, monkeypatch):
    real = char_hf.protein_char_vocab

    def shifted(tok):
        v = real(tok)
        vocab = {k: (i + 1 if FIRST_RESIDUE_ID <= i <= GAP_ID else (FIRST_RESIDUE_ID if i == UNK_ID else i))
                 for k, i in v.vocab.items()}
        return char_hf.CharVocab(vocab, v.specials, v.replacements)

    monkeypatch.setattr(char_hf, "protein_char_vocab", shifted)
    with pytest.raises(AssertionError):
        _agree(_write(tmp_path, ProteinTokenizer()), "keep", tmp_path)


def test_a_tokenizer_that_keeps_insertions_lower_case_fails_the_check(tmp_path, monkeypatch):
    """A3M's lower-case insertions left as they are: WordLevel reads them as <unk>, not as the run's residues."""
    real = char_hf.lut_replacements
    monkeypatch.setattr(char_hf, "lut_replacements",
                        lambda lut, letters: [(a, b) for a, b in real(lut, letters) if not a.islower()])
    with pytest.raises(AssertionError):
        _agree(_write(tmp_path, ProteinTokenizer()), "keep", tmp_path)


def test_a_tokenizer_without_its_unknown_token_fails(tmp_path, monkeypatch):
    real = char_hf.protein_char_vocab

    def no_unk(tok):
        v = real(tok)
        return char_hf.CharVocab({k: i for k, i in v.vocab.items() if k != "<unk>"},
                                 {i: n for i, n in v.specials.items() if n != "<unk>"}, v.replacements)

    monkeypatch.setattr(char_hf, "protein_char_vocab", no_unk)
    hf_tok = _write(tmp_path, ProteinTokenizer())
    _agree(hf_tok, "keep", tmp_path)  # every residue still reads as the run's ...
    with pytest.raises(Exception, match="Missing \\[UNK\\] token"):  # ... but a refused character has no id
        hf_tok("MKJ")


def test_every_letter_has_the_runs_id(tmp_path):
    hf_tok = _write(tmp_path, ProteinTokenizer())
    for k, ch in enumerate(LETTERS):
        assert hf_tok(ch)["input_ids"] == hf_tok(ch.lower())["input_ids"] == [FIRST_RESIDUE_ID + k]


def _train(tmp_path: Path, *extra: str) -> Path:
    from megaseq.config import load_config
    from megaseq.train.trainer import run_training

    run = tmp_path / "run"
    cfg = load_config(RECIPES / "protein-family-tiny" / "recipe.yaml",
                      [f"train.run_dir={run}", "data.seq_len=128", "train.steps=1", "train.eval_every=0",
                       "train.eval_after=false", "log.progress=false", "log.tensorboard=false", *extra])
    with torch_threads(1):
        run_training(cfg)
    return run


def _check_export(folder: Path, gaps: str) -> None:
    fam = RECIPES / "protein-family-tiny" / "famC.fa"
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    records = read_family(fam, gaps)
    texts = _texts(fam.read_text())
    assert [hf_tok(t)["input_ids"] for t in texts] == [r.tokens.tolist() for r in records]


def test_a_protein_runs_export_loads_with_its_tokenizer(tmp_path):
    """The protein-family recipe, one step: RUN/hf loads with AutoTokenizer and tokenizes the held-out family
    as the run read it."""
    run = _train(tmp_path, "data.gaps=drop")
    assert sorted(p.name for p in (run / "hf").iterdir() if p.name.startswith("tokenizer")) == [
        "tokenizer.json", "tokenizer_config.json"]
    _check_export(run / "hf", "drop")


def test_a_protein_lora_runs_adapter_carries_the_tokenizer(tmp_path):
    """With LoRA the PEFT adapter directory carries the tokenizer as the merged HF export does, and so do
    ``megaseq export`` (adapter and merged) and ``megaseq convert`` from the run's checkpoint."""
    from megaseq.cli.main import main

    run = _train(tmp_path, "lora.rank=4", "lora.export_merged=true")
    assert (run / "adapter" / "adapter_config.json").is_file()
    assert main(["export", str(run), str(tmp_path / "adapter2")]) == 0
    assert main(["export", str(run), str(tmp_path / "merged2"), "--merged"]) == 0
    assert (tmp_path / "adapter2" / "adapter_config.json").is_file()
    for folder in (run / "adapter", run / "hf", tmp_path / "adapter2", tmp_path / "merged2"):
        _check_export(folder, "keep")


def test_convert_from_a_protein_run_carries_the_tokenizer(tmp_path):
    from megaseq.cli.main import main

    run = _train(tmp_path, "train.export_hf=false")
    assert not (run / "hf").exists()
    assert main(["convert", str(run), str(tmp_path / "converted")]) == 0
    _check_export(tmp_path / "converted", "keep")

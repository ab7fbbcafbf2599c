"""A DNA run's Hugging Face export carries its tokenizer: ``AutoTokenizer.from_pretrained(RUN/hf)`` loads it and
tokenizes as the run did (``data/dna_hf.py``), for every ``data.lowercase`` / ``data.non_acgt`` setting."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
import torch

from megaseq.data import dna_hf
from megaseq.data.tokenizer import IUPAC_AMBIGUITY, DnaTokenizer

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
SETTINGS = [("upper", "n"), ("n", "n"), ("upper", "error"), ("n", "error")]


def _texts(seed: int = 0) -> list[str]:
    """DNA as files hold it: upper and soft-masked bases, N, ambiguity codes, line breaks and spaces."""
    rng = np.random.default_rng(seed)
    alphabet = list("ACGTNacgtn" + IUPAC_AMBIGUITY + IUPAC_AMBIGUITY.lower()) + ["\n", " ", "\t", "\r\n"]
    return ["".join(rng.choice(alphabet, n)) for n in (1, 7, 61, 500)] + ["GATTACA", "acgt\nACGT"]


def _agree(hf_tok, tok: DnaTokenizer) -> None:
    for text in _texts():
        try:
            want = tok.encode(text).tolist()
        except ValueError:  # a character the run refuses: the HF tokenizer reads it as <unk>
            got = hf_tok(text)["input_ids"]
            assert dna_hf.UNK_ID in got, text
            continue
        assert hf_tok(text)["input_ids"] == want, text


@pytest.mark.parametrize("lowercase, non_acgt", SETTINGS)
def test_the_written_tokenizer_tokenizes_as_the_run(tmp_path, lowercase, non_acgt):
    tok = DnaTokenizer(lowercase, non_acgt)
    assert dna_hf.write_hf_dna_tokenizer(tok, tmp_path) == ["tokenizer.json", "tokenizer_config.json"]
    _agree(transformers.AutoTokenizer.from_pretrained(str(tmp_path)), tok)
    # the hand-written file is what the tokenizers package reads and writes back unchanged
    text = (tmp_path / "tokenizer.json").read_text()
    assert json.loads(tokenizers.Tokenizer.from_str(text).to_str()) == json.loads(text)


def test_a_tokenizer_that_keeps_soft_masked_bases_fails_the_check(tmp_path, monkeypatch):
    """A broken table: lower-case bases left as they are (WordLevel reads them as <unk>)."""
    real = dna_hf._replacements
    monkeypatch.setattr(dna_hf, "_replacements", lambda tok: [(a, b) for a, b in real(tok) if not a.islower()])
    with pytest.raises(AssertionError):
        test_the_written_tokenizer_tokenizes_as_the_run(tmp_path, "upper", "n")


def test_a_dna_runs_export_loads_with_its_tokenizer(tmp_path):
    """The default job's data (the phage genome shipped in the package), a tiny model, one step: RUN/hf loads with
    AutoTokenizer and tokenizes the genome as the run's tokenizer does."""
    from megaseq.cli.main import main
    from megaseq.data import default_genome_path

    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rc = main(["train", "--train.steps", "1", "--data.seq_len", "64", "--train.eval_every", "0",
                   "--train.eval_after", "false", "--log.progress", "false", "--log.tensorboard", "false",
                   "--train.run_dir", str(tmp_path / "run")])
    finally:
        torch.set_num_threads(prev)
    assert rc == 0
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "run" / "hf"))
    genome = gzip.open(default_genome_path(), "rt").read().split("\n", 1)[1][:5000]
    assert hf_tok(genome)["input_ids"] == DnaTokenizer().encode(genome).tolist()
    assert hf_tok.decode(hf_tok("ACGTN")["input_ids"]) == "ACGTN"

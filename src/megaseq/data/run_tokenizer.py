"""The tokenizer files of a run's export (a HF checkpoint, or a LoRA adapter directory), so the export loads
with ``AutoTokenizer.from_pretrained`` and tokenizes as the run did: the files (and chat template) of the
checkpoint tokenizer the run used, or its built-in DNA (``data/dna_hf.py``) or protein (``data/char_hf.py``)
tokenizer written as a Hugging Face tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megaseq.data.char_hf import write_hf_protein_tokenizer
from megaseq.data.chat import copy_tokenizer_files
from megaseq.data.dna_hf import write_hf_dna_tokenizer
from megaseq.data.protein import ProteinTokenizer
from megaseq.data.tokenizer import DnaTokenizer


def write_run_tokenizer(data_cfg: Any, out_dir: str | Path) -> list[str]:
    """The tokenizer files of a run's export (HF checkpoint or LoRA adapter directory) into ``out_dir``: the
    checkpoint tokenizer's files and the chat template (``data.tokenizer`` a path, ``data.chat_template``), or
    the built-in DNA / protein tokenizer written as a HF tokenizer. Returns the names written."""
    written = copy_tokenizer_files(data_cfg.tokenizer, out_dir, data_cfg.chat_template)
    if data_cfg.kind == "fasta" and data_cfg.tokenizer == "dna":
        written += write_hf_dna_tokenizer(DnaTokenizer(data_cfg.lowercase, data_cfg.non_acgt), out_dir)
    elif data_cfg.kind == "fasta" and data_cfg.tokenizer == "protein":
        written += write_hf_protein_tokenizer(ProteinTokenizer(data_cfg.gaps), out_dir)
    return written

"""megaseq: fine-tune MoE and hybrid-attention language models on million-token sequences."""

__version__ = "0.1.0"

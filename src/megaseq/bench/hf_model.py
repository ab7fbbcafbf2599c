"""The transformers model of a checkpoint megaseq exported: what the peer (``bench.peer``), the baseline
(``bench.reference``) and the parity check (``bench.verify``) load, with the attention and experts paths
they ask for."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def load_reference_model(path: str, dtype: torch.dtype = torch.float64, attn: str = "eager",
                         experts: str = "eager") -> torch.nn.Module:
    """The transformers model of an exported checkpoint (pure-torch eager paths unless told otherwise)."""
    import transformers

    transformers.logging.set_verbosity_error()  # the GLM-5 export has no vision weights: expected
    cls = json.loads((Path(path) / "config.json").read_text())["architectures"][0]  # what the export names
    config = transformers.AutoConfig.from_pretrained(path)
    for c in (config, getattr(config, "text_config", None)):
        if c is not None:
            c._experts_implementation = experts
    model = getattr(transformers, cls).from_pretrained(path, config=config, dtype=dtype, attn_implementation=attn)
    return model.eval()

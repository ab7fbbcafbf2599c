"""The baseline for ``megaseq bench --baseline``: the transformers implementation of the same
architecture and the same weights, trained with its gradient checkpointing on and the best attention
it supports (SDPA; GLM-5's DSA has no flash path in transformers), on the same random tokens.
"""

from __future__ import annotations

import tempfile
import time
from typing import Any

import torch

from megaseq.bench import GIB, H200_BF16_FLOPS, _free, _sync, host_rss_peak, host_rss_peak_reset
from megaseq.config import Config


def build_reference(cfg: Config, device: torch.device) -> tuple[torch.nn.Module, Any]:
    """(transformers model in bf16 with gradient checkpointing, spec) on the weights megaseq would start from."""
    from megaseq.models.build import build_model
    from megaseq.models.hf_io import export_hf_checkpoint
    from megaseq.models.presets import resolve_spec
    from megaseq.verify import load_reference_model

    spec = resolve_spec(cfg.model.name)
    ours = build_model(spec, dtype=torch.float32, device="cpu", seed=cfg.train.seed)
    with tempfile.TemporaryDirectory() as tmp:
        export_hf_checkpoint(ours, spec, f"{tmp}/hf")
        del ours
        ref = load_reference_model(f"{tmp}/hf", dtype=torch.bfloat16, attn="sdpa", experts="grouped_mm")
    if hasattr(ref, "activation_checkpointing_enable"):  # transformers >= 5.24
        ref.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref.config.use_cache = False
    return ref.to(device).train(), spec


def measure_reference(cfg: Config, seq_len: int, steps: int) -> dict[str, Any]:
    from megaseq.plan.flops import step_flops

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    row: dict[str, Any] = {"seq_len": seq_len, "source": "random", "system": "transformers"}
    model = None
    try:
        model, spec = build_reference(cfg, device)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, fused=device.type == "cuda" or None)
        g = torch.Generator().manual_seed(cfg.train.seed)
        host_rss_peak_reset()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for i in range(steps + 1):
            ids = torch.randint(0, spec.vocab_size, (1, seq_len + 1), generator=g).to(device)
            t0 = time.perf_counter()
            out = model(input_ids=ids[:, :-1], labels=ids[:, :-1])
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(device)
            if i > 0:
                times.append(time.perf_counter() - t0)
        dt = sum(times) / len(times)
        per_token = step_flops(spec, seq_len).per_token
        row.update(status="ok", step_s=dt, tokens_per_s=seq_len / dt,
                   mfu=seq_len / dt * per_token / H200_BF16_FLOPS if device.type == "cuda" else None,
                   measured_gpu_gib=torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None,
                   measured_host_gib=host_rss_peak() / 1e9)
    except torch.OutOfMemoryError as e:
        row.update(status="oom", error=str(e).splitlines()[0][:200])
    finally:
        del model
        _free(device)
    return row

"""The baseline for ``megaseq bench --baseline``: the peer (``bench.peer``: the transformers implementation
of the same architecture, with Liger's kernels where they apply and PEFT's LoRA for a LoRA recipe, activation
checkpointing, SDPA; GLM-5's DSA has no flash path in transformers) timed on the same random tokens; and the
per-token log-probability check against transformers in fp32 on megaseq's weights.
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch

from megaseq.bench.hf_model import load_reference_model
from megaseq.bench.measure import GIB, free_memory, host_rss_peak, host_rss_peak_reset, timed_steps
from megaseq.bench.peer import build_peer
from megaseq.config import Config


def build_reference(cfg: Config, device: torch.device,
                    dtype: torch.dtype = torch.bfloat16) -> tuple[torch.nn.Module, Any]:
    """(transformers model in ``dtype`` with gradient checkpointing, spec) on the weights megaseq would start
    from (built in fp32 on the CPU, exported, loaded in ``dtype``)."""
    from megaseq.models.build import build_model
    from megaseq.models.hf_io import export_hf_checkpoint
    from megaseq.models.presets import resolve_spec

    spec = resolve_spec(cfg.model.name)
    ours = build_model(spec, dtype=torch.float32, device="cpu", seed=cfg.train.seed)
    with tempfile.TemporaryDirectory() as tmp:
        export_hf_checkpoint(ours, spec, f"{tmp}/hf")
        del ours
        ref = load_reference_model(f"{tmp}/hf", dtype=dtype, attn="sdpa", experts="grouped_mm")
    if hasattr(ref, "activation_checkpointing_enable"):  # transformers >= 5.24
        ref.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref.config.use_cache = False
    return ref.to(device).train(), spec


def measure_reference(cfg: Config, seq_len: int, steps: int, routing: str = "natural") -> dict[str, Any]:
    """The peer (``bench.peer``: transformers, Liger where it applies, PEFT's LoRA for a LoRA recipe) at
    ``seq_len``: warm-up + ``steps`` timed steps on random tokens; an OOM is a result, not an error."""
    from megaseq.plan.flops import mfu, step_flops

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    row: dict[str, Any] = {"seq_len": seq_len, "source": "random", "system": "transformers", "routing": routing}
    model = None
    try:
        model, spec, row["peer"] = build_peer(cfg, device, routing)
        trained = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trained, lr=cfg.optim.lr, fused=device.type == "cuda" or None)
        g = torch.Generator().manual_seed(cfg.train.seed)
        host_rss_peak_reset()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        def step(net: torch.nn.Module = model) -> None:  # (``model`` is deleted below)
            ids = torch.randint(0, spec.vocab_size, (1, seq_len + 1), generator=g).to(device)
            out = net(input_ids=ids[:, :-1], labels=ids[:, :-1])
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        first: list[float] = []
        compiles: dict[str, Any] = {}
        times = timed_steps(step, steps, device, first, compiles)
        dt = sum(times) / len(times)
        per_token = step_flops(spec, seq_len).per_token
        row.update(status="ok", step_s=dt, first_step_s=first[0], first_step_compiles=compiles,
                   tokens_per_s=seq_len / dt,
                   trained_params=sum(p.numel() for p in trained),
                   mfu=mfu(seq_len / dt, per_token, 1) if device.type == "cuda" else None,
                   measured_gpu_gib=torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None,
                   measured_host_gib=host_rss_peak() / 1e9)
    except torch.OutOfMemoryError as e:
        row.update(status="oom", error=str(e).splitlines()[0][:200])
    finally:
        del model
        free_memory(device)
    return row


def _token_logprobs(hidden_SH: torch.Tensor, head: torch.Tensor, targets_S: torch.Tensor,
                    chunk: int = 4096) -> torch.Tensor:
    """``log p(target)`` per token in fp32, the vocabulary projection a chunk of tokens at a time."""
    out = torch.empty(targets_S.shape[0], dtype=torch.float32, device=hidden_SH.device)
    for s in range(0, targets_S.shape[0], chunk):
        logits = hidden_SH[s:s + chunk].float() @ head.float().T
        out[s:s + chunk] = logits.log_softmax(-1).gather(-1, targets_S[s:s + chunk, None])[:, 0]
        del logits
    return out


def logprob_check(cfg: Config, lengths: list[int]) -> dict[str, Any]:
    """Per-token log-probabilities of megaseq as it trains (fp32 weights, bf16 autocast, the planned fixes
    off: a forward) against the transformers reference in fp32 on the same random weights and tokens.

    Tries ``lengths`` from the longest down and reports the first the reference can run: mean and max
    absolute difference, and the spread of the log-probabilities themselves for scale.
    """
    from megaseq.models.build import build_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    autocast = device.type == "cuda"
    tried: list[dict[str, Any]] = []
    for L in sorted(lengths, reverse=True):
        ref = ours = None
        try:
            ref, spec = build_reference(cfg, device, dtype=torch.float32)  # fp32 weights, not bf16 upcast
            ref = ref.eval()
            g = torch.Generator().manual_seed(cfg.train.seed + 1)
            ids = torch.randint(0, spec.vocab_size, (1, L + 1), generator=g).to(device)
            with torch.no_grad():
                text = getattr(ref.model, "language_model", ref.model)
                h_ref = text(input_ids=ids[:, :-1]).last_hidden_state[0]
                lp_ref = _token_logprobs(h_ref, ref.lm_head.weight, ids[0, 1:])
            ref = h_ref = None
            free_memory(device)
            # built on the CPU as build_reference does: the same seed on a CUDA generator gives other weights
            ours = build_model(spec, dtype=torch.float32, device="cpu", seed=cfg.train.seed).to(device).eval()
            with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                h = ours(ids[:, :-1])[0]
            lp = _token_logprobs(h, ours.lm_head.weight, ids[0, 1:])
            d = (lp - lp_ref).abs()
            row = {"seq_len": L, "status": "ok", "mean_abs_diff": d.mean().item(), "max_abs_diff": d.max().item(),
                   "ref_logprob_mean": lp_ref.mean().item(), "ref_logprob_std": lp_ref.std().item(),
                   "megaseq": "fp32 weights, bf16 autocast", "reference": "transformers, fp32, sdpa"}
            tried.append(row)
            return {"result": row, "tried": tried}
        except torch.OutOfMemoryError as e:
            tried.append({"seq_len": L, "status": "oom", "error": str(e).splitlines()[0][:200]})
        finally:
            del ref, ours
            free_memory(device)
    return {"result": None, "tried": tried}

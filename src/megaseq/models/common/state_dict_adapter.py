"""Hugging Face checkpoint keys <-> megaseq parameter names: the mapping a family's adapter declares.

A checkpoint key becomes a megaseq name by

1. dropping the text-model prefix (``model.language_model.``, ``model.``, ...); ``lm_head.weight`` stays;
2. skipping what megaseq does not model: vision tower keys, the multi-token-prediction layer
   (``layers.{num_layers}``), ``shared_head``, rotary ``inv_freq`` buffers;
3. the family's renames (on-disk name, in-memory name);
4. fusions: per-expert keys ``experts.{j}.gate_proj/up_proj/down_proj.weight`` (a family's
   ``expert_projs``: Mixtral's ``w1/w3/w2``) become slices of
   ``experts.gate_up_proj [E, 2I, H]`` (gate rows first) and ``experts.down_proj [E, H, I]`` (every MoE
   family), plus the family's own (GLM's ``q/k/v_conv1d.weight`` -> thirds of ``conv1d.weight``).
   Fused keys load as they are.

Export is the inverse: ``hf_items`` yields the on-disk keys and tensors (one expert slice at a time),
which ``models.hf_io`` writes as safetensors shards. A family subclasses ``StateDictAdapter`` with its
``export_prefix``, ``renames`` and ``part_fusions``; the tensor I/O never knows the family.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

LOAD_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")
SKIP = re.compile(r"(^|\.)(visual|vision_tower|vision_model|multi_modal_projector)\.|shared_head\.|rotary_emb\.")
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")  # megaseq's (and most families') per-expert names


def _expert_pattern(names: tuple[str, str, str]) -> re.Pattern:
    return re.compile(rf"^(?P<base>.+\.experts)\.(?P<j>\d+)\.(?P<proj>{'|'.join(names)})\.weight$")

Route = tuple[str, tuple, str]  # (fused target name, index into it, slice id)


class StateDictAdapter:
    """One family's key mapping. ``renames``: (on-disk substring, in-memory substring) pairs;
    ``part_fusions``: (regex over a megaseq name with groups ``base`` and ``part``, target suffix, parts),
    e.g. GLM's ``(...)\\.(?P<part>[qkv])_conv1d\\.weight`` -> ``conv1d.weight`` split in thirds q, k, v."""

    export_prefix: str = "model."
    renames: tuple[tuple[str, str], ...] = ()
    part_fusions: tuple[tuple[re.Pattern, str, str], ...] = ()
    # the on-disk names of each expert's gate, up and down projections (Mixtral / Kimi-Linear: w1, w3, w2)
    expert_projs: tuple[str, str, str] = EXPERT_PROJS
    # PEFT's fused-expert adapters (ParamWrapper) fit megaseq's [E, out, in] factors (gpt-oss's transposed,
    # interleaved experts do not: its adapters on the routed experts are not exported in PEFT's format)
    peft_experts: bool = True

    @property
    def _expert(self) -> re.Pattern:
        return _expert_pattern(self.expert_projs)

    # ---- loading ------------------------------------------------------------------------------
    def reader(self, f: Any) -> Any:
        """A checkpoint file as the loader reads it (``get_tensor``, ``get_slice``, ``keys``): the file itself,
        or a view that gives each tensor in megaseq's layout (gpt-oss: transposed experts, MXFP4)."""
        return f

    def carried(self, key: str, num_layers: int) -> bool:
        """Whether an export with ``carry_from`` copies this source tensor unchanged (what megaseq skips)."""
        return self.model_name(key, num_layers) is None

    def model_name(self, key: str, num_layers: int) -> str | None:
        """Checkpoint key -> megaseq name (before fusion); None for keys megaseq deliberately skips."""
        if SKIP.search(key):
            return None
        name = key
        for prefix in LOAD_PREFIXES:
            if key.startswith(prefix):
                name = key[len(prefix):]
                break
        if name.startswith(f"layers.{num_layers}."):  # the MTP layer after the last decoder layer
            return None
        for disk, memory in self.renames:
            if disk in name:
                name = name.replace(disk, memory)
        return name

    def route(self, name: str, targets: dict[str, torch.Tensor]) -> Route | None:
        """A per-expert or per-part key -> (fused target, index into it, slice id); None if not fused."""
        if m := self._expert.match(name):
            j, proj = int(m["j"]), EXPERT_PROJS[self.expert_projs.index(m["proj"])]
            target = f"{m['base']}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
            if target not in targets:
                return None
            E, rows = targets[target].shape[:2]
            if j >= E:
                raise ValueError(f"checkpoint tensor {name}: expert {j} does not exist (the model has {E})")
            if proj == "down_proj":
                return target, (j,), f"{j}"
            half = rows // 2
            part = slice(0, half) if proj == "gate_proj" else slice(half, rows)
            return target, (j, part), f"{j}.{proj}"
        for pattern, suffix, parts in self.part_fusions:
            if m := pattern.match(name):
                target = f"{m['base']}.{suffix}"
                if target not in targets:
                    return None
                size, i = targets[target].shape[0] // len(parts), parts.index(m["part"])
                return target, (slice(i * size, (i + 1) * size),), m["part"]
        return None

    def slices_needed(self, target: str, t: torch.Tensor) -> int:
        """How many slices fill a fused target."""
        if target.endswith(".experts.gate_up_proj"):
            return 2 * t.shape[0]
        if target.endswith(".experts.down_proj"):
            return t.shape[0]
        for _, suffix, parts in self.part_fusions:
            if target.endswith("." + suffix):
                return len(parts)
        raise AssertionError(f"{target} is not a fused tensor")

    # ---- export -------------------------------------------------------------------------------
    def split(self, name: str, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """A fused megaseq tensor -> its on-disk parts (megaseq-side names)."""
        gate, up, down = self.expert_projs
        if name.endswith(".experts.gate_up_proj"):
            base, half = name[: -len(".gate_up_proj")], t.shape[1] // 2
            for j in range(t.shape[0]):
                yield f"{base}.{j}.{gate}.weight", t[j, :half]
                yield f"{base}.{j}.{up}.weight", t[j, half:]
            return
        if name.endswith(".experts.down_proj"):
            base = name[: -len(".down_proj")]
            for j in range(t.shape[0]):
                yield f"{base}.{j}.{down}.weight", t[j]
            return
        for pattern, suffix, parts in self.part_fusions:
            if name.endswith("." + suffix) and pattern.match(f"{name[: -len(suffix) - 1]}.{parts[0]}_{suffix}"):
                base, size = name[: -len(suffix) - 1], t.shape[0] // len(parts)
                for i, part in enumerate(parts):
                    yield f"{base}.{part}_{suffix}", t[i * size:(i + 1) * size]
                return
        yield name, t

    def hf_items(self, model: nn.Module, tie_word_embeddings: bool, dtype: torch.dtype | None,
                 tensors: Iterable[tuple[str, torch.Tensor]] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint key, CPU tensor) in on-disk format; one expert slice at a time. ``tensors``: the
        (megaseq name, tensor) pairs to write (default: ``model.state_dict()``)."""
        for name, t in tensors if tensors is not None else model.state_dict().items():
            if name == "lm_head.weight" and tie_word_embeddings:
                continue  # transformers re-ties it from embed_tokens
            t = t.full_tensor() if hasattr(t, "full_tensor") else t
            for memory_name, part in self.split(name, t.detach()):
                key = memory_name
                for disk, memory in self.renames:
                    key = key.replace(memory, disk)
                key = key if key == "lm_head.weight" else self.export_prefix + key
                yield key, part.to("cpu", dtype or part.dtype).contiguous().clone()

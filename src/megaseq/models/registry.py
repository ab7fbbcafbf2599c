"""The model families megaseq builds: one explicit registry, and what each family declares about itself.

A family is one package ``megaseq.models.<pkg>`` holding

- ``spec.py``                (torch-free) ``FAMILY``, ``from_hf(config.json dict) -> ModelSpec``,
                             ``to_hf(spec) -> dict`` and ``PRESETS``;
- ``model.py``               the CausalLM (on ``models.common.decoder.CausalLM``) and
                             ``FP32_PARAM_SUFFIXES``;
- ``state_dict_adapter.py``  ``ADAPTER``: HF checkpoint keys <-> megaseq names;
- ``parallelize.py``         (only with hooks of its own) ``parallelize(model, settings, env, adapters)``:
                             adapters, memory schemes, expert parallelism and FSDP applied from outside the
                             model; without one the family gets the shared ``parallel.shard.parallelize``.

Adding a family is adding one package and one line to ``FAMILY_PACKAGES``. Everything else (the
planner, the trainer, checkpoint I/O) asks the family through this module, never by its name. Torch-free:
the planner reads it.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType

# the parallelize of a family with no parallelize.py (a module above models/: imported by name, when called)
SHARED_PARALLELIZE = "megaseq.parallel.shard"
# ModelSpec.family -> the family's package (explicit: no import-time scanning)
FAMILY_PACKAGES: dict[str, str] = {
    "glm5_next": "megaseq.models.glm5",
    "qwen3_moe": "megaseq.models.qwen3_moe",
    "olmoe": "megaseq.models.olmoe",
    "mixtral": "megaseq.models.mixtral",
    "glm4_moe": "megaseq.models.glm4_moe",
    "deepseek_v3": "megaseq.models.deepseek_v3",
    "deepseek_v32": "megaseq.models.deepseek_v32",
    "kimi_linear": "megaseq.models.kimi_linear",
    "qwen3_next": "megaseq.models.qwen3_next",
    "gpt_oss": "megaseq.models.gpt_oss",
}


@dataclass(frozen=True)
class Family:
    """What a family is and which schemes its blocks support (read by the planner and the trainer)."""

    name: str  # ModelSpec.family
    hf_model_types: tuple[str, ...]  # config.json model_type values it reads (the text part included)
    layer_kinds: tuple[str, ...]  # token mixers it builds (spec.LAYER_KINDS)
    segmentable: bool  # every token mixer carries its state through SeqContext: sequence segments can run it
    tiles_whole_layer: bool  # the layer tiles all its token-separable parts (else only the MLP/MoE)
    # the parameters a bf16 model keeps in fp32 (its FP32_PARAM_SUFFIXES), by kind, for the planner: "router"
    # (the MoE gate), "kda" (the KDA conv and decay), "hc" (the mHC base and scale)
    fp32_params: tuple[str, ...] = ()
    # how the family's reference trains its routers (``moe.balance auto``): "bias" (the auxiliary-loss-free
    # score-correction bias update, sigmoid routers), "aux_loss" (the load-balancing loss, softmax routers)
    balance: str = "none"
    bias_update_rate: float = 1e-3  # the bias step per optimizer step of the family's reference (DeepSeek-V3)


def family_module(family: str, part: str) -> ModuleType:
    """``megaseq.models.<pkg>.<part>`` of a family (``spec``, ``model``, ``state_dict_adapter``,
    ``parallelize``); a ValueError naming the known families otherwise."""
    if family not in FAMILY_PACKAGES:
        raise ValueError(f"model family {family!r} is not supported; supported: {', '.join(FAMILY_PACKAGES)}")
    return importlib.import_module(f"{FAMILY_PACKAGES[family]}.{part}")


def family(name: str) -> Family:
    """The ``Family`` declaration of ``ModelSpec.family`` ``name``."""
    return family_module(name, "spec").FAMILY


def family_for_model_type(model_type: str | None) -> Family | None:
    """The family that reads a config.json of this ``model_type`` (None: none does)."""
    for name in FAMILY_PACKAGES:
        fam = family(name)
        if model_type in fam.hf_model_types:
            return fam
    return None


def hf_model_types() -> list[str]:
    return sorted(t for name in FAMILY_PACKAGES for t in family(name).hf_model_types)


def parallelize(model, settings, env=None, adapters=None):
    """Apply ``settings`` (``config.MemorySettings``) and ``adapters`` (``config.AdapterSettings``: frozen
    parameters, LoRA) to ``model`` through its family's ``parallelize(model, settings, env, adapters)``;
    returns what was applied (``memory.apply.AppliedMemory``)."""
    spec = getattr(model, "spec", None)
    if spec is None or not hasattr(model, "layers"):
        raise ValueError(f"{type(model).__name__} is not a megaseq CausalLM (no spec, no `layers`): memory "
                         "schemes are applied by a model family's parallelize (docs/architecture.md)")
    return parallelize_module(spec.family).parallelize(model, settings, env, adapters)


def parallelize_module(family: str) -> ModuleType:
    """The module whose ``parallelize`` applies the schemes to a model of ``family``: the family's own
    ``parallelize.py`` where it has hooks of its own, else ``SHARED_PARALLELIZE``."""
    family_module(family, "spec")  # a ValueError naming the known families for an unknown one
    own = f"{FAMILY_PACKAGES[family]}.parallelize"
    return importlib.import_module(own if importlib.util.find_spec(own) else SHARED_PARALLELIZE)

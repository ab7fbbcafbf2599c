"""Which parameters train and where LoRA adapters go, and PEFT's names for them (torch-free).

The runtime (``models.common.lora``) and the planner (``plan.params``) both describe a model as a table
of ``Param(name, shape, kind)`` rows (``kind``: ``linear`` for an ``nn.Linear`` weight, ``experts`` for a
fused routed-expert tensor ``[E, out, in]``, ``other``) and ask this module the same questions, so what
trains and what the planner counts cannot drift apart:

- ``projections(table)``: the matmul weights an adapter may target, with their group (attention, mlp,
  experts). Not targetable: ``lm_head`` (the losses read its weight directly), the embedding, the router,
  and the DSA indexer's projections (the LM loss never reaches the indexer; ``model.train_indexer`` trains it
  in full with its KL objective).
- ``resolve_targets(projs, patterns)``: ``lora.targets`` as PEFT reads ``target_modules``: a name matches a
  pattern when it equals it or ends with ``"." + pattern``; the groups ``attention``, ``mlp``, ``experts``,
  ``all``. Every pattern must match something.
- ``trainable_names(table, patterns)``: ``train.trainable`` glob patterns over parameter names.

PEFT's adapter format (peft 0.21, transformers 5): a linear target ``X`` of the transformers model is
``base_model.model.X.lora_A.weight [r, in]`` and ``.lora_B.weight [out, r]``. A fused expert tensor is
targeted through ``target_parameters`` (PEFT's ``ParamWrapper``): ``lora_A.weight [E * r, in]`` with row
``e * r + k`` expert e's k-th factor, ``lora_B.weight [out, r * E]`` with column ``k * E + e``; several
targeted tensors of one experts module nest, the first registered innermost, so with both targeted
``gate_up_proj``'s keys are ``experts.base_layer.lora_*`` and ``down_proj``'s ``experts.lora_*``.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from megaseq.schemes import REPLAYING  # noqa: F401  (re-exported)

GROUPS = ("attention", "mlp", "experts", "all")
PEFT_ROOT = "base_model.model."
# experts tensors in registration order (PEFT nests its wrappers in this order)
EXPERT_PARAMS = ("gate_up_proj", "down_proj")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class Param:
    """One parameter of a model: its name, shape and what uses it."""

    name: str
    shape: tuple[int, ...]
    kind: str  # "linear" (an nn.Linear weight), "experts" (a fused [E, out, in] tensor) or "other"

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Projection:
    """A matmul weight an adapter can target. ``name``: the linear's module name, or the expert tensor's
    parameter name; ``merged``: the block reads the weight directly (MLA's ``kv_b_proj``), so its adapter
    is folded into the weight at every forward instead of running beside it."""

    name: str
    kind: str  # "linear" or "experts"
    in_features: int
    out_features: int
    num_experts: int = 1
    group: str = "attention"
    merged: bool = False

    def adapter_params(self, rank: int) -> int:
        return rank * self.num_experts * (self.in_features + self.out_features)

    def adapter_shapes(self, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """megaseq's (A, B) shapes: ``[r, in], [out, r]`` for a linear, ``[E, r, in], [E, out, r]`` for experts."""
        if self.kind == "experts":
            E = self.num_experts
            return (E, rank, self.in_features), (E, self.out_features, rank)
        return (rank, self.in_features), (self.out_features, rank)

    @property
    def layer(self) -> int | None:
        return layer_of(self.name)


def layer_of(name: str) -> int | None:
    """The decoder layer index in a parameter or module name (None: outside the layers)."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def _group(module: str) -> str | None:
    """The adapter group of a projection's module name; None when it cannot take an adapter."""
    if ".indexer." in f".{module}." or module in ("lm_head", "embed_tokens"):
        return None
    if ".mlp.experts." in f".{module}.":
        return "experts"
    if ".mlp." in f".{module}.":
        return "mlp"
    return "attention"


def projections(table: list[Param]) -> list[Projection]:
    """The targetable matmul weights of a model described by ``table`` (see the module docstring)."""
    out = []
    for p in table:
        if p.kind == "linear":
            module = p.name.removesuffix(".weight")
            group = _group(module)
            if group is not None:
                out.append(Projection(module, "linear", p.shape[1], p.shape[0], 1, group,
                                      merged=module.endswith("kv_b_proj")))
        elif p.kind == "experts":
            E, O, I = p.shape
            out.append(Projection(p.name, "experts", I, O, E, "experts"))
    return out


def _matches(name: str, pattern: str) -> bool:
    return name == pattern or name.endswith("." + pattern)


def _refusal(pattern: str, table: list[Param]) -> str | None:
    """Why a pattern that names a real but untargetable module is refused (None: it names nothing)."""
    names = [p.name.removesuffix(".weight") for p in table]
    hits = [n for n in names if _matches(n, pattern)]
    if any(".indexer." in f".{n}." for n in hits):
        return (f"lora.targets {pattern!r} names the DSA indexer's projections, which the LM loss never reaches (only "
                "integer indices leave the indexer): drop it; the indexer trains in full, beside the adapters, "
                "with --model.train_indexer true (its KL objective)")
    if any(n in ("lm_head", "embed_tokens") for n in hits):
        return (f"lora.targets {pattern!r}: the embedding and lm_head take no adapters (the losses read "
                "lm_head's weight directly); train them in full with --train.trainable lm_head.weight")
    if hits:
        return (f"lora.targets {pattern!r} names {hits[0]}, which is not a projection (a router, a norm or a "
                "conv): adapters go on nn.Linear projections and the fused routed experts")
    return None


def resolve_targets(projs: list[Projection], patterns: list[str] | tuple[str, ...],
                    table: list[Param] | None = None) -> list[Projection]:
    """The projections ``lora.targets`` selects, in model order; a ValueError for a pattern that matches none."""
    chosen: set[str] = set()
    for pattern in patterns:
        if pattern in GROUPS:
            hit = {p.name for p in projs if pattern == "all" or p.group == pattern}
        else:
            hit = {p.name for p in projs if _matches(p.name, pattern)}
        if not hit:
            why = _refusal(pattern, table or [])
            if why:
                raise ValueError(why)
            leaves = sorted({".".join(p.name.split(".")[-2 if p.kind == "experts" else -1:]) for p in projs})
            groups = f" or a group ({', '.join(GROUPS)})" if pattern not in GROUPS else ""
            raise ValueError(f"lora.targets {pattern!r} matches no projection of this model; its projections: "
                             f"{', '.join(leaves)}{groups}")
        chosen |= hit
    return [p for p in projs if p.name in chosen]


def trainable_names(table: list[Param], patterns: list[str] | tuple[str, ...]) -> set[str]:
    """Parameter names ``train.trainable``'s glob patterns select; a ValueError for one that selects none."""
    out: set[str] = set()
    for pattern in patterns:
        hit = {p.name for p in table if fnmatch.fnmatchcase(p.name, pattern)}
        if not hit:
            close = sorted({p.name for p in table})[:4]
            raise ValueError(f"train.trainable {pattern!r} matches no parameter (glob over names such as "
                             f"{', '.join(close)}; e.g. 'layers.*.self_attn.*', '*norm*', 'lm_head.weight')")
        out |= hit
    return out


# settings whose forward is replayed in backward (``memory.replay``'s users): dropout masks would be drawn again;
# ``REPLAYING`` is derived from the schemes' records (``megaseq.schemes``)


def check_dropout(lora, memory) -> None:
    """``lora.dropout`` (a ``LoraConfig``) with a memory scheme (``MemorySettings``) that reruns the forward in
    backward: the rerun would draw other dropout masks than the forward used, and the gradient would be of
    another function; refused, naming both settings."""
    on = [f"memory.{k}" for k in REPLAYING if getattr(memory, k)]
    if lora.dropout and on:
        raise ValueError(f"lora.dropout {lora.dropout} with {', '.join(on)} (forced, or chosen by the plan): these "
                         "rerun the forward in backward, where dropout would draw other masks and the gradients "
                         "would be wrong; set --lora.dropout 0, or plan without them (--memory.auto false)")


# ---- PEFT's names ----------------------------------------------------------------------------------------
def peft_keys(proj: Projection, targeted: list[Projection], prefix: str) -> tuple[str, str]:
    """PEFT's (lora_A, lora_B) keys of ``proj`` in the transformers model whose modules sit under ``prefix``
    (the family's export prefix, e.g. ``model.``); ``targeted``: every targeted projection (expert wrappers
    nest by how many tensors of the same experts module are targeted)."""
    if proj.kind == "linear":
        base = f"{PEFT_ROOT}{prefix}{proj.name}"
    else:
        module, _, param = proj.name.rpartition(".")
        siblings = [p.name.rpartition(".")[2] for p in targeted
                    if p.kind == "experts" and p.name.rpartition(".")[0] == module]
        order = [q for q in EXPERT_PARAMS if q in siblings]
        depth = len(order) - 1 - order.index(param)
        base = f"{PEFT_ROOT}{prefix}{module}" + ".base_layer" * depth
    return f"{base}.lora_A.weight", f"{base}.lora_B.weight"


def peft_config(targeted: list[Projection], prefix: str, rank: int, alpha: float, dropout: float,
                use_rslora: bool, init: str, base_model: str | None = None) -> dict:
    """The ``adapter_config.json`` PEFT reads back: every target named in full (``target_modules`` for the
    linears, ``target_parameters`` for the expert tensors), so PEFT matches exactly these modules."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": dropout,
        "target_modules": sorted(f"{prefix}{p.name}" for p in targeted if p.kind == "linear"),
        "target_parameters": sorted(f"{prefix}{p.name}" for p in targeted if p.kind == "experts"),
        "use_rslora": use_rslora, "init_lora_weights": True if init == "default" else init,
        "bias": "none", "lora_bias": False, "use_dora": False, "fan_in_fan_out": False,
        "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None,
        "inference_mode": True, "base_model_name_or_path": base_model,
    }


# fields of adapter_config.json megaseq reads as given, and the value each must have (anything else: refused)
_REQUIRED = {"peft_type": "LORA", "use_dora": False, "lora_bias": False, "bias": "none", "fan_in_fan_out": False}
_EMPTY = ("modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform", "trainable_token_indices",
          "layer_replication", "exclude_modules")


def check_peft_config(cfg: dict, path: str, rank: int, alpha: float, use_rslora: bool) -> None:
    """ValueError naming the field when an adapter_config.json asks for what megaseq does not implement, or
    disagrees with ``lora.*``."""
    for key, want in _REQUIRED.items():
        if cfg.get(key, want) != want:
            raise ValueError(f"{path}: {key} = {cfg[key]!r} is not supported (megaseq reads plain LoRA: "
                             f"{key} = {want!r})")
    for key in _EMPTY:
        if cfg.get(key):
            hint = (" (an adapter saved for transformers 4's per-expert layout: re-save it with peft >= 0.21 on "
                    "transformers 5)" if key in ("rank_pattern", "alpha_pattern") else "")
            raise ValueError(f"{path}: {key} = {cfg[key]!r} is not supported; megaseq reads one rank and alpha "
                             f"for every target{hint}")
    for key, mine, flag in (("r", rank, "lora.rank"), ("lora_alpha", alpha, "lora.alpha"),
                            ("use_rslora", use_rslora, "lora.use_rslora")):
        theirs = cfg.get(key, False if key == "use_rslora" else None)
        if theirs != mine and not (isinstance(theirs, (int, float)) and float(theirs) == float(mine)):
            raise ValueError(f"{path}: {key} = {theirs!r} but {flag} = {mine!r}: set --{flag} {theirs}")

"""LoRA adapters and frozen parameters, put on a built model from outside its blocks (a family's
``parallelize`` calls ``apply_adapters``).

Shapes: N tokens (leading dims flattened), M routed rows (sorted by expert), E experts, r the rank,
``in`` / ``out`` a projection's input / output width; ``s`` = alpha / r (alpha / sqrt(r) with rsLoRA).

    linear   y_NO = x_NI W^T + s * B(A(dropout(x_NI)))             A [r, in], B [out, r]  (PEFT's lora.Linear)
    experts  y_MO = grouped_mm(x_MI, W_EOI) + s * grouped_mm(grouped_mm(x_MI, A_Eri), B_EOr)
                                                                    (per-expert factors; PEFT's ParamWrapper)
    merged   W' = W + s * B A, read by a block that uses the weight directly (MLA's kv_b_proj)

Each equals the merged weight's matmul (``W + s B A``) and never forms it for the routed experts, whose
low-rank path keeps only the ``[M, r]`` intermediate. Targets keep their class's computation and state-dict
names: an ``nn.Linear`` target becomes a ``LoRALinear`` (its class swapped, as ``torch.nn.utils.parametrize``
does, so every reference to it stays valid) with children ``lora_A`` / ``lora_B``; an ``Experts`` target
becomes ``LoRAExperts`` with ``lora_A.<tensor>`` / ``lora_B.<tensor>``. Under bf16 autocast the adapter
reads the same bf16 copy of its input as the frozen matmul (cast once), so autograd keeps one copy, not two.

Frozen parameters get ``requires_grad = False`` (no ``.grad``, no optimizer state, not in the clip norm)
and ``frozen_dtype`` decides their storage (bf16 under bf16 autocast: a bf16 residual stream, as the
transformers bf16 model runs). Composes with every memory scheme (the adapters are
parameters of the modules the schemes replay) and with context parallelism (token-separable).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from megaseq.config import AdapterSettings, LoraConfig
from megaseq.models.adapters import EXPERT_PARAMS, Param, Projection, projections, resolve_targets, trainable_names
from megaseq.models.build import fp32_param_suffixes
from megaseq.models.common.moe import Experts
from megaseq.ops import dispatch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}


def is_adapter(name: str) -> bool:
    """A LoRA factor's parameter name."""
    return ".lora_A." in f".{name}" or ".lora_B." in f".{name}"


def frozen_dtype(name: str, compute: torch.dtype | None, param: torch.dtype, keep_fp32: tuple[str, ...]) -> torch.dtype:
    """The dtype a frozen parameter is stored in: the compute dtype (``compute``, bf16 under bf16 autocast on
    a GPU; None: the parameter dtype ``param``), as transformers stores a model of that dtype. It needs no
    fp32 master, and every matmul casts to it anyway; the tensors the family keeps in float32 in a bf16
    model (``keep_fp32``: routers, KDA conv and decay, mHC base/scale) stay float32."""
    if compute is None:
        return param
    return torch.float32 if name.endswith(keep_fp32) else compute


def _mm_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the matmuls under autocast will read it: the base and the adapter then share one copy."""
    dev = x.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev) and x.dtype == torch.float32:
        return x.to(torch.get_autocast_dtype(dev))
    return x


def init_factors(a: torch.Tensor, b: torch.Tensor, fan_in: int, lora: LoraConfig, gen: torch.Generator) -> None:
    """PEFT's ``init_lora_weights``: A Kaiming-uniform (a = sqrt 5: U(+-1/sqrt(in))) or normal(0, 1/r); B zero."""
    with torch.no_grad():
        if lora.init == "gaussian":
            draw = torch.randn(a.shape, generator=gen, dtype=torch.float64) / lora.rank
        else:
            draw = (torch.rand(a.shape, generator=gen, dtype=torch.float64) * 2 - 1) / math.sqrt(fan_in)
        copy_whole(a, draw)
        b.zero_()


def copy_whole(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for a whole ``src``: a DTensor ``dst`` (expert-parallel factors) takes its own slice."""
    if hasattr(dst, "to_local"):
        from torch.distributed.tensor import distribute_tensor

        src = distribute_tensor(src.to(dst.dtype), dst.device_mesh, dst.placements, src_data_rank=None)
    dst.copy_(src)


# ---- the adapted modules ------------------------------------------------------------------------------
class LoRALinear(nn.Linear):
    """An ``nn.Linear`` with a LoRA adapter (``attach_linear`` swaps a target's class to this)."""

    lora_A: nn.Linear
    lora_B: nn.Linear
    scaling: float

    def forward(self, x_NI: torch.Tensor) -> torch.Tensor:
        x_NI = _mm_input(x_NI)
        y_NO = F.linear(x_NI, self.weight, self.bias).contiguous()
        # the scale on the rank-r rows, and B's product added into the base's output by the GEMM itself (beta 1;
        # F.linear's backward does not read its output): no elementwise pass over [N, out] in either direction
        t_Nr = (self.lora_A(self.lora_dropout(x_NI)) * self.scaling).to(y_NO.dtype)
        y_2d = y_NO.view(-1, y_NO.shape[-1])
        y_2d.addmm_(t_Nr.reshape(-1, t_Nr.shape[-1]), self.lora_B.weight.to(y_NO.dtype).t())
        return y_NO

    def delta_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``s * B A [out, in]`` in ``dtype`` (default the weight's; autocast off, as PEFT folds it)."""
        dtype = dtype or self.weight.dtype
        with torch.autocast(self.weight.device.type, enabled=False):
            return (self.lora_B.weight.to(dtype) @ self.lora_A.weight.to(dtype)) * self.scaling

    def merged_weight(self) -> torch.Tensor:
        """``W + s B A``, differentiable in A and B (for blocks that read the weight itself)."""
        return self.weight + self.delta_weight()


def linear_weight(linear: nn.Linear) -> torch.Tensor:
    """The weight a block that reads ``linear.weight`` directly must use: merged with its adapter if any."""
    return linear.merged_weight() if isinstance(linear, LoRALinear) else linear.weight


class LoRAExperts(Experts):
    """Routed experts with per-expert LoRA factors on some of their fused tensors (``attach_experts``)."""

    lora_A: nn.ParameterDict  # tensor name -> [E, r, in]
    lora_B: nn.ParameterDict  # tensor name -> [E, out, r]
    scaling: float

    def factor_names(self) -> list[str]:
        """The adapted tensors, in ``EXPERT_PARAMS`` order (the order of ``expert_tensors``' factors)."""
        return [n for n in EXPERT_PARAMS if n in self.lora_A]

    def expert_tensors(self) -> tuple[torch.Tensor, ...]:
        """The weights, then ``(A, B)`` of each adapted tensor: what expert parallelism shards and sends."""
        factors = [t for n in self.factor_names() for t in (self.lora_A[n], self.lora_B[n])]
        return (self.gate_up_proj, self.down_proj, *factors)

    def routed_rows(self, x_MH: torch.Tensor, tensors: tuple[torch.Tensor, ...],
                    counts_E: torch.Tensor) -> torch.Tensor:
        """The rows through experts given as ``expert_tensors`` (held here or received from another rank)."""
        names = self.factor_names()
        factors = {n: (tensors[2 + 2 * i], tensors[3 + 2 * i]) for i, n in enumerate(names)}
        return self._routed(x_MH, tensors[0], tensors[1], counts_E, factors)

    def routed_mlp(self, x_MH: torch.Tensor, gate_up_EOH: torch.Tensor, down_EHI: torch.Tensor,
                   counts_E: torch.Tensor) -> torch.Tensor:
        if gate_up_EOH is not self.gate_up_proj or down_EHI is not self.down_proj:
            raise ValueError(f"{self.layer}: LoRA experts given other weights run through routed_rows with their "
                             "factors (the expert-parallel dispatch)")
        return self._routed(x_MH, gate_up_EOH, down_EHI, counts_E,
                            {n: (self.lora_A[n], self.lora_B[n]) for n in self.factor_names()})

    def _routed(self, x_MH: torch.Tensor, gate_up_EOH: torch.Tensor, down_EHI: torch.Tensor, counts_E: torch.Tensor,
                factors: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        gu_M2I = self.add_bias(self._project(x_MH, gate_up_EOH, factors.get("gate_up_proj"), counts_E),
                               self.gate_up_proj_bias, counts_E)
        y_MH = self._project(self.activate(gu_M2I), down_EHI, factors.get("down_proj"), counts_E)
        return self.add_bias(y_MH, self.down_proj_bias, counts_E)

    def _project(self, x_MI: torch.Tensor, w_EOI: torch.Tensor, factors: tuple[torch.Tensor, torch.Tensor] | None,
                 counts_E: torch.Tensor) -> torch.Tensor:
        if factors is None:
            return dispatch.call("grouped_mm", x_MI, w_EOI, counts_E, layer=self.layer)
        A_ErI, B_EOr = factors
        x_MI = _mm_input(x_MI)
        y_MO = dispatch.call("grouped_mm", x_MI, w_EOI, counts_E, layer=self.layer)
        t_Mr = dispatch.call("grouped_mm", x_MI, A_ErI, counts_E, layer=f"{self.layer}.lora") * self.scaling
        # the adapter's rows added into the base's in place (no backward reads grouped_mm's output): a tile of
        # routed rows holds the base's [M, O] and the adapter's, where an out-of-place sum would add a scaled copy
        # and the sum. The scale sits on the rank-r rows, so the sum's backward passes its gradient through as is
        return y_MO.add_(dispatch.call("grouped_mm", t_Mr, B_EOr, counts_E, layer=f"{self.layer}.lora"))

    def delta_weight(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``s * B_e A_e`` for every expert: ``[E, out, in]`` in ``dtype`` (default the tensor's)."""
        w = {"gate_up_proj": self.gate_up_proj, "down_proj": self.down_proj}[name]
        dtype = dtype or w.dtype
        B, A = (_whole(t) for t in (self.lora_B[name], self.lora_A[name]))  # every expert's, under ep too
        with torch.autocast(w.device.type, enabled=False):
            return torch.bmm(B.to(dtype), A.to(dtype)) * self.scaling


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A tensor whole: a DTensor's (expert-parallel factors) gathered on every rank, else ``t``."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# ---- attaching ---------------------------------------------------------------------------------------
def attach_linear(linear: nn.Linear, lora: LoraConfig, gen: torch.Generator) -> None:
    """Give ``linear`` an adapter in place (its weight and bias untouched); again: nothing changes."""
    if isinstance(linear, LoRALinear):
        _check_same(linear.lora_A.weight.shape[0], lora)
        return
    assert type(linear) is nn.Linear, f"cannot put LoRA on a {type(linear).__name__}"
    r, dev = lora.rank, linear.weight.device
    dtype = _adapter_dtype(linear.weight)
    linear.__class__ = LoRALinear
    linear.lora_A = nn.Linear(linear.in_features, r, bias=False, device=dev, dtype=dtype)
    linear.lora_B = nn.Linear(r, linear.out_features, bias=False, device=dev, dtype=dtype)
    linear.lora_dropout = nn.Dropout(lora.dropout) if lora.dropout else nn.Identity()
    linear.scaling = lora.scaling
    init_factors(linear.lora_A.weight, linear.lora_B.weight, linear.in_features, lora, gen)


def attach_experts(experts: Experts, names: list[str], lora: LoraConfig, gen: torch.Generator) -> None:
    """Per-expert factors on ``experts``' fused tensors ``names`` (of ``EXPERT_PARAMS``), in place."""
    if isinstance(experts, LoRAExperts):
        _check_same(next(iter(experts.lora_A.values())).shape[1], lora)
        if sorted(experts.lora_A.keys()) != sorted(names):
            raise ValueError(f"{experts.layer}: adapters already on {sorted(experts.lora_A.keys())}, asked for "
                             f"{sorted(names)}; build the model again to change lora.targets")
        return
    r = lora.rank
    experts.__class__ = LoRAExperts
    experts.lora_A, experts.lora_B = nn.ParameterDict(), nn.ParameterDict()
    experts.scaling = lora.scaling
    for name in [n for n in EXPERT_PARAMS if n in names]:
        w = getattr(experts, name)
        E, O, I = w.shape
        kw = dict(device=w.device, dtype=_adapter_dtype(w))
        experts.lora_A[name] = nn.Parameter(torch.empty(E, r, I, **kw))
        experts.lora_B[name] = nn.Parameter(torch.empty(E, O, r, **kw))
        init_factors(experts.lora_A[name], experts.lora_B[name], I, lora, gen)


def _adapter_dtype(w: torch.Tensor) -> torch.dtype:
    """Adapters train in the master dtype: float32 when the base is stored narrower."""
    return w.dtype if torch.finfo(w.dtype).bits >= 32 else torch.float32


def _check_same(rank: int, lora: LoraConfig) -> None:
    if rank != lora.rank:
        raise ValueError(f"the model already has rank-{rank} adapters; lora.rank is {lora.rank}: build it again")


# ---- a whole model ---------------------------------------------------------------------------------------
def param_table(model: nn.Module) -> list[Param]:
    """The base parameters of ``model`` as ``models.adapters`` describes them (adapters left out)."""
    kinds = {}
    for mname, m in model.named_modules():
        if isinstance(m, nn.Linear):
            kinds[f"{mname}.weight"] = "linear"
        elif isinstance(m, Experts):
            kinds.update({f"{mname}.{n}": "experts" for n in EXPERT_PARAMS})
    return [Param(n, tuple(p.shape), kinds.get(n, "other")) for n, p in model.named_parameters() if not is_adapter(n)]


def apply_adapters(model: nn.Module, settings: AdapterSettings) -> list[Projection]:
    """Freeze what ``settings`` does not train, attach its LoRA adapters (seeded by ``settings.seed``) and
    store the frozen matmul weights in ``settings.frozen_dtype``; returns the adapted projections. Nothing
    happens when nothing is frozen; applying the same settings again changes nothing."""
    if not settings.freezes:
        return []
    model.__dict__[FROZEN_BASE] = True  # parallel.fsdp keeps what trains whole (has_frozen_base)
    table = param_table(model)
    train = trainable_names(table, settings.trainable)
    lora = settings.lora
    targets = resolve_targets(projections(table), lora.targets, table) if lora.enabled else []
    check_targets(targets, lora)
    gen = torch.Generator().manual_seed(settings.seed)
    modules = dict(model.named_modules())
    by_experts: dict[str, list[str]] = {}
    for proj in targets:
        if proj.kind == "linear":
            attach_linear(modules[proj.name], lora, gen)
        else:
            module, _, tensor = proj.name.rpartition(".")
            by_experts.setdefault(module, []).append(tensor)
    for module, names in by_experts.items():
        attach_experts(modules[module], names, lora, gen)
    compute = DTYPES[settings.frozen_dtype] if settings.frozen_dtype else None
    keep = fp32_param_suffixes(model.spec.family) if compute is not None else ()
    for name, p in model.named_parameters():
        trains = is_adapter(name) or (name in train and ".indexer." not in name)
        p.requires_grad_(trains)
        if not trains:
            p.grad = None
            p.data = p.data.to(frozen_dtype(name, compute, p.dtype, keep))
    return targets


FROZEN_BASE = "_megaseq_frozen_base"


def has_frozen_base(model: nn.Module) -> bool:
    """Whether ``apply_adapters`` froze part of ``model`` (LoRA or ``train.trainable``): FSDP then shards the
    frozen parameters only and keeps what trains whole on every rank (``parallel.fsdp.apply_fsdp``)."""
    return bool(model.__dict__.get(FROZEN_BASE))


@torch.no_grad()
def draw_adapters(model: nn.Module, settings: AdapterSettings) -> None:
    """Draw every adapter's initial factors again, exactly as ``apply_adapters`` drew them (the same
    generator, the same order): for a model attached on the meta device and then materialised
    (``to_empty``: the factors hold garbage), as the trainer builds one under FSDP from ``model.init_from``."""
    if not settings.lora.enabled:
        return
    lora, gen = settings.lora, torch.Generator().manual_seed(settings.seed)
    modules = dict(model.named_modules())
    table = param_table(model)
    targets = resolve_targets(projections(table), lora.targets, table)
    by_experts: dict[str, list[str]] = {}
    for proj in targets:  # apply_adapters' order: the linears as listed, then each experts module
        if proj.kind == "linear":
            m = modules[proj.name]
            init_factors(m.lora_A.weight, m.lora_B.weight, m.in_features, lora, gen)
        else:
            module, _, tensor = proj.name.rpartition(".")
            by_experts.setdefault(module, []).append(tensor)
    for module, names in by_experts.items():
        m = modules[module]
        for name in [n for n in EXPERT_PARAMS if n in names]:
            init_factors(m.lora_A[name], m.lora_B[name], getattr(m, name).shape[2], lora, gen)


def storage_dtypes(model: nn.Module, settings: AdapterSettings, param: torch.dtype) -> dict[str, torch.dtype]:
    """Each parameter's storage dtype under ``settings`` (for ``build_model(stored=...)``: asked of the model on
    the meta device, so a frozen bf16 base never exists in fp32): frozen ones by ``frozen_dtype``."""
    table = param_table(model)
    train = trainable_names(table, settings.trainable)
    compute = DTYPES[settings.frozen_dtype] if settings.frozen_dtype else None
    keep = fp32_param_suffixes(model.spec.family)
    return {p.name: param if p.name in train and ".indexer." not in p.name
            else frozen_dtype(p.name, compute, param, keep) for p in table}


def check_targets(targets: list[Projection], lora: LoraConfig) -> None:
    """What the chosen targets cannot do, named before anything is built."""
    if lora.dropout:
        folded = [p.name for p in targets if p.kind == "experts" or p.merged]
        if folded:
            raise ValueError(f"lora.dropout {lora.dropout} with {folded[0]} in lora.targets: the routed experts' and "
                             "kv_b_proj's adapters act on their weights (as PEFT's ParamWrapper, which refuses "
                             "dropout too); set --lora.dropout 0 or leave them out of lora.targets")


def adapted(model: nn.Module) -> Iterator[tuple[str, nn.Module, str | None]]:
    """``(projection name, module, expert tensor or None)`` for every adapter of ``model``."""
    for mname, m in model.named_modules():
        if isinstance(m, LoRALinear):
            yield mname, m, None
        elif isinstance(m, LoRAExperts):
            for tensor in m.lora_A.keys():
                yield f"{mname}.{tensor}", m, tensor


def base_items(model: nn.Module, merged: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's state (adapters left out), each adapted weight folded with its adapter when
    ``merged`` (one weight at a time, never a second copy of the model)."""
    deltas = {}
    if merged:
        for name, m, tensor in adapted(model):
            deltas[f"{name}.weight" if tensor is None else name] = (m, tensor)
    for name, t in model.state_dict().items():
        if is_adapter(name):
            continue
        if name in deltas:
            m, tensor = deltas[name]
            if hasattr(t, "full_tensor"):  # an FSDP shard (a frozen base under parallel.fsdp): every rank gathers
                t = t.full_tensor()
            with torch.no_grad():
                wide = torch.promote_types(t.dtype, torch.float32)
                d = m.delta_weight(wide) if tensor is None else m.delta_weight(tensor, wide)
                t = (t.to(wide) + d.to(t.device)).to(t.dtype)  # a base streamed from the host: t on the host
        yield name, t

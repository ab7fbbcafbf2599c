"""``megaseq plan``'s advisor: the fastest configuration of a model that fits the GPUs given, and its command.

Pure Python (no torch). The search walks the settings the runtime accepts, each checked by the runtime's own
config validation (``megaseq.config.load_config``) and the planner's mesh check before it is planned:

- weights: ``model.weights`` fp32 (bf16 autocast) or bf16 (fp32 master and moments in the optimizer);
- sharding: ``parallel.fsdp`` off, dp or dp_cp (several GPUs only);
- ``parallel.cp`` and ``parallel.ep`` in powers of two that divide the GPUs (ep only for MoE models, at 1 and at
  its largest, with or without FSDP and a frozen base; the combinations the trainer refuses are never advised);
- full fine-tuning, then LoRA on a frozen base when the user allows it (``--allow-lora``; a recipe with adapters
  keeps its own rank, alpha and targets);
- the memory fixes: each candidate is planned by ``planner.plan_from_config`` with ``memory.auto``, which picks
  the cheapest exact fixes that fit (``fixes.py``).

Among the candidates that fit, full fine-tuning ranks before LoRA; then the higher estimated tokens/s
(``estimated_step_seconds``: the model FLOPs at the planner's rate, the fixes' costs, context-parallel and FSDP
traffic with nothing overlapped). For each (trainable, weights, fsdp, ep) the smallest cp that fits is planned
(a larger cp leaves fewer data-parallel replicas). When nothing fits, ``nearest`` names what does: a shorter
length, LoRA, more GPUs or more host memory.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from megaseq.config import Config, format_size, load_config
from megaseq.models.spec import ModelSpec
from megaseq.plan.flops import step_flops, step_seconds
from megaseq.plan.mesh import GIB
from megaseq.plan.planner import Plan, plan_from_config

# the ops of the fast set (ops.kernels.FAST_GPU) and what a model needs for each to run: a layer kind, hyper-
# connections (hc) or MoE; None: every model runs it
OP_NEEDS: dict[str, str | None] = {
    "rms_norm": None, "swiglu": None, "linear_cross_entropy": None, "gated_rms_norm": "kda", "kda_gate": "kda",
    "sparse_attention": "dsa", "indexer_topk": "dsa", "hc_mix": "hc", "hc_weights": "hc", "hc_collapse": "hc",
    "hc_merge": "hc", "moe_permute": "moe", "moe_combine": "moe", "indexer_target": "dsa",
}
LORA_SETTINGS = {"lora.rank": 16, "lora.alpha": 32.0, "lora.targets": ["all"]}
GPU_COUNTS = (1, 8, 64)  # what ``--max-len`` and the model table report
# the settings the search chooses (a value the user gives for one of them is kept)
SEARCHED = ("model.weights", "parallel.fsdp", "parallel.cp", "parallel.ep", "parallel.dp")


@dataclass(frozen=True)
class Hardware:
    """The GPUs a run may use: how many, the memory of each, how many share a host and that host's memory."""

    gpus: int = 1
    gpu_bytes: int | None = None  # None: an H200 (plan.fixes.H200_GPU_BYTES)
    gpus_per_host: int = 8
    host_bytes: int | None = None  # per host; None: the planner's default per GPU on the host

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_host < 1:
            raise ValueError(f"--gpus ({self.gpus}) and --gpus-per-host ({self.gpus_per_host}) must be >= 1")


@dataclass
class Choice:
    """One planned configuration: the settings (dotted overrides), its plan and its estimated speed."""

    settings: dict[str, Any]
    overrides: list[str]
    plan: Plan
    step_seconds: float
    tokens_per_s: float
    lora: bool = False
    notes: list[str] = field(default_factory=list)


def model_uses(spec: ModelSpec, op: str) -> bool:
    """Whether ``spec``'s layers run ``op`` (an op of the fast set)."""
    need = OP_NEEDS.get(op)
    kinds = set(spec.layer_types)
    if need is None:
        return True
    if need == "hc":
        return spec.hc_mult > 1
    if need == "moe":
        return spec.num_experts > 0
    return need in kinds


def model_kernels(spec: ModelSpec, planned: list[str] | frozenset[str]) -> list[str]:
    """The fast kernels of ``planned`` that ``spec`` actually runs."""
    return sorted(op for op in planned if model_uses(spec, op))


def _powers(n: int) -> list[int]:
    return [p for p in (1 << i for i in range(n.bit_length())) if n % p == 0]


def _grid(spec: ModelSpec, hw: Hardware, allow_lora: bool, lora_in_recipe: bool) -> Iterator[dict[str, Any]]:
    """The settings to try, full fine-tuning first (a recipe with adapters: LoRA only). Expert parallelism at 1
    and at its largest (the most experts' memory spread); fp32 weights only after bf16 (``candidates``)."""
    experts = spec.num_experts
    eps = [e for e in _powers(hw.gpus) if e <= max(1, experts) and (e == 1 or experts % e == 0)]
    trainables = [True] if lora_in_recipe else [False, True] if allow_lora else [False]
    for lora in trainables:
        for weights in (["fp32"] if lora else ["bf16", "fp32"]):
            for fsdp in (["off", "dp", "dp_cp"] if hw.gpus > 1 else ["off"]):
                for ep in sorted({1, eps[-1]}) if experts else [1]:
                    yield {"lora": lora, "weights": weights, "fsdp": fsdp, "ep": ep,
                           "lora_in_recipe": lora_in_recipe}


def _overrides(setting: dict[str, Any], cp: int, hw: Hardware, seq_len: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {"model.weights": setting["weights"], "parallel.fsdp": setting["fsdp"], "parallel.cp": cp,
                           "parallel.ep": setting["ep"], "parallel.dp": hw.gpus // (cp * setting["ep"])}
    if seq_len:
        out["data.seq_len"] = seq_len
    if setting["lora"] and not setting.get("lora_in_recipe"):  # a recipe's own adapters are kept as given
        out.update(LORA_SETTINGS)
    return out


def estimated_step_seconds(plan: Plan, spec: ModelSpec, mesh_cp: int, lora: bool) -> float:
    """One step's seconds: the model FLOPs on one GPU at the planner's rate (under LoRA less the frozen base's
    weight gradients, ``StepFlops.frozen_share``: a third of the weights' matmuls, none of the attention cores'),
    times the fixes' costs, plus context-parallel and FSDP traffic (none of it overlapped: a ranking, not a
    forecast)."""
    from megaseq.plan.mesh import Mesh

    frozen = step_flops(spec, plan.seq_len).frozen_share if lora else 0.0
    compute = step_seconds(spec, plan.seq_len, plan.batch_size, Mesh(cp=mesh_cp)) * (1 - frozen)
    compute *= 1 + sum(f[1] for f in plan.fixes)
    comm = 0.0
    for kind, v in plan.comm.items():
        if kind in ("fsdp", "expert_grads"):
            comm += v.get("seconds", 0.0)
        elif isinstance(v, dict) and "mode" in v:
            per_layer = v.get(v["mode"], 0.0)
            comm += per_layer * v.get("layers", 1) / CP_BYTES_PER_S
    return compute + comm


CP_BYTES_PER_S = 150e9  # all-to-all within an NVLink host, as a ranking rate


def _plan(source: str | None, base: list[str], overrides: dict[str, Any], hw: Hardware) -> Plan | None:
    """The plan of one setting, or None when the runtime's validation or the mesh check refuses it (each planned
    once: the search for the nearest fit asks again for settings it has planned)."""
    return _plan_once(source, tuple(base), tuple(_flat(overrides)), hw)


@functools.lru_cache(maxsize=4096)
def _plan_once(source: str | None, base: tuple[str, ...], flat: tuple[str, ...], hw: Hardware) -> Plan | None:
    try:
        cfg = load_config(source, [*base, *flat])
        return plan_from_config(cfg, world_size=hw.gpus, gpu_bytes=hw.gpu_bytes, host_bytes=hw.host_bytes,
                                gpus_per_host=min(hw.gpus, hw.gpus_per_host), explain=False)
    except ValueError:
        return None


def _smallest_cp(source: str | None, base: list[str], s: dict[str, Any], hw: Hardware, seq_len: int | None,
                 fixed: dict[str, str]) -> tuple[int, Plan] | None:
    """The smallest cp (a power of two) at which setting ``s`` fits, by bisection (a larger cp holds less of the
    sequence on each GPU), with its plan; None when none fits or the user's fixed settings exclude it."""
    cps = [cp for cp in _powers(hw.gpus // s["ep"])
           if all(str(v) == fixed[k] for k, v in _overrides(s, cp, hw, seq_len).items() if k in fixed)]
    top = None
    while cps and top is None:  # the largest cp the model's heads allow (the mesh check refuses the others)
        top = _plan(source, base, _overrides(s, cps[-1], hw, seq_len), hw)
        if top is None:
            cps.pop()
    if top is None or not top.fits:
        return None
    lo, hi, found = -1, len(cps) - 1, (cps[-1], top)  # cps[hi] fits; cps[lo] does not (or is before the first)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        p = _plan(source, base, _overrides(s, cps[mid], hw, seq_len), hw)
        if p is not None and p.fits:
            hi, found = mid, (cps[mid], p)
        else:
            lo = mid
    return found


def candidates(source: str | None, base: list[str], spec: ModelSpec, hw: Hardware, seq_len: int | None,
               allow_lora: bool = False, lora_in_recipe: bool = False) -> list[Choice]:
    """The fitting configurations, each at the smallest cp that fits for its (trainable, weights, fsdp, ep)."""
    fixed = dict(o.split("=", 1) for o in base if o.split("=", 1)[0] in SEARCHED)  # what the user set stays
    out: list[Choice] = []
    for s in _grid(spec, hw, allow_lora, lora_in_recipe):
        if s["weights"] == "fp32" and not s["lora"] and any(c.settings["weights"] == "bf16" for c in out):
            continue  # bf16 weights hold no more than fp32 ones (the same state, bf16 activations): fp32 only when
            #          no bf16 setting fits, or the user asks for it (--model.weights fp32)
        found = _smallest_cp(source, base, s, hw, seq_len, fixed)
        if found is None:
            continue
        group = []
        for k in (1, 2, 4):  # the smallest cp that fits, and two larger (fewer fixes may beat fewer replicas)
            cp = found[0] * k
            if k > 1 and "parallel.cp" in fixed:
                break
            p = found[1] if k == 1 else _plan(source, base, _overrides(s, cp, hw, seq_len), hw)
            if cp * s["ep"] > hw.gpus or p is None or not p.fits:
                break
            t = estimated_step_seconds(p, spec, cp, s["lora"])
            tokens = p.seq_len * p.batch_size * p.mesh["dp"] * p.mesh["ep"] / max(t, 1e-9)
            group.append(Choice({**s, "cp": cp, "dp": p.mesh["dp"]}, _flat(_overrides(s, cp, hw, seq_len)), p, t,
                                tokens, s["lora"]))
        out.append(max(group, key=lambda c: c.tokens_per_s))
    return out


def _flat(overrides: dict[str, Any]) -> list[str]:
    return [f"{k}={','.join(v) if isinstance(v, list) else v}" for k, v in overrides.items()]


def best(choices: list[Choice]) -> Choice | None:
    """Full fine-tuning before LoRA, then the most tokens/s."""
    return min(choices, key=lambda c: (c.lora, -c.tokens_per_s), default=None)


@dataclass
class Advice:
    """What ``megaseq plan`` prints: the choice (None: nothing fits), the nearest that fits, the command."""

    model: str
    seq_len: int
    hardware: Hardware
    choice: Choice | None
    nearest: list[str]
    command: str = ""
    kernels: list[str] = field(default_factory=list)


class Source:
    """A model as ``megaseq plan`` takes it: a recipe, a HF checkpoint directory or its config.json, with the
    user's own overrides (``base``) and the recipe's resolved config."""

    def __init__(self, path: str | None, base: list[str]) -> None:
        from pathlib import Path

        from megaseq.config import default_recipe

        self.given = path
        self.recipe: str | None = None if path is not None else str(default_recipe())
        self.base = list(base)
        if path is not None:
            p = Path(path)
            if p.is_dir() or p.suffix == ".json":
                if not (p / "config.json" if p.is_dir() else p).is_file():
                    raise ValueError(f"{p} is neither a YAML recipe nor a checkpoint directory with a config.json")
                self.base = [f"model.name={p}", "model.dtype=bf16", "data.kind=random", *self.base]
            else:
                self.recipe = path
        self.cfg: Config = load_config(self.recipe, self.base)

    @property
    def spec(self) -> ModelSpec:
        from megaseq.models.presets import resolve_spec

        return resolve_spec(self.cfg.model.name)


def command(src: Source, choice: Choice, hw: Hardware) -> str:
    """The command that trains ``choice``: ``megaseq train`` on one GPU, ``torchrun`` on several."""
    given = load_config(src.recipe, src.base)  # the recipe with the user's own overrides
    flags, replaced = [], set()
    for o in choice.overrides:
        key, value = o.split("=", 1)
        section, name = key.split(".")
        if str(getattr(getattr(given, section), name)) != value:  # the user's flag, if any, gives way to it
            flags.append(f"--{key} {format_size(int(value)) if key == 'data.seq_len' else value}")
            replaced.add(key)
    user = [f"--{o.split('=', 1)[0]} {o.split('=', 1)[1]}" for o in src.base
            if not o.startswith(("model.dtype=", "data.kind=")) and o.split("=", 1)[0] not in replaced]
    what = src.recipe if src.given is not None and src.recipe else ""
    args = " ".join(x for x in [what, *user, *flags] if x)
    if hw.gpus == 1:
        return f"megaseq train {args}".rstrip()
    per_host = min(hw.gpus, hw.gpus_per_host)
    hosts = -(-hw.gpus // per_host)
    launch = f"torchrun --nproc-per-node {per_host}"
    if hosts > 1:
        launch += f" --nnodes {hosts} --rdzv-backend c10d --rdzv-endpoint HOST0:29500"
    return f"{launch} -m megaseq train {args}".rstrip()


def nearest(src: Source, hw: Hardware, seq_len: int, allow_lora: bool) -> list[str]:
    """What fits when nothing does at ``seq_len`` on ``hw``: a shorter length, LoRA, more GPUs, more host memory
    (each searched coarsely: lengths by halving once the shortest fits, GPUs by hosts of ``gpus_per_host``)."""
    spec, lora_in = src.spec, src.cfg.lora.enabled

    def first(hw_: Hardware, n: int, lora: bool = allow_lora) -> Choice | None:
        return best(candidates(src.recipe, src.base, spec, hw_, n, lora, lora_in))

    out = []
    if seq_len > 1024 and first(hw, 1024):
        n = seq_len // 2
        while n > 1024 and not (c := first(hw, n)):
            n //= 2
        c = first(hw, n) if n <= 1024 else c
        out.append(f"a shorter length: {format_size(n)} tokens ({describe(c)})")
    if not allow_lora and not lora_in and (c := first(hw, seq_len, True)):
        out.append(f"LoRA on a frozen base (--allow-lora): {describe(c)}")
    for gpus in (8, 64, 512):
        if gpus > hw.gpus:
            more = Hardware(gpus, hw.gpu_bytes, hw.gpus_per_host, hw.host_bytes)
            if c := first(more, seq_len):
                out.append(f"more GPUs: {gpus} ({describe(c)})")
                break
    if hw.host_bytes is not None:
        bigger = Hardware(hw.gpus, hw.gpu_bytes, hw.gpus_per_host, hw.host_bytes * 4)
        if c := first(bigger, seq_len):
            out.append(f"more host memory: {hw.host_bytes * 4 / GIB:.0f} GiB per host ({describe(c)})")
    if not lora_in and (why := closest_full(src, hw, seq_len)):
        out.append(why)
    return out


def closest_full(src: Source, hw: Hardware, seq_len: int) -> str:
    """Full fine-tuning's nearest miss on ``hw`` (the grid's settings at cp 1 and 8; the one whose GPU and host
    peaks overshoot their budgets least) and the component that prevents it: the binding GPU component, or the
    largest host one when only the host overflows. '' when no setting plans."""
    worst: tuple[float, str] | None = None
    for s in _grid(src.spec, hw, False, False):
        for cp in sorted({1, min(8, hw.gpus // s["ep"])}):
            p = _plan(src.recipe, src.base, _overrides(s, cp, hw, seq_len), hw)
            if p is None:
                continue
            over = max(p.peak_gpu / p.gpu_budget, p.peak_host / max(p.host_budget, 1))
            if worst is None or over < worst[0]:
                worst = (over, _miss(s, cp, p))
    return worst[1] if worst else ""


def _miss(s: dict[str, Any], cp: int, p: Plan) -> str:
    where = (f"full, {s['weights']} weights, fsdp {s['fsdp']}, dp {p.mesh['dp']}, cp {cp}, ep {s['ep']}: GPU "
             f"{p.peak_gpu / GIB:.1f} of {p.gpu_budget / GIB:.1f} GiB, host {p.peak_host / 1e9:.0f} of "
             f"{p.host_budget / 1e9:.0f} GB a host")
    if p.peak_gpu > p.gpu_budget:
        return f"full fine-tuning comes closest with {where}; the GPU's binding component: {p.binding}"
    name, _, host, _ = max(p.components, key=lambda c: c[2])
    return (f"full fine-tuning comes closest with {where}; the host's binding component: "
            f"{name.removeprefix('host: ')} ({host / 1e9:.0f} GB a GPU)")


def advise(src: Source, hw: Hardware, seq_len: int | None = None, allow_lora: bool = False,
           explain: bool = True) -> Advice:
    """The fastest fitting configuration of ``src`` at ``seq_len`` (default: the recipe's) on ``hw``; when none
    fits, what nearest does (``explain``)."""
    n = seq_len or src.cfg.data.seq_len
    spec = src.spec
    choice = best(candidates(src.recipe, src.base, spec, hw, n, allow_lora, src.cfg.lora.enabled))
    if choice is None:
        return Advice(src.cfg.model.name, n, hw, None, nearest(src, hw, n, allow_lora) if explain else [])
    kernels = model_kernels(spec, choice.plan.mesh.get("fast_kernels", []))
    return Advice(src.cfg.model.name, n, hw, choice, [], command(src, choice, hw), kernels)


def longest(src: Source, hw: Hardware, allow_lora: bool = False, limit: int = 1 << 26) -> tuple[int, Choice | None]:
    """The longest length (a power of two from 1K, at most ``limit``) with a fitting configuration on ``hw``."""
    spec, lora_in = src.spec, src.cfg.lora.enabled
    n, found = 1024, (0, None)
    while n <= limit:
        c = best(candidates(src.recipe, src.base, spec, hw, n, allow_lora, lora_in))
        if c is None:
            break
        found = (n, c)
        n *= 2
    return found


def describe(c: Choice) -> str:
    """One line naming a choice's settings and its GPU peak."""
    s = c.settings
    parts = ["LoRA" if c.lora else "full", f"{s['weights']} weights", f"fsdp {s['fsdp']}", f"dp {s['dp']}",
             f"cp {s['cp']}", f"ep {s['ep']}"]
    return ", ".join(parts) + f"; {c.plan.peak_gpu / GIB:.1f} GiB a GPU"

"""Render a memory plan: a table of components (GPU and host GiB), the chosen fixes with their time
cost, the headroom or the no-fit message, and the per-phase peaks. Plain text, rich, or JSON. And the
advisor's answer as ``megaseq plan`` prints it: the verdict on the settings as given, the advice, and one
``--max-len`` line per GPU count."""

from __future__ import annotations

import io
import json
from typing import Any

from megaseq.config import format_size
from megaseq.plan.advisor import Advice, Choice, describe
from megaseq.plan.mesh import GB, GIB
from megaseq.plan.planner import Plan


def _gib(b: float) -> str:
    return f"{b / GIB:,.2f}" if b else "-"


def _rows(plan: Plan) -> list[tuple[str, str, str, str]]:
    return [(name, _gib(gpu), _gib(host), note) for name, gpu, host, note in plan.components]


def _header(plan: Plan) -> str:
    m = plan.mesh
    gpus = m["dp"] * m["cp"] * m["ep"]
    return (
        f"{plan.model}: {format_size(plan.seq_len)} tokens x batch {plan.batch_size} on {gpus} GPU(s) "
        f"(dp {m['dp']}, cp {m['cp']}, ep {m['ep']}{_fsdp_label(m)}"
        f"{_mla_label(plan)}{_kernels_label(m)})"
    )


def _kernels_label(m: dict[str, Any]) -> str:
    """The fast kernels whose working sets the plan counts (``ops.kernels.planned_fast_ops``), if any."""
    fast = m.get("fast_kernels") or []
    return f", fast kernels planned: {', '.join(fast)}" if fast else ""


def _mla_label(plan: Plan) -> str:
    """How MLA layers go context-parallel: DSA layers by the planned mode, dense MLA always through Ulysses."""
    if plan.mesh["cp"] == 1:
        return ""
    if "dsa" in plan.comm:
        return ", MLA " + plan.mesh["mla_mode"]
    return ", MLA ulysses" if "mla" in plan.comm else ""


def _fsdp_label(m: dict[str, Any]) -> str:
    fsdp = {True: "dp_cp", False: "off"}.get(m.get("fsdp"), m.get("fsdp") or "off")
    label = {"off": "", "dp": ", FSDP over dp", "dp_cp": ", FSDP over dp x cp"}[fsdp]
    return label + (", bf16 weights" if m.get("weights") == "bf16" else "")


def _fsdp_line(v: dict[str, Any]) -> str:
    """FSDP's traffic per step; with sequence segments what each segment's re-gather costs."""
    scatters = (f"{v['reduce_scatters']} reduce-scatters of its gradients" if v["reduce_scatters"] else
                "no reduce-scatter (a frozen base: what trains is whole on every rank, its gradients all-reduced)")
    line = (f"FSDP over {v['ranks']} ranks: {v['all_gathers']} all-gathers of every layer and "
            f"{scatters} per step, {v['bytes'] / GB:.1f} GB sent per "
            f"GPU (~{v['seconds']:.1f} s at {v['bytes_per_s'] / GB:.0f} GB/s if none of it overlaps compute)")
    if v.get("per_segment_bytes"):
        line += (f"; each sequence segment gathers the weights 3 times and reduce-scatters once: "
                 f"{v['per_segment_bytes'] / GB:.1f} GB, ~{v['per_segment_seconds']:.2f} s per segment")
    return line


def _footer(plan: Plan) -> list[str]:
    lines = [
        f"peak GPU {plan.peak_gpu / GIB:.2f} GiB of {plan.gpu_budget / GIB:.2f} GiB "
        f"(tensors {plan.peak_gpu_tensors / GIB:.2f} GiB) at {plan.peak_phase}; "
        f"headroom {plan.headroom / GIB:+.2f} GiB",
        f"peak host {plan.peak_host / GB:.1f} GB per host of {plan.host_budget / GB:.1f} GB",
    ]
    if plan.phases:
        lines.append(
            "phase peaks (tensors): " + ", ".join(f"{k} {v / GIB:.1f} GiB" for k, v in plan.phases.items())
        )
    if plan.fixes:
        lines.append("fixes (estimated step-time cost):")
        lines += [f"  {name:<20} +{cost * 100:5.1f}%  {why}" for name, cost, why in plan.fixes]
    else:
        lines.append("fixes: none needed")
    for kind, v in plan.comm.items():
        if kind == "moe":
            lines.append(f"expert parallel: {v['mode']}, {v['per_layer'] / GB:.2f} GB per MoE layer per step with "
                         f"even routing ({v['per_step'] / GB:.1f} GB over {v['moe_layers']} layers)")
            continue
        if kind == "fsdp":
            lines.append(_fsdp_line(v))
            continue
        if kind == "expert_grads":
            lines.append(f"expert gradients: all-reduced over the {v['ranks']} GPUs holding the same experts, "
                         f"{v['bytes'] / GB:.1f} GB per step ({v['seconds']:.2f} s at {v['bytes_per_s'] / GB:.0f} "
                         "GB/s, not overlapped)")
            continue
        mode = v["mode"]
        lines.append(
            f"context parallel {kind}: {mode}, {v[mode] / GB:.2f} GB per layer per step "
            f"({v['per_step'] / GB:.1f} GB over {v['layers']} layers)"
            + (
                f"; the other mode moves {v['ulysses' if mode == 'gather_kv' else 'gather_kv'] / GB:.2f} GB"
                if "gather_kv" in v
                else ""
            )
        )
    d = plan.expert_dispatch
    if d:
        lines.append(f"expert dispatch ({d['mode']}, {d['chunks']} chunks of {d['c_eff']} tokens): at most "
                     f"{d['rows_in_bound']} rows into a GPU at once whatever the routing (buffer "
                     f"{d['buffer_bound'] / GIB:.2f} GiB, working set {d['working_set'] / GIB:.2f} GiB); plain "
                     f"EP at max/mean load {d['imbalance']:g}: {d['plain_working_set'] / GIB:.2f} GiB")
    if plan.flops:
        lines.append(
            f"model FLOPs per token {plan.flops['per_token'] / 1e9:.1f} GFLOP (training, no recompute)"
        )
    lines.append(plan.advice[0].upper() + plan.advice[1:] if plan.advice else "")
    return lines


def format_plan(plan: Plan, rich: bool | None = None, width: int = 110) -> str:
    """The plan as text; with ``rich`` (default: when the rich package imports) a rich table."""
    if rich is None or rich:
        try:
            return _format_rich(plan, width)
        except ImportError:
            if rich:
                raise
    name_w = max(len(r[0]) for r in _rows(plan))
    lines = [_header(plan), f"{'component':<{name_w}}  {'GPU GiB':>10}  {'host GiB':>10}  note"]
    lines += [f"{n:<{name_w}}  {g:>10}  {h:>10}  {note}" for n, g, h, note in _rows(plan)]
    return "\n".join(lines + _footer(plan))


def _format_rich(plan: Plan, width: int) -> str:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=_header(plan), title_justify="left")
    table.add_column("component")
    table.add_column("GPU GiB", justify="right")
    table.add_column("host GiB", justify="right")
    table.add_column("note")
    for row in _rows(plan):
        table.add_row(*row)
    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=False, color_system=None)
    console.print(table)
    for line in _footer(plan):
        console.print(line, highlight=False, markup=False)
    return buf.getvalue().rstrip("\n")


def plan_json(plan: Plan) -> str:
    """The plan as JSON (what the run directory stores as plan.json)."""
    return json.dumps(plan.to_dict(), indent=2, default=str)


def plan_from_json(text: str) -> Plan:
    data: dict[str, Any] = json.loads(text)
    return Plan.from_dict(data)


# ---- the advisor's verdict and advice (``megaseq plan``) ----------------------------------------------
def format_advice(a: Advice) -> str:
    hw = a.hardware
    head = (f"{a.model} at {format_size(a.seq_len)} tokens a sequence on {hw.gpus} GPU{'s' if hw.gpus > 1 else ''} "
            f"({min(hw.gpus, hw.gpus_per_host)} a host)")
    if a.choice is None:
        lines = [head, "does not fit: no setting megaseq supports fits these GPUs at this length."]
        lines += ["nearest that fits:", *(f"  - {x}" for x in a.nearest)] if a.nearest else ["nothing nearby fits"]
        return "\n".join(lines)
    c = a.choice
    fixes = ", ".join(f[0] for f in c.plan.fixes) or "none"
    return "\n".join([
        head,
        f"fits: {describe(c)} (of {c.plan.gpu_budget / GIB:.1f}), host {c.plan.peak_host / GIB:.1f} of "
        f"{c.plan.host_budget / GIB:.1f} GiB",
        f"memory fixes: {fixes}",
        f"estimated: {c.step_seconds:.1f} s a step, {c.tokens_per_s:,.0f} tokens/s over all GPUs (a ranking, "
        "not a measurement)",
        f"fast kernels it runs: {', '.join(a.kernels) or 'none'}",
        "command:",
        f"  {a.command}",
    ])


def format_verdict(plan: Plan, advice: Advice, as_given_command: str) -> str:
    """The first lines ``megaseq plan`` prints: whether the settings as given fit, and the command to run (theirs
    when they fit; else the fastest configuration that fits; else the nearest that does)."""
    where = f"{plan.peak_gpu / GIB:.1f} GiB a GPU of {plan.gpu_budget / GIB:.1f}"
    if plan.fits:
        lines = [f"FITS as given ({where}); run:", f"  {as_given_command}"]
        if advice.choice is not None and advice.command != as_given_command:
            lines += [f"a faster configuration that fits ({describe(advice.choice)}):", f"  {advice.command}"]
        return "\n".join(lines)
    host = (f", host {plan.peak_host / GIB:.1f} GiB of {plan.host_budget / GIB:.1f}"
            if plan.peak_host > plan.host_budget else "")
    lines = [f"DOES NOT FIT as given ({where}{host}; binding: {plan.binding})."]
    if advice.choice is not None:
        return "\n".join([*lines, f"fits instead ({describe(advice.choice)}); run:", f"  {advice.command}"])
    lines.append("nothing megaseq supports fits these GPUs at this length; the nearest that fits:")
    return "\n".join([*lines, *(f"  - {x}" for x in advice.nearest or ["nothing nearby"])])


def model_table_row(gpus: int, seq_len: int, choice: Choice | None) -> str:
    """One line of ``--max-len``: the longest length on ``gpus`` GPUs and the configuration it takes."""
    if choice is None:
        return f"{gpus} GPU{'s' if gpus > 1 else ''}: nothing fits at 1K tokens"
    return f"{gpus} GPU{'s' if gpus > 1 else ''}: {format_size(seq_len)} tokens ({describe(choice)})"

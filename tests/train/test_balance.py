"""Router balancing as the references train: the bias update, the auxiliary loss, and their statistics.

- the bias update equals the reference rule (Megatron-Core's ``get_updated_expert_bias``: bias +=
  rate * sign(mean - load), the loads of every micro-batch of the step) step by step, the loads recounted
  here with transformers' own router on each layer's input;
- the auxiliary loss and every parameter's gradient equal transformers' ``output_router_logits`` loss
  (``Qwen3MoeForCausalLM``: CE + router_aux_loss_coef * aux), float64;
- the sequence-wise loss beside the bias (DeepSeek-V3 eq. 17-20) and every gradient equal autograd of the formula
  written out (float64), and the default job keeps it on;
- under tiling + recompute and under sequence segments the statistics and gradients equal the plain step;
- ``resolve_balance`` follows each family and refuses what a router cannot train with.

Each comparison has a deliberately broken variant that must fail. The multi-rank equality (2 and 4 gloo
ranks against one process) is in ``test_balance_parallel.py``.
"""

from __future__ import annotations

import inspect
import re
import types

import pytest
import torch
import torch.nn.functional as F

from megaseq.config import MemorySettings, MoEConfig
from megaseq.models.build import build_model
from megaseq.models.presets import get_preset
from megaseq.models.registry import parallelize
from megaseq.models.spec import from_hf_config
from megaseq.parallel.env import ParallelEnv
from megaseq.train.balance import Balancer, BalanceSettings, resolve_balance

transformers = pytest.importorskip("transformers")
from test_moe import promote_hf_routers_  # noqa: E402
from test_qwen3_moe_parity import hf_config, make_pair  # noqa: E402
from transformers.models.glm5_next import modeling_glm5_next as hf_glm  # noqa: E402
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf_qwen  # noqa: E402

torch.set_num_threads(2)
RTOL = 1e-10


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


# ---- the bias update ------------------------------------------------------------------------------------
def reference_bias_step(bias_E: torch.Tensor, loads_E: torch.Tensor, rate: float) -> torch.Tensor:
    """Megatron-Core ``get_updated_expert_bias``: ``bias + sign(mean - load) * rate``."""
    average = loads_E.sum() / loads_E.numel()
    return bias_E + torch.sign(average - loads_E) * rate


def _hf_router_counts(gate: torch.nn.Module, bias_E: torch.Tensor, x_NH: torch.Tensor) -> torch.Tensor:
    """Assignments per expert of transformers' ``Glm5NextTextTopkRouter`` with this gate's weight (the weight
    is not changed by the step's optimizer until after the loads were counted: ``x_NH`` was routed before) and
    the bias ``bias_E`` it had in the forward."""
    E = gate.num_experts
    cfg = hf_glm.Glm5NextTextConfig(hidden_size=x_NH.shape[-1], n_routed_experts=E, num_hidden_layers=1,
                                    num_experts_per_tok=gate.top_k, n_group=gate.n_group,
                                    topk_group=gate.topk_group, norm_topk_prob=gate.norm_topk_prob,
                                    routed_scaling_factor=gate.routed_scaling_factor)
    hf = promote_hf_routers_(torch.nn.Sequential(hf_glm.Glm5NextTextTopkRouter(cfg)).double())[0]
    hf.load_state_dict({"weight": gate.weight.double(), "e_score_correction_bias": bias_E.double()})
    _, _, experts_NK = hf(x_NH.double())
    return torch.bincount(experts_NK.flatten(), minlength=E).double()


def _frozen_gate(gate: torch.nn.Module) -> types.SimpleNamespace:
    return types.SimpleNamespace(weight=gate.weight.detach().clone(), num_experts=gate.num_experts,
                                 top_k=gate.top_k, n_group=gate.n_group, topk_group=gate.topk_group,
                                 norm_topk_prob=gate.norm_topk_prob, routed_scaling_factor=gate.routed_scaling_factor)


def _bias_run(steps: int, micro_batches: int, balancer_cls=Balancer, rate: float = 0.05) -> None:
    """glm5-flash-tiny trained ``steps`` steps of ``micro_batches`` micro-batches; after each step every
    router's bias must equal the reference rule applied to the loads recounted with HF's router."""
    model = build_model(get_preset("glm5-flash-tiny"), dtype=torch.float64, seed=0)
    balancer = balancer_cls(model, BalanceSettings("bias", bias_update_rate=rate), ParallelEnv(), micro_batches)
    inputs: dict[str, list[torch.Tensor]] = {}
    def keep(name: str):  # the router's input: the MoE's, tokens flattened
        return lambda mod, args, out: inputs.setdefault(name, []).append(args[0].detach().flatten(0, -2))

    hooks = [m.register_forward_hook(keep(n)) for n, m in balancer.moes]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)  # large steps: the routing changes between steps
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        before = {n: m.gate.e_score_correction_bias.clone() for n, m in balancer.moes}
        weights = {n: _frozen_gate(m.gate) for n, m in balancer.moes}  # the router as the forward saw it
        inputs.clear()
        for _ in range(micro_batches):
            ids = torch.randint(1, 16, (2, 37), generator=gen)
            loss = model.logits(model(ids)).logsumexp(-1).mean()
            balancer.after_forward()
            loss.backward()
        opt.step()
        opt.zero_grad()
        balancer.after_step()
        for n, m in balancer.moes:
            loads = sum(_hf_router_counts(weights[n], before[n], x) for x in inputs[n])
            want = reference_bias_step(before[n], loads, rate)
            got = m.gate.e_score_correction_bias
            assert torch.equal(got.double(), want.double()), f"{n}: bias {got} != reference {want}"
    for h in hooks:
        h.remove()


def test_bias_update_equals_reference_rule_step_by_step() -> None:
    _bias_run(steps=3, micro_batches=2)


class _LastMicroBatchOnly(Balancer):
    """Broken: the step's loads are the last micro-batch's instead of the sum over micro-batches."""

    def after_forward(self) -> None:
        self._counts_LE = None
        super().after_forward()


def test_bias_update_broken_variant_fails() -> None:
    with pytest.raises(AssertionError, match="bias"):
        _bias_run(steps=1, micro_batches=2, balancer_cls=_LastMicroBatchOnly)


def test_bias_moves_towards_balance() -> None:
    """A router whose bias sends every token to two experts: the update lowers their bias, raises the rest."""
    model = build_model(get_preset("glm5-flash-tiny"), dtype=torch.float64, seed=1)
    balancer = Balancer(model, BalanceSettings("bias", bias_update_rate=0.01), ParallelEnv())
    _, moe = balancer.moes[0]
    with torch.no_grad():
        moe.gate.e_score_correction_bias[[2, 5]] = 10.0
    model(torch.randint(1, 16, (1, 29)))
    balancer.after_forward()
    balancer.after_step()
    bias = moe.gate.e_score_correction_bias
    assert bias[2] == bias[5] == 10.0 - 0.01 and (bias[[0, 1, 3, 4, 6, 7]] == 0.01).all()
    assert balancer.metrics()["moe_max_over_mean"][balancer.moes[0][0]] == 4.0  # 8 experts, top-2: all on 2


# ---- the auxiliary loss against transformers --------------------------------------------------------------
def promoted_hf_aux_loss(module: types.ModuleType) -> types.FunctionType:
    """HF's ``load_balancing_loss_func`` with its float32 sums in float64 (megaseq's statistics are float64)."""
    src = inspect.getsource(module.load_balancing_loss_func)
    new = re.sub(r"\btorch\.float32\b", "torch.float64", src).replace(".float()", ".double()")
    assert new != src, "load_balancing_loss_func has no float32 cast any more: update promoted_hf_aux_loss"
    scope: dict = {}
    exec(compile(new, f"{module.__file__}[aux float64]", "exec"), module.__dict__, scope)
    return scope["load_balancing_loss_func"]


def hf_loss_with_aux(hf: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, module: types.ModuleType,
                     monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(CE in float64 + coef * aux, aux) from transformers' model with ``output_router_logits``."""
    if not module.__name__.endswith("_f64"):  # a family_parity.hf_promoted module is promoted already
        monkeypatch.setattr(module, "load_balancing_loss_func", promoted_hf_aux_loss(module))
    out = hf(input_ids=ids, output_router_logits=True)
    ce = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    return ce + hf.config.router_aux_loss_coef * out.aux_loss, out.aux_loss


def megaseq_step(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, coef: float,
                 balancer_cls=Balancer) -> Balancer:
    """The trainer's step on one micro-batch: CE summed / labelled tokens, the balancer between forward and
    backward (labels shifted as the trainer's data gives them)."""
    balancer = balancer_cls(model, BalanceSettings("aux_loss", aux_loss_coef=coef), ParallelEnv())
    shifted = torch.full_like(labels, -100)
    shifted[:, :-1] = labels[:, 1:]
    logits = model.logits(model(ids))
    ce = F.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=-100, reduction="sum")
    balancer.after_forward()
    (ce / (shifted != -100).sum()).backward()
    balancer.after_step()
    return balancer


def check_aux_loss(hf: torch.nn.Module, ours: torch.nn.Module, ids: torch.Tensor, module: types.ModuleType,
                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A family's aux loss and every gradient of CE + coef * aux equal transformers' (``output_router_logits``)
    on one micro-batch of ``ids`` (labels = ids)."""
    from family_parity import compare_grads

    want, aux = hf_loss_with_aux(hf, ids, ids, module, monkeypatch)
    want.backward()
    balancer = megaseq_step(ours, ids, ids, hf.config.router_aux_loss_coef)
    assert abs(balancer.metrics()["moe_aux_loss"] - float(aux.detach())) < 1e-10 * float(aux.detach())
    compare_grads(hf, ours)


class _PerLayerMean(Balancer):
    """Broken: the mean of per-layer losses (Megatron's form), not HF's layers-concatenated statistics."""

    def after_forward(self) -> None:
        super().after_forward()
        L = len(self.moes)
        for _, m in self.moes:
            E, K = m.gate.num_experts, m.gate.top_k
            c = m.last_tokens_per_expert.double()
            m.aux_grad_E = self.settings.aux_loss_coef * E * (c / (c.sum() / K)) / (c.sum() / K) / L


@pytest.mark.parametrize("broken", [False, True])
def test_aux_loss_and_gradients_match_transformers(broken: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = hf_config(router_aux_loss_coef=0.3, mlp_only_layers=[1])  # a large coefficient: its gradient shows
    hf, ours = make_pair(cfg, seed=61)
    gen = torch.Generator().manual_seed(62)
    ids = torch.randint(1, 53, (2, 23), generator=gen)
    labels = ids.clone()
    labels[0, 3:7] = -100  # ignored labels: CE averages over the rest, the aux loss counts every token
    want, aux_hf = hf_loss_with_aux(hf, ids, labels, hf_qwen, monkeypatch)
    want.backward()
    balancer = megaseq_step(ours, ids, labels, cfg.router_aux_loss_coef, _PerLayerMean if broken else Balancer)
    aux_hf = float(aux_hf.detach())
    assert abs(balancer.metrics()["moe_aux_loss"] - aux_hf) <= RTOL * aux_hf
    mine = dict(ours.named_parameters())
    errs = {n: rel_err(mine[n.removeprefix("model.")].grad, p.grad) for n, p in hf.named_parameters()}
    worst = max(errs.values())
    if broken:
        assert max(errs[n] for n in errs if n.endswith("mlp.gate.weight")) > 1e-6
        return
    assert worst < RTOL, {n: e for n, e in errs.items() if e >= RTOL}
    # the aux loss moved the router gradients: without it they differ from HF's
    assert rel_err(mine["layers.0.mlp.gate.weight"].grad, hf.model.layers[0].mlp.gate.weight.grad) < RTOL


def test_aux_gradient_is_off_without_the_balancer() -> None:
    """A MoE with the aux loss on refuses a backward whose statistics were never set (never silently zero)."""
    model = build_model(get_preset("qwen3-moe-tiny"), dtype=torch.float64, seed=0)
    Balancer(model, BalanceSettings("aux_loss", aux_loss_coef=0.01), ParallelEnv())
    loss = model(torch.randint(1, 16, (1, 9))).sum()
    with pytest.raises(RuntimeError, match="aux_grad_E"):
        loss.backward()


# ---- the sequence-wise balance loss beside the bias (DeepSeek-V3 eq. 17-20) --------------------------------------
def seq_aux_reference(model: torch.nn.Module, ids: torch.Tensor, shifted: torch.Tensor, alpha: float):
    """(CE / tokens + alpha * sum over MoE layers of the mean over sequences of sum_i f_i P_i, that sum without
    alpha): DeepSeek-V3's formula written out, ``s'`` recomputed with autograd from each router's input."""
    moes = [m for m in model.modules() if type(m).__name__ == "MoE"]
    seen: list[tuple[torch.nn.Module, torch.Tensor, torch.Tensor]] = []
    for m in moes:
        def wrapped(x_NH, probs=False, _route=m.gate.route, _m=m):
            out = _route(x_NH, probs=probs)
            seen.append((_m, x_NH, out[1]))
            return out
        m.gate.route = wrapped
    logits = model.logits(model(ids))
    for m in moes:
        del m.gate.route
    ce = F.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=-100, reduction="sum")
    B, T = ids.shape
    bal = 0.0
    for m, x_NH, experts_NK in seen:
        E, K = m.gate.num_experts, m.gate.top_k
        s_NE = F.linear(x_NH, m.gate.weight.to(x_NH.dtype)).sigmoid()
        p_BTE = (s_NE / (s_NE.sum(-1, keepdim=True) + 1e-20)).view(B, T, E)
        hits_BTE = F.one_hot(experts_NK, E).sum(1).view(B, T, E).to(p_BTE.dtype)
        f_BE = E / (K * T) * hits_BTE.sum(1)
        bal = bal + (f_BE * p_BTE.mean(1)).sum(1).mean()
    return ce / (shifted != -100).sum() + alpha * bal, float(bal.detach())


class _BatchWiseCounts(Balancer):
    """Broken: f_i over the whole micro-batch (batch-wise) instead of each sequence's own."""

    def _seq_aux_grads(self) -> None:
        for _, m in self.moes:
            c = m.last_seq_tokens_per_expert
            m.last_seq_tokens_per_expert = c.sum(0, keepdim=True).expand_as(c) / c.shape[0]
        super()._seq_aux_grads()


@pytest.mark.parametrize("broken", [False, True])
def test_seq_aux_loss_and_gradients_match_the_formula(broken: bool) -> None:
    """Every gradient of CE + alpha * the sequence-wise loss equals autograd of DeepSeek-V3's formula, float64;
    two sequences of different routing so that the batch-wise variant differs."""
    alpha = 0.3  # large: its gradient shows beside the CE's
    gen = torch.Generator().manual_seed(8)
    ids = torch.randint(1, 16, (2, 41), generator=gen)
    shifted = torch.full_like(ids, -100)
    shifted[:, :-1] = ids[:, 1:]
    ref = build_model(get_preset("glm5-flash-tiny"), dtype=torch.float64, seed=2)
    want, bal = seq_aux_reference(ref, ids, shifted, alpha)
    want.backward()
    ours = build_model(get_preset("glm5-flash-tiny"), dtype=torch.float64, seed=2)
    balancer = (_BatchWiseCounts if broken else Balancer)(
        ours, BalanceSettings("bias", bias_update_rate=1e-3, seq_aux_loss_coef=alpha), ParallelEnv())
    logits = ours.logits(ours(ids))
    ce = F.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=-100, reduction="sum")
    balancer.after_forward()
    (ce / (shifted != -100).sum()).backward()
    balancer.after_step()
    mine = dict(ours.named_parameters())
    errs = {n: rel_err(mine[n].grad, p.grad) for n, p in ref.named_parameters() if p.grad is not None}
    routers = max(e for n, e in errs.items() if n.endswith("mlp.gate.weight"))
    if broken:
        assert routers > 1e-6
        return
    assert abs(balancer.metrics()["moe_seq_aux_loss"] - bal) <= RTOL * bal
    assert max(errs.values()) < RTOL, {n: e for n, e in errs.items() if e >= RTOL}
    # the loss moved the router gradients: the CE alone gives others
    plain = build_model(get_preset("glm5-flash-tiny"), dtype=torch.float64, seed=2)
    Balancer(plain, BalanceSettings("bias", bias_update_rate=1e-3), ParallelEnv())
    F.cross_entropy(plain.logits(plain(ids)).flatten(0, 1), shifted.flatten(), ignore_index=-100).backward()
    assert rel_err(dict(plain.named_parameters())["layers.1.mlp.gate.weight"].grad,
                   mine["layers.1.mlp.gate.weight"].grad) > 1e-6


def test_default_job_trains_with_the_sequence_wise_loss() -> None:
    """The embedded default job keeps the sequence-wise loss beside the bias: without it its routing collapses
    (docs/models.md: every token on 2 of 8 experts, max/mean 4.0, in most MoE layers at step 60)."""
    from megaseq.config import default_recipe, load_config

    cfg = load_config(default_recipe())
    assert resolve_balance(cfg.moe, get_preset(cfg.model.name)) == BalanceSettings("bias", 0.0, 1e-3, 0.01)


def _default_job_loads(tmp_path, coef: float) -> list[list[float]]:
    """Per-layer max/mean of the last 3 steps of the default job shortened to 40 steps of 512 tokens."""
    import json

    from megaseq.config import default_recipe, load_config
    from megaseq.train.trainer import run_training

    cfg = load_config(default_recipe(), [f"train.run_dir={tmp_path / str(coef)}", "train.steps=40",
                                         "data.seq_len=512", "train.eval_every=0", "train.eval_after=false",
                                         "train.export_hf=false", "log.progress=false",
                                         f"moe.seq_aux_loss_coef={coef}"])
    run_training(cfg)
    rows = [json.loads(line) for line in open(tmp_path / str(coef) / "metrics.jsonl")]
    return [list(r["moe_max_over_mean"].values()) for r in rows if "moe_max_over_mean" in r][-3:]


@pytest.mark.slow  # two 40-step runs, about 20 s each
def test_default_job_routing_collapses_without_the_sequence_wise_loss(tmp_path) -> None:
    """Shortened default job: with the bias alone (the broken variant) most MoE layers end with every token
    on the same 2 of 8 experts (max/mean 4.0); with the sequence-wise loss no layer comes near that (each under
    3.0, averaged over the last 3 steps) and the layers' mean stays under 2. Measured: without 2.5-4.0 (5 of 7
    at 4.0); with 1.4-2.7, mean 1.8 (the CPU's float rounding moves single layers by a few tenths)."""
    without = torch.tensor(_default_job_loads(tmp_path, 0.0)).mean(0)
    assert (without >= 3.9).sum() >= 4, without
    with_loss = torch.tensor(_default_job_loads(tmp_path, 0.01)).mean(0)
    assert with_loss.max() < 3.0 and with_loss.mean() < 2.0, with_loss


def test_seq_aux_loss_refused_where_not_implemented() -> None:
    glm, qwen = get_preset("glm5-flash-tiny"), get_preset("qwen3-moe-tiny")
    assert resolve_balance(MoEConfig(seq_aux_loss_coef=1e-4), glm) == BalanceSettings("bias", 0.0, 1e-3, 1e-4)
    with pytest.raises(ValueError, match="moe.seq_aux_loss_coef is the sequence-wise loss of the sigmoid"):
        resolve_balance(MoEConfig(seq_aux_loss_coef=1e-4), qwen)
    with pytest.raises(ValueError, match="moe.seq_aux_loss_coef complements the bias update"):
        resolve_balance(MoEConfig(seq_aux_loss_coef=1e-4, balance="none"), glm)
    with pytest.raises(ValueError, match="moe.seq_aux_loss_coef must be >= 0"):
        MoEConfig(seq_aux_loss_coef=-1e-4)
    model = build_model(glm, dtype=torch.float64, seed=0)
    for cp, ep in ((2, 1), (1, 2)):  # data parallelism runs it (test_balance_parallel.py); cp and ep do not
        env = types.SimpleNamespace(world_size=2, cp_size=cp, ep_size=ep)
        with pytest.raises(ValueError, match=f"moe.seq_aux_loss_coef with parallel.cp {cp} / parallel.ep {ep}"):
            Balancer(model, BalanceSettings("bias", bias_update_rate=1e-3, seq_aux_loss_coef=1e-4), env)


# ---- memory schemes: the same statistics and gradients ------------------------------------------------------
def _scheme_step(name: str, settings: MemorySettings, mode: str, segment: int = 0) -> tuple[dict, dict, dict]:
    """(grads, biases, load metrics) of one step of preset ``name`` with ``settings`` applied."""
    from megaseq.memory.model_segments import segmented_loss_backward

    model = build_model(get_preset(name), dtype=torch.float64, seed=4)
    parallelize(model, settings)
    seq = mode == "bias+seq"  # the bias update and the sequence-wise loss
    mode = "bias" if seq else mode
    bal = BalanceSettings(mode, aux_loss_coef=0.05 if mode == "aux_loss" else 0.0,
                          bias_update_rate=0.01 if mode == "bias" else 0.0, seq_aux_loss_coef=0.05 if seq else 0.0)
    balancer = Balancer(model, bal, ParallelEnv())
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 16, (2, 48), generator=gen)
    labels = torch.randint(0, 16, (2, 48), generator=gen)

    def loss_fn(hidden: torch.Tensor, lab: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model.logits(hidden).flatten(0, 1), lab.flatten(), reduction="sum")

    if segment:
        segmented_loss_backward(model, ids, labels, loss_fn, 1 / 96, segment, after_forward=balancer.after_forward)
    else:
        loss = loss_fn(model(ids), labels)
        balancer.after_forward()
        (loss / 96).backward()
    balancer.after_step()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    biases = {n: b.clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
    return grads, biases, balancer.metrics()


@pytest.mark.parametrize("name, mode, settings, segment", [
    ("qwen3-moe-tiny", "aux_loss", MemorySettings(tiled_mlp=True, mlp_tile_tokens=13, recompute=True), 0),
    ("glm5-flash-tiny", "bias", MemorySettings(tiled_mlp=True, mlp_tile_tokens=17, recompute=True), 0),
    ("glm5-flash-tiny", "bias", MemorySettings(model_segment_tokens=20), 20),
    ("glm5-flash-tiny", "bias+seq", MemorySettings(model_segment_tokens=20), 20),
])
def test_memory_schemes_keep_statistics_and_gradients(name, mode, settings, segment) -> None:
    plain = _scheme_step(name, MemorySettings(), mode)
    schemed = _scheme_step(name, settings, mode, segment)
    # per-layer loads of the whole batch exactly; the loss values (float sums over the chunks) to RTOL
    assert schemed[2].keys() == plain[2].keys()
    assert schemed[2]["moe_max_over_mean"] == plain[2]["moe_max_over_mean"]
    for k in set(plain[2]) - {"moe_max_over_mean"}:
        assert abs(schemed[2][k] - plain[2][k]) <= RTOL * abs(plain[2][k]), k
    assert schemed[1].keys() == plain[1].keys()
    for n in plain[1]:
        assert torch.equal(schemed[1][n], plain[1][n]), n
    assert schemed[0].keys() == plain[0].keys()
    for n, g in plain[0].items():
        assert rel_err(schemed[0][n], g) < RTOL, n


def test_seq_aux_loss_refuses_a_token_tiled_mlp() -> None:
    with pytest.raises(RuntimeError, match="memory.tiled_mlp, is not implemented"):
        _scheme_step("glm5-flash-tiny", MemorySettings(tiled_mlp=True, mlp_tile_tokens=17), "bias+seq")


# ---- settings -------------------------------------------------------------------------------------------
def test_resolve_balance_follows_the_family() -> None:
    glm, qwen = get_preset("glm5-flash-tiny"), get_preset("qwen3-moe-tiny")
    assert resolve_balance(MoEConfig(), glm) == BalanceSettings("bias", 0.0, 1e-3)
    assert resolve_balance(MoEConfig(), qwen) == BalanceSettings("aux_loss", 1e-3, 0.0)
    assert resolve_balance(MoEConfig(bias_update_rate=0.02), glm).bias_update_rate == 0.02
    assert resolve_balance(MoEConfig(balance="none"), glm).mode == "none"
    coef = from_hf_config(hf_config(router_aux_loss_coef=0.07).to_dict()).router_aux_loss_coef
    assert coef == 0.07  # from config.json
    dense = glm.replace(mlp_types=("dense",) * glm.num_layers)
    assert resolve_balance(MoEConfig(), dense).mode == "none"


@pytest.mark.parametrize("preset, kw, match", [
    ("qwen3-moe-tiny", dict(balance="bias"), "moe.balance bias needs a router with a score-correction bias"),
    ("glm5-flash-tiny", dict(balance="aux_loss"), "moe.balance aux_loss is the softmax routers' loss"),
    ("qwen3-moe-tiny", dict(balance="aux_loss", aux_loss_coef=0.0), "moe.aux_loss_coef"),
])
def test_resolve_balance_refuses(preset, kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_balance(MoEConfig(**kw), get_preset(preset))


def test_moe_config_refuses_bad_values() -> None:
    with pytest.raises(ValueError, match="moe.balance"):
        MoEConfig(balance="loss_free")
    with pytest.raises(ValueError, match="moe.bias_update_rate"):
        MoEConfig(bias_update_rate=-0.5)


def test_seq_aux_loss_with_a_tiled_mlp_is_refused_when_planned() -> None:
    """The trainer refuses the combination right after planning, before any weight exists."""
    from megaseq.config import load_config
    from megaseq.train.parallel_env import ParallelEnv
    from megaseq.train.trainer import make_plan

    cfg = load_config(None, ["moe.seq_aux_loss_coef=0.01", "memory.auto=false", "memory.tiled_mlp=true",
                             "train.device=cpu"])
    with pytest.raises(ValueError, match="moe.seq_aux_loss_coef 0.01 .* memory.tiled_mlp, which was forced"):
        make_plan(cfg, ParallelEnv(torch.device("cpu")), torch.device("cpu"))
    cfg.memory.tiled_mlp = False
    make_plan(cfg, ParallelEnv(torch.device("cpu")), torch.device("cpu"))
    two = ParallelEnv(torch.device("cpu"))
    two.world_size = 2  # as a torchrun of two processes over cp: refused before anything is built
    cfg.parallel.cp = 2
    with pytest.raises(ValueError, match="moe.seq_aux_loss_coef with parallel.cp 2 / parallel.ep 1 is not"):
        make_plan(cfg, two, torch.device("cpu"))


@pytest.mark.parametrize("broken", [False, True])
def test_aux_gradient_lands_on_the_probabilities_device(broken: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under memory.stream_base the router's weight lives in host memory, so the balancer leaves aux_grad_E there
    while the probabilities are on the GPU; the gradient must come back on the probabilities' device. Here the
    probabilities are on the meta device and aux_grad_E on the CPU (a CPU-only stand-in for the GPU and host)."""
    from megaseq.models.common import moe as moe_mod

    if broken:  # the device left as the balancer set it
        real = moe_mod._AuxLossGrad.backward

        def backward(ctx, grad_NK):
            ctx.device = ctx.moe.aux_grad_E.device
            return real(ctx, grad_NK)

        monkeypatch.setattr(moe_mod._AuxLossGrad, "backward", staticmethod(backward))
    N, K, E = 6, 2, 4
    weights_NK = torch.rand(N, K, device="meta", requires_grad=True)
    probs_NE = torch.rand(N, E, device="meta", requires_grad=True)
    holder = types.SimpleNamespace(aux_grad_E=torch.full((E,), 0.5), aux_loss_coef=0.01)
    out = moe_mod._AuxLossGrad.apply(weights_NK, probs_NE, holder, 1)
    if broken:
        with pytest.raises(RuntimeError, match="device"):
            out.sum().backward()
        return
    out.sum().backward()
    assert probs_NE.grad.device.type == "meta" and probs_NE.grad.shape == (N, E)


class _OnTheRouterWeight(Balancer):
    """Broken: each router's gradient where its weight lives (under memory.stream_base, host memory)."""

    def after_forward(self) -> None:
        super().after_forward()
        for _, m in self.moes:
            m.aux_grad_E = torch.zeros(m.aux_grad_E.shape, dtype=m.aux_grad_E.dtype, device=m.gate.weight.device)


@pytest.mark.parametrize("cls", [Balancer, _OnTheRouterWeight])
def test_aux_gradient_goes_where_the_router_ran(cls, monkeypatch: pytest.MonkeyPatch) -> None:
    """The aux loss's gradient is handed to each router on the device of its forward's probabilities, not on its
    weight's (a streamed base keeps the weight in host memory while the router runs on the GPU). The probabilities
    are stood in for by a meta tensor: the balancer reduces the real sums, and must place the gradient on "meta"."""
    model = build_model(get_preset("qwen3-moe-tiny"), dtype=torch.float64, seed=0)
    balancer = cls(model, BalanceSettings("aux_loss", aux_loss_coef=0.01), ParallelEnv())
    model(torch.randint(1, 16, (2, 9), generator=torch.Generator().manual_seed(3)))
    sums = {}
    for name, m in balancer.moes:
        sums[name] = m.last_router_prob_sum
        m.last_router_prob_sum = torch.empty_like(sums[name], device="meta")
    monkeypatch.setattr(Balancer, "_prob_sum", staticmethod(lambda name, m: sums[name]))
    balancer.after_forward()
    placed = {m.aux_grad_E.device.type for _, m in balancer.moes}
    if cls is Balancer:
        assert placed == {"meta"}
    else:
        with pytest.raises(AssertionError):
            assert placed == {"meta"}

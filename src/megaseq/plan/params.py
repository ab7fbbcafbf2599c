"""Every parameter of the model a spec builds, by name and shape, and what trains when the base is frozen.

Pure Python. ``param_table(spec)`` lists what ``models.build.build_model(spec).named_parameters()`` holds
(``tests/plan/test_lora_plan.py`` compares them for every preset), each tagged as ``models.adapters`` needs:
``linear`` (an ``nn.Linear`` weight), ``experts`` (a fused ``[E, out, in]`` tensor) or ``other``. From it and
the run's ``AdapterSettings``, ``trained_counts`` says what the planner must count for a frozen base
(``train.trainable`` patterns, LoRA adapters): the trained parameters per layer (adapters included), the
frozen ones (stored in the compute dtype), and the adapters' low-rank intermediates per token (the
``r``-wide output of each ``A`` that its ``B`` keeps for backward).

Notation: H hidden, E experts, I expert intermediate, K experts per token, r the LoRA rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megaseq.config import AdapterSettings
from megaseq.models.adapters import Param, layer_of, projections, resolve_targets, trainable_names
from megaseq.models.spec import ModelSpec


def _linear(name: str, out: int, inp: int, bias: bool = False) -> list[Param]:
    rows = [Param(f"{name}.weight", (out, inp), "linear")]
    return rows + ([Param(f"{name}.bias", (out,), "other")] if bias else [])


def _norm(name: str, dim: int, bias: bool = False) -> list[Param]:
    return [Param(f"{name}.weight", (dim,), "other")] + ([Param(f"{name}.bias", (dim,), "other")] if bias else [])


def _attention(s: ModelSpec, p: str) -> list[Param]:
    """GQA (``models.common.attention``): q_proj doubled by an output gate (Qwen3-Next), o_proj's own bias
    flag, q/k norms per head or over all heads (``qk_norm_scope``, OLMoE)."""
    H, Hq, Hkv = s.hidden_size, s.num_attention_heads, s.num_key_value_heads
    D, b = s.head_dim or H // Hq, s.attention_bias
    gate = 2 if s.attn_output_gate else 1
    rows = [Param(f"{p}.sinks", (Hq,), "other")] if s.attention_sinks else []  # gpt-oss: one per query head
    rows += (_linear(f"{p}.q_proj", Hq * D * gate, H, b) + _linear(f"{p}.k_proj", Hkv * D, H, b)
            + _linear(f"{p}.v_proj", Hkv * D, H, b) + _linear(f"{p}.o_proj", H, Hq * D, s.o_proj_bias))
    q_dim, k_dim = (D, D) if s.qk_norm_scope == "head" else (Hq * D, Hkv * D)
    return rows + (_norm(f"{p}.q_norm", q_dim) + _norm(f"{p}.k_norm", k_dim) if s.qk_norm else [])


def _gdn(s: ModelSpec, p: str) -> list[Param]:
    """Gated DeltaNet (``models.common.gdn``, Qwen3-Next's ``linear_attn``)."""
    H, Hk, Dk = s.hidden_size, s.linear_num_heads, s.linear_head_dim
    Hv, Dv = s.linear_num_value_heads or Hk, s.linear_value_head_dim or Dk
    conv = 2 * Hk * Dk + Hv * Dv
    return (_linear(f"{p}.in_proj_qkvz", 2 * Hk * Dk + 2 * Hv * Dv, H) + _linear(f"{p}.in_proj_ba", 2 * Hv, H)
            + [Param(f"{p}.conv1d.weight", (conv, 1, s.linear_conv_kernel), "other"),
               Param(f"{p}.dt_bias", (Hv,), "other"), Param(f"{p}.A_log", (Hv,), "other")]
            + _norm(f"{p}.norm", Dv) + _linear(f"{p}.out_proj", H, Hv * Dv))


def _kda(s: ModelSpec, p: str) -> list[Param]:
    H, Hh, D = s.hidden_size, s.linear_num_heads, s.linear_head_dim
    fg = f"{p}.forget_gate"
    return (_linear(f"{p}.q_proj", Hh * D, H) + _linear(f"{p}.k_proj", Hh * D, H) + _linear(f"{p}.v_proj", Hh * D, H)
            + [Param(f"{p}.conv1d.weight", (3 * Hh * D, 1, s.linear_conv_kernel), "other")]
            + _linear(f"{fg}.f_a_proj", D, H) + _linear(f"{fg}.f_b_proj", Hh * D, D)
            + [Param(f"{fg}.dt_bias", (Hh * D,), "other"),
               Param(f"{fg}.A_log", (1, 1, Hh, 1) if s.family == "kimi_linear" else (Hh,), "other")]
            + _linear(f"{p}.b_proj", Hh, H) + _linear(f"{p}.g_a_proj", D, H) + _linear(f"{p}.g_b_proj", Hh * D, D)
            + _norm(f"{p}.o_norm", D) + _linear(f"{p}.o_proj", H, Hh * D))


def _mla(s: ModelSpec, p: str, full_indexer: bool) -> list[Param]:
    """MLA (``models.common.mla``: q through a low-rank ``q_a``/``q_b`` or one ``q_proj`` when ``q_lora_rank``
    is 0), with DSA's indexer (``full_indexer``; GLM-5's pooled one has the kpool tensors, DeepSeek-V3.2's not)."""
    H, Hh, b = s.hidden_size, s.num_attention_heads, s.attention_bias
    ql, R, Dr = s.q_lora_rank, s.kv_lora_rank, s.qk_rope_head_dim
    q = (_linear(f"{p}.q_a_proj", ql, H, b) + _norm(f"{p}.q_a_layernorm", ql)
         + _linear(f"{p}.q_b_proj", Hh * s.qk_head_dim, ql)) if ql else _linear(f"{p}.q_proj", Hh * s.qk_head_dim, H)
    rows = (q + _linear(f"{p}.kv_a_proj_with_mqa", R + Dr, H, b)
            + _norm(f"{p}.kv_a_layernorm", R) + _linear(f"{p}.kv_b_proj", Hh * (s.qk_nope_head_dim + s.v_head_dim), R)
            + _linear(f"{p}.o_proj", H, Hh * s.v_head_dim, b))
    if full_indexer:
        I, Di, ix = s.index_n_heads, s.index_head_dim, f"{p}.indexer"
        rows += (_linear(f"{ix}.wq_b", I * Di, ql) + _linear(f"{ix}.wk", Di, H) + _norm(f"{ix}.k_norm", Di, True)
                 + _linear(f"{ix}.weights_proj", I, H))
        if s.family != "deepseek_v32":  # GLM-5's pooled indexer (models.common.mla_dsa.Indexer)
            rows += [Param(f"{ix}.index_kpool_compress_ape", (s.index_kpool, Di), "other"),
                     Param(f"{ix}.index_kpool_compress_gate", (Di, H), "other")]
    return rows


def _mlp(s: ModelSpec, p: str, kind: str) -> list[Param]:
    H = s.hidden_size
    if kind == "dense":
        I = s.intermediate_size
        return _linear(f"{p}.gate_proj", I, H) + _linear(f"{p}.up_proj", I, H) + _linear(f"{p}.down_proj", H, I)
    E, I = s.num_experts, s.moe_intermediate_size
    rows = [Param(f"{p}.gate.weight", (E, H), "other")]
    rows += [Param(f"{p}.gate.bias", (E,), "other")] if s.router_bias else []  # gpt-oss
    rows += [Param(f"{p}.experts.gate_up_proj", (E, 2 * I, H), "experts"),
             Param(f"{p}.experts.down_proj", (E, H, I), "experts")]
    if s.expert_bias:  # gpt-oss
        rows += [Param(f"{p}.experts.gate_up_proj_bias", (E, 2 * I), "other"),
                 Param(f"{p}.experts.down_proj_bias", (E, H), "other")]
    Is = s.shared_expert_intermediate_size or I * s.num_shared_experts
    if s.shared_expert_gate:  # Qwen3-Next: one gated shared expert (``models.common.moe``)
        rows += _mlp(s.replace(intermediate_size=Is), f"{p}.shared_expert", "dense")
        rows += _linear(f"{p}.shared_expert_gate", 1, H)
    elif s.num_shared_experts:
        rows += _mlp(s.replace(intermediate_size=Is), f"{p}.shared_experts", "dense")
    return rows


def _hc(p: str, N: int, H: int) -> list[Param]:
    width = (2 + N) * N  # pre (N) + post (N) + comb (N x N)
    return [Param(f"{p}.fn", (width, N * H), "other"), Param(f"{p}.base", (width,), "other"),
            Param(f"{p}.scale", (3,), "other")]


def param_table(spec: ModelSpec) -> list[Param]:
    """The parameters of the model ``spec`` builds (``named_parameters``: a tied head is listed once)."""
    s, H, N = spec, spec.hidden_size, spec.hc_mult
    rows = [Param("embed_tokens.weight", (s.vocab_size, H), "other")]
    for i, kind in enumerate(s.layer_types):
        p = f"layers.{i}"
        rows += _hc(f"{p}.attn_hc", N, H) if N > 1 else []
        rows += _norm(f"{p}.input_layernorm", H)
        if kind == "kda":
            rows += _kda(s, f"{p}.self_attn")
        elif kind == "gdn":
            rows += _gdn(s, f"{p}.linear_attn")
        elif kind == "mla":
            rows += _mla(s, f"{p}.self_attn", False)
        elif kind == "dsa":
            rows += _mla(s, f"{p}.self_attn", s.indexer_types[i] == "full")
        else:
            rows += _attention(s, f"{p}.self_attn")
        rows += _hc(f"{p}.ffn_hc", N, H) if N > 1 else []
        rows += _norm(f"{p}.post_attention_layernorm", H) + _mlp(s, f"{p}.mlp", s.mlp_types[i])
    rows += _norm("norm", H)
    return rows + ([] if s.tie_word_embeddings else _linear("lm_head", s.vocab_size, H))


# ---- what trains -----------------------------------------------------------------------------------------
@dataclass
class Trained:
    """A frozen base's counts (elements). Per layer: what trains (non-expert, expert; adapters included), of
    it what sits in the MLP half (``mlp``), the largest trained tensor (its gradient's temporary), the
    adapters' ``r``-wide intermediates per token in the attention and the MLP half (``B``'s saved input; an
    expert adapter's per routed row, so K of them per token), and the weights adapters fold into at each
    forward (``kv_b_proj``). Then the head / embedding / final norm, the frozen parameters (stored in the
    compute dtype: ``models.common.lora.frozen_dtype``), the adapters' total."""

    layers: list[tuple[int, int]]
    mlp: list[int] = field(default_factory=list)
    largest: list[int] = field(default_factory=list)
    lora_rows_attn: list[int] = field(default_factory=list)
    lora_rows_mlp: list[int] = field(default_factory=list)
    merged: list[int] = field(default_factory=list)
    embed: int = 0
    head: int = 0
    final_norm: int = 0
    frozen: int = 0
    adapters: int = 0
    norms: bool = False  # some norm weight trains (in fp32: its output is fp32)
    projections: list[frozenset[str]] = field(default_factory=list)  # per layer: weights with a gradient
    frozen_layers: list[tuple[int, int]] = field(default_factory=list)  # per layer: frozen (non-expert, expert)
    frozen_embed: int = 0  # the frozen embedding / head / final norm (what FSDP gathers outside the layers)
    frozen_head: int = 0
    frozen_final_norm: int = 0

    @property
    def total(self) -> int:
        return self.embed + self.head + self.final_norm + sum(d + x for d, x in self.layers)


def trained_counts(spec: ModelSpec, adapters: AdapterSettings | None, train_indexer: bool = False) -> Trained | None:
    """What a run with these adapter settings trains (None when nothing is frozen: every parameter but the
    DSA indexer trains, as ``plan.components.ParamCounts`` counts it). ``train_indexer`` (``model.train_indexer``):
    the full DSA indexers' parameters train beside the adapters too (``train.indexer_training.enable``)."""
    if adapters is None or not adapters.freezes:
        return None
    table = param_table(spec)
    lora = adapters.lora
    train = {n for n in trainable_names(table, adapters.trainable) if ".indexer." not in n}
    if train_indexer:
        train |= {p.name for p in table if ".indexer." in p.name}
    L = spec.num_layers
    out = Trained(layers=[(0, 0)] * L, projections=[frozenset()] * L, frozen_layers=[(0, 0)] * L,
                  **{k: [0] * L for k in ("mlp", "largest", "lora_rows_attn", "lora_rows_mlp", "merged")})
    for p in table:
        if p.name in train:
            _add(out, p.name, p.numel, p.kind == "experts")
            out.norms |= p.name.endswith("norm.weight")
        else:
            out.frozen += p.numel
            _add_frozen(out, p.name, p.numel, p.kind == "experts")
    trained_w = {p.name.removesuffix(".weight") for p in table if p.name in train}
    targets = resolve_targets(projections(table), lora.targets, table) if lora.enabled else []
    for i in range(L):  # a projection trains through its weight or its adapter (whose A reads its input)
        pre = f"layers.{i}."
        names = trained_w | {p.name for p in targets}
        out.projections[i] = frozenset(n[len(pre):] for n in names if n.startswith(pre))
    if lora.enabled:
        for proj in targets:
            n = proj.adapter_params(lora.rank)
            out.adapters += n
            _add(out, proj.name, n, proj.kind == "experts", max(proj.in_features, proj.out_features)
                 * lora.rank * proj.num_experts)
            i = proj.layer
            if i is None:
                continue
            rows = out.lora_rows_mlp if ".mlp." in proj.name else out.lora_rows_attn
            rows[i] += lora.rank * (spec.num_experts_per_tok if proj.kind == "experts" else 1)
            out.merged[i] += proj.in_features * proj.out_features if proj.merged else 0
    return out


def _add_frozen(out: Trained, name: str, n: int, experts: bool) -> None:
    i = layer_of(name)
    if i is not None:
        d, x = out.frozen_layers[i]
        out.frozen_layers[i] = (d, x + n) if experts else (d + n, x)
    elif name.startswith("embed_tokens"):
        out.frozen_embed += n
    elif name.startswith("lm_head"):
        out.frozen_head += n
    else:
        out.frozen_final_norm += n


def _add(out: Trained, name: str, n: int, experts: bool, largest: int | None = None) -> None:
    i = layer_of(name)
    if i is not None:
        d, x = out.layers[i]
        out.layers[i] = (d, x + n) if experts else (d + n, x)
        out.mlp[i] += n if ".mlp." in name else 0
        out.largest[i] = max(out.largest[i], n if largest is None else largest)
    elif name.startswith("embed_tokens"):
        out.embed += n
    elif name.startswith("lm_head"):
        out.head += n
    else:
        out.final_norm += n

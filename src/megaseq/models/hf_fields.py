"""What a family reads from a Hugging Face config.json, and the one check that refuses the rest.

Each family's ``spec.py`` declares ``HF_FIELDS``: the fields its ``from_hf`` reads, those it carries unchanged
to the export (they never change a training step), and the fields it implements at some values only, with
those values. ``HF_FIELDS.check`` runs first in every family's ``from_hf``: a field outside the declaration,
or a declared field at a value megaseq does not implement, is one ValueError naming the field, its value and
what is supported, before anything is built. So a checkpoint asking for a sliding window, an unknown RoPE
type or any option megaseq does not compute is refused, never silently run as another model.
Torch-free: the planner reads it.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# a field's rule: (the values megaseq implements, what is supported in words), or a function of (value,
# the config section) returning None when implemented, else what is supported
Rule = tuple[tuple[Any, ...], str] | Callable[[Any, dict[str, Any]], str | None]

# PretrainedConfig's own fields (transformers 4 and 5): bookkeeping, generation defaults and output flags
# that never change a training step's numbers. A family's loader accepts these besides its own.
GENERIC_HF_FIELDS = frozenset({
    "_name_or_path", "architectures", "auto_map", "transformers_version", "dtype", "torch_dtype", "model_type",
    "return_dict", "output_hidden_states", "output_attentions", "torchscript", "use_bfloat16", "id2label",
    "label2id", "problem_type", "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder",
    "add_cross_attention", "tie_encoder_decoder", "cross_attention_hidden_size", "pruned_heads",
    "tf_legacy_loss", "finetuning_task", "prefix", "task_specific_params", "tokenizer_class",
    "bos_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id", "use_cache", "initializer_range",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens",
})


def _violation(rule: Rule, value: Any, c: dict[str, Any]) -> str | None:
    if callable(rule):
        return rule(value, c)
    allowed, supported = rule
    return None if value in allowed else supported


def check_hf_fields(c: dict[str, Any], family: str, where: str, known: set[str] | frozenset[str],
                    required: Mapping[str, Rule]) -> None:
    """Refuse a config.json section (``where``: '' or 'text_config.') that asks for what ``family`` does not
    implement: a field of ``required`` whose value breaks its rule (the message says what is supported), or a
    field neither the family (``known``) nor ``GENERIC_HF_FIELDS`` knows."""
    for name, rule in required.items():
        if name in c and (supported := _violation(rule, c[name], c)) is not None:
            raise ValueError(f"config.json {where}{name} = {c[name]!r} is not supported by megaseq's {family}: "
                             f"{supported}")
    unknown = sorted(set(c) - set(known) - set(required) - GENERIC_HF_FIELDS)
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(set(known) | set(required)), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"config.json {where}{unknown[0]}{hint} is not a field megaseq's {family} loader knows"
                         f"{f' (nor {len(unknown) - 1} more: {unknown[1:4]})' if len(unknown) > 1 else ''}; it may "
                         "change the model, so it is refused: remove it if it has no effect on the model")


@dataclass(frozen=True, eq=False)
class HFFields:
    """A family's declaration of the config.json fields it implements."""

    read: frozenset[str]  # the fields from_hf reads into the spec
    carried: frozenset[str] = frozenset()  # fields that never change a training step (kept for the export)
    required: Mapping[str, Rule] = field(default_factory=dict)  # fields implemented at some values only

    def check(self, c: dict[str, Any], family: str, where: str = "") -> None:
        """Refuse ``c`` (a config.json section) where it asks for what the family does not implement."""
        check_hf_fields(c, family, where, self.read | self.carried, self.required)

    def extended(self, read: frozenset[str] = frozenset(), carried: frozenset[str] = frozenset(),
                 required: Mapping[str, Rule] | None = None) -> HFFields:
        """This declaration with more fields (a family built on another: DeepSeek-V3.2 on V3)."""
        return HFFields(self.read | read, self.carried | carried, {**self.required, **(required or {})})


def no_window(value: Any, c: dict[str, Any]) -> str | None:
    return None if value is None else "full causal attention only: set sliding_window null"


# the rules of a family whose attention is full and causal in every layer (no sliding window)
FULL_ATTENTION: dict[str, Rule] = {
    "use_sliding_window": ((False, None), "full causal attention only: set use_sliding_window false"),
    "sliding_window": no_window,
}
# the config.json spellings of RoPE that rope_from_hf reads (a family with RoPE reads these)
ROPE_FIELDS = frozenset({"rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor"})

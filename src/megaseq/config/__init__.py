"""Typed configuration: one dataclass per section, YAML recipes, dotted overrides.

- ``schema``: the sections (``ModelConfig``, ``DataConfig``, ...), ``Config`` and ``AdapterSettings``
- ``settings``: the typed settings the runtime and the planner read (``ParallelConfig``,
  ``ExpertDispatchSettings``, ``MemorySettings``, ``MemoryConfig``)
- ``fields``: ``opt`` (a field with its help and checks as metadata) and ``validate``, the one reader of them;
  ``parse_size`` (and its spelling ``format_size``), ``parse_bytes``, ``parse_duration``
- ``checks``: the rules between settings, as named functions in one place
- ``loading``: recipes, YAML, overrides (``take_overrides``, the one parser), ``build_config``, ``load_config``,
  ``field_help``

Every name below is importable from ``megaseq.config``. No torch import here.
"""

from megaseq.config.checks import HF_WEIGHT_FILES, hf_weights_in
from megaseq.config.fields import format_size, opt, parse_bytes, parse_duration, parse_size, validate
from megaseq.config.loading import (
    RECIPE_PATH_LISTS,
    RECIPE_PATH_OR_NAME,
    _split_override,
    build_config,
    default_recipe,
    field_help,
    load_config,
    read_yaml,
    resolve_recipe_paths,
    split_overrides,
    take_overrides,
)
from megaseq.config.schema import (
    BALANCE_MODES,
    DATA_DEFAULT,
    FAMILY_DEFAULT,
    LORA_INITS,
    SECTIONS,
    AdapterSettings,
    Config,
    DataConfig,
    EvalConfig,
    LogConfig,
    LoraConfig,
    ModelConfig,
    MoEConfig,
    OptimConfig,
    TrainConfig,
)
from megaseq.config.settings import EP_DISPATCH, ExpertDispatchSettings, MemoryConfig, MemorySettings, ParallelConfig
from megaseq.schemes import SEGMENT_EXCLUDED, SEGMENT_SETTING, SIZE_SETTINGS

__all__ = [
    "BALANCE_MODES", "DATA_DEFAULT", "EP_DISPATCH", "FAMILY_DEFAULT", "HF_WEIGHT_FILES", "LORA_INITS",
    "RECIPE_PATH_LISTS",
    "RECIPE_PATH_OR_NAME", "SECTIONS", "SEGMENT_EXCLUDED", "SEGMENT_SETTING", "SIZE_SETTINGS", "AdapterSettings",
    "Config", "DataConfig", "EvalConfig", "ExpertDispatchSettings", "LogConfig", "LoraConfig", "MemoryConfig",
    "MemorySettings", "ModelConfig", "MoEConfig", "OptimConfig", "ParallelConfig", "TrainConfig", "_split_override",
    "build_config", "default_recipe", "field_help", "hf_weights_in", "load_config", "opt", "parse_duration",
    "format_size", "parse_bytes", "parse_size", "read_yaml", "resolve_recipe_paths", "split_overrides",
    "take_overrides", "validate",
]

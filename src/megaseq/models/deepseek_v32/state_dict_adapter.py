"""DeepSeek-V3.2 checkpoint keys: as DeepSeek-V3's (``deepseek_v3.state_dict_adapter``: MTP skipped, FP8
refused), plus the indexer's ``self_attn.indexer.*``."""

from __future__ import annotations

from megaseq.models.deepseek_v3.state_dict_adapter import DeepseekAdapter

ADAPTER = DeepseekAdapter()

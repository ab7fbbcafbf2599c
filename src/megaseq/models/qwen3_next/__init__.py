"""The qwen3_next family (Qwen3-Next, ``Qwen3NextForCausalLM``): config.json in and out + presets (spec), the
model, its checkpoint adapter and its parallelize (see megaseq.models.registry)."""

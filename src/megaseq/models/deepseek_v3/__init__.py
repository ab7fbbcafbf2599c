"""The deepseek_v3 family (DeepSeek-V3 / V3.1 / R1, ``DeepseekV3ForCausalLM``): config.json in and out +
presets (spec), the model, its checkpoint adapter and its parallelize (see megaseq.models.registry)."""

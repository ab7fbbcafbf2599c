"""The deepseek_v32 family (DeepSeek-V3.2, ``DeepseekV32ForCausalLM``): config.json in and out + presets
(spec), the model, its checkpoint adapter and its parallelize (see megaseq.models.registry)."""

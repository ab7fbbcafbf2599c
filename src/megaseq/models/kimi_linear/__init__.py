"""The kimi_linear family (Kimi-Linear, ``KimiLinearForCausalLM``): config.json in and out + presets (spec),
the model, its checkpoint adapter and its parallelize (see megaseq.models.registry)."""

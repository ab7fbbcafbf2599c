"""The mixtral family (Mixtral, ``MixtralForCausalLM``): config.json in and out + presets (spec), the
model, its checkpoint adapter and its parallelize (see megaseq.models.registry)."""

"""The olmoe family (OLMoE, ``OlmoeForCausalLM``): config.json in and out + presets (spec), the model, its
checkpoint adapter and its parallelize (see megaseq.models.registry)."""

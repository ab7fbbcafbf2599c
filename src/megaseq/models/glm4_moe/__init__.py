"""The glm4_moe family (GLM-4.5 / GLM-4.6, ``Glm4MoeForCausalLM``): config.json in and out + presets (spec),
the model, its checkpoint adapter and its parallelize (see megaseq.models.registry)."""

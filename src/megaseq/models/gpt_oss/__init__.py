"""The gpt_oss family (gpt-oss-20b / gpt-oss-120b, ``GptOssForCausalLM``): config.json in and out + presets
(spec), the model, its checkpoint adapter (MXFP4 experts dequantized at load) and its parallelize (see
megaseq.models.registry)."""

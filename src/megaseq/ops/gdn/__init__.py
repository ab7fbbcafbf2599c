"""Op ``gdn`` (the gated delta rule of Qwen3-Next's Gated DeltaNet): the reference (``reference``) and fla's
``chunk_gated_delta_rule`` (``fla``)."""

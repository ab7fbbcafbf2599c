"""Exact memory schemes: each changes only the order and granularity of computation and data movement.

- ``replay``           the one chunked-replay engine every recomputing scheme runs on
- ``vocab_loss``       the chunked linear cross-entropy (never N x V logits)
- ``tiling``           token-separable parts of a layer in tiles, recomputed in backward
- ``kda_segments``     a recurrent token mixer over the sequence in segments, the state carried
- ``offload``          full recompute per layer, SCO boundary offload to an exactly sized pinned pool
- ``model_segments``   sequence segments: the whole model over the sequence a segment at a time
- ``offload_adam``     OffloadStreamAdamW (host fp32 state streamed through two GPU slots)
- ``forwards``         the forwards the schemes install on a module instance, stacked, each removable
- ``apply``            the runtime wrappers a family's ``parallelize`` applies from the memory settings

Each has a float64 CPU test against the plain computation (tests/test_memory_*.py); its memory formula
lives in ``megaseq.plan`` and is imported from there. Nothing is imported here, so
``import megaseq.memory`` does no work.
"""

"""Ops ``kda`` (Kimi delta attention), ``kda_gate`` (its log decay) and ``causal_conv`` (the depthwise causal
conv before it): the pure-torch references (``reference``) and fla's kernels (``fla``)."""

"""Ops ``swiglu`` and ``clamped_swiglu``: the pure-torch references (``reference``) and the fused Triton kernel of
``swiglu`` (``fused``, ``kernels``)."""

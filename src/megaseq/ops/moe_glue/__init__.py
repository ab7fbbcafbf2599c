"""Ops ``moe_permute`` / ``moe_combine`` (the routed rows out of token order and back) and ``grouped_mm`` (one
GEMM per expert): the references (``reference``), torch's grouped GEMM (``grouped_mm``) and the fused Triton
permute/combine (``fused``, ``kernels``)."""

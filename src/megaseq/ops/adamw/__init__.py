"""The AdamW step of fp32 master weights in one Triton kernel per parameter group (``fused``, ``kernels``);
``memory.master_adam`` calls it, torch's fused AdamW is its reference."""

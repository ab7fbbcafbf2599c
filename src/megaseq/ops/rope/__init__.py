"""Op ``rope``: rotary position embeddings of an attention layer's queries and keys (the half-split layout), the
pure-torch reference (``reference``) and Liger Kernel's fused Triton kernel (``liger``)."""

"""Ops ``linear_cross_entropy`` and ``chunked_linear_cross_entropy`` (the LM head and its loss): the references
(``reference``) and Liger's fused kernel (``liger``)."""
